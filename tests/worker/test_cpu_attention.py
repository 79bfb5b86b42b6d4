"""The C++ CPU decode kernel (`pagedlab.worker.cpu_attention`) equals the torch reference (`decode_attention`)
over a grid of shapes: dtypes, GQA ratios, head_dims compiled in (64, 80, 128) or not (16, 48), block sizes,
sliding windows, lengths that end mid-block; and without the kernel the engine falls back to the torch path."""

from __future__ import annotations

import pytest
import torch

from pagedlab.worker import cpu_attention
from pagedlab.worker.attention import AttentionMetadata, decode_attention

LENS = [1, 2, 15, 16, 17, 33, 40, 300, 301, 64, 5, 128]
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _case(block_size, q_heads, kv_heads, head_dim, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in LENS) + 4
    shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=generator).to(dtype)
    value_cache = torch.randn(shape, generator=generator).to(dtype)
    pool = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()  # block 0 pads the tables
    tables, used = [], 0
    for n in LENS:
        count = -(-n // block_size)
        tables.append(pool[used : used + count])
        used += count
    max_blocks = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables])
    lens = torch.tensor(LENS)
    query = torch.randn(len(LENS), q_heads, head_dim, generator=generator).to(dtype)
    return query, key_cache, value_cache, padded, lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sliding_window", [None, 8, 100])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize(
    "q_heads, kv_heads, head_dim",
    [(9, 3, 64), (5, 1, 80), (4, 4, 16), (8, 2, 128), (2, 1, 48), (14, 2, 64), (6, 1, 128)],
)
def test_kernel_equals_reference(kernel, dtype, sliding_window, block_size, q_heads, kv_heads, head_dim):
    query, key_cache, value_cache, tables, lens = _case(block_size, q_heads, kv_heads, head_dim, dtype)
    scale = head_dim**-0.5
    metadata = AttentionMetadata(torch.zeros(len(LENS), dtype=torch.long), len(LENS), tables, lens, [])
    expected = decode_attention(query.float(), key_cache.float(), value_cache.float(), metadata, scale, sliding_window)
    got = cpu_attention.paged_decode_cpu(query, key_cache, value_cache, tables, lens, scale, sliding_window,
                                         module=kernel)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


def test_strided_query_and_output_rows(kernel):
    """The model hands over a transposed view of its query, and the output is a slice of a larger buffer."""
    query, key_cache, value_cache, tables, lens = _case(16, 9, 3, 64, torch.float32)
    metadata = AttentionMetadata(torch.zeros(len(LENS), dtype=torch.long), len(LENS), tables, lens, [])
    strided = query.transpose(0, 1).contiguous().transpose(0, 1)  # [seqs, heads, dim] with head stride seqs*dim
    out = torch.full((len(LENS) + 3, 9, 64), float("nan"))
    cpu_attention.paged_decode_cpu(strided, key_cache, value_cache, tables, lens, 0.125, None, out[: len(LENS)],
                                   module=kernel)
    torch.testing.assert_close(out[: len(LENS)], decode_attention(query, key_cache, value_cache, metadata, 0.125, None))
    assert out[len(LENS) :].isnan().all()  # nothing written past the rows asked for


def test_bad_shapes_are_refused(kernel):
    query, key_cache, value_cache, tables, lens = _case(16, 9, 3, 64, torch.float32)
    with pytest.raises(RuntimeError, match="head shapes"):
        cpu_attention.paged_decode_cpu(query[:, :8], key_cache, value_cache, tables, lens, 0.1, None, module=kernel)
    with pytest.raises(RuntimeError, match="dtype"):
        cpu_attention.paged_decode_cpu(query, key_cache.double(), value_cache.double(), tables, lens, 0.1, None,
                                       module=kernel)


def test_build_name_changes_with_the_source(monkeypatch, tmp_path):
    name = cpu_attention.build_name()
    assert name.startswith("pagedlab_paged_decode_cpu_")
    copy = tmp_path / "paged_decode_cpu.cpp"
    copy.write_text(cpu_attention.SOURCE.read_text() + "\n// changed\n")
    monkeypatch.setattr(cpu_attention, "SOURCE", copy)
    assert cpu_attention.build_name() != name


def test_the_same_source_elsewhere_shares_one_build(monkeypatch, tmp_path):
    """Another checkout, virtual environment or wheel with the same source loads the same build (it used to name
    its own, so the wheel test and every fresh install compiled again), compiled from the copy beside it."""
    name = cpu_attention.build_name()
    copy = tmp_path / "paged_decode_cpu.cpp"
    copy.write_text(cpu_attention.SOURCE.read_text())
    monkeypatch.setattr(cpu_attention, "SOURCE", copy)
    assert cpu_attention.build_name() == name
    build = tmp_path / "build"
    build.mkdir()
    source = cpu_attention._source_copy(build)
    assert source == build / copy.name and source.read_text() == copy.read_text()


def test_without_a_compiler_the_engine_falls_back_with_a_warning(monkeypatch, tmp_path):
    """No compiler: one warning, and decoding runs on the torch path with the same tokens."""
    from pagedlab import LLMEngine
    from pagedlab.config import EngineConfig
    from tests.helpers import hf_greedy, random_prompts, run_engine, tiny_model

    monkeypatch.setattr(cpu_attention, "CACHE_DIR", tmp_path)  # nothing cached there
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("PAGEDLAB_CPU_KERNEL", "1")
    cpu_attention.load.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="could not be built"):
            build = cpu_attention.load()
        assert build.module is None and build.error
        assert cpu_attention.kernel() is None
        model = tiny_model("llama-gqa3-hd80")
        prompts = random_prompts([5, 17, 9])
        engine = LLMEngine(model, None, EngineConfig(block_size=4, num_kv_blocks=128))
        assert run_engine(engine, prompts, 8, "all-at-once") == hf_greedy(model, prompts, max_new_tokens=8)
    finally:
        cpu_attention.load.cache_clear()  # the next caller builds (or loads) the real kernel again


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("PAGEDLAB_CPU_KERNEL", "0")
    assert cpu_attention.kernel() is None


def test_a_stale_build_lock_is_removed(tmp_path):
    """A build killed half-way leaves its lock behind; torch's builder would wait for it forever."""
    import os
    import time

    lock = tmp_path / "lock"
    lock.touch()
    cpu_attention._clear_stale_lock(lock)
    assert lock.exists()  # young: perhaps another process building now
    old = time.time() - cpu_attention.STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    cpu_attention._clear_stale_lock(lock)
    assert not lock.exists()
    cpu_attention._clear_stale_lock(lock)  # and no lock at all is fine
