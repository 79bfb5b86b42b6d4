"""The Triton kernels (`pagedlab.kernels`) against their torch references, over a grid of shapes.

Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set below before triton is
imported). Every slot of the cache that a sequence does not own — unused slots of its last block, other blocks,
the padding of its block table — holds NaN, so a kernel that reads one fails the comparison.

The default grid is the representative one (a few minutes on a 2-core CPU); with CUDA, or with
PAGEDLAB_FULL_KERNEL_GRID=1, the full grid runs (`scripts/gpu_check.py` does that).

Tolerances: float32 atol = rtol = 1e-5 (observed under the interpreter: <= 1e-6); bfloat16 and float16
atol = rtol = 1.6e-2 (one bf16 ulp at magnitude 2, the reference rounds its float64 result to bfloat16 too).
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.slow  # a few minutes under the interpreter: `make test-fast` leaves it out


def _interpret_triton_stdlib() -> None:
    """Make `tl.zeros`, `tl.sum`, `tl.max`... callable by the interpreter when triton was imported before
    TRITON_INTERPRET was set (tests/helpers.py imports transformers, which imports triton): triton.language's
    own @jit helpers are then compiled-mode JITFunctions, which an interpreted kernel cannot call. Re-wraps
    each one, once, as the InterpretedFunction that `triton.jit` would have made. A no-op when the variable
    was set in time; setting it at the top of conftest.py makes this function dead code."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0") or not isinstance(tl.zeros, JITFunction):
        return
    interpreted = {}
    for namespace in (tl, tl.core, tl.standard, tl.math, tl.core.tensor):
        for name, value in list(vars(namespace).items()):
            if isinstance(value, JITFunction):
                if id(value) not in interpreted:
                    interpreted[id(value)] = InterpretedFunction(value.fn)
                setattr(namespace, name, interpreted[id(value)])


_interpret_triton_stdlib()

from pagedlab.kernels.backend import triton_attention  # noqa: E402
from pagedlab.kernels.paged_decode import PARTITION_SIZE, paged_decode, use_split_k  # noqa: E402
from pagedlab.kernels.paged_prefill import paged_prefill  # noqa: E402
from pagedlab.kernels.reference import (  # noqa: E402
    paged_decode_reference,
    paged_prefill_reference,
    store_kv_reference,
)
from pagedlab.kernels.store_kv import store_kv  # noqa: E402
from pagedlab.worker.cuda_graph import EagerGraph, capture_sizes  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FULL = torch.cuda.is_available() or os.environ.get("PAGEDLAB_FULL_KERNEL_GRID", "0") not in ("", "0")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
       torch.float16: dict(atol=1.6e-2, rtol=1.6e-2)}
HEADS = {1: (2, 2), 3: (6, 2), 5: (5, 1), 8: (8, 1)}  # GQA ratio -> (q_heads, kv_heads)
# a case: (GQA ratio, head_dim, block_size, dtype)
GRID = list(itertools.product([1, 3, 5], [64, 80], [1, 16, 32], [torch.float32, torch.bfloat16]))
EXTRA = [  # the full grid's extras: other head dims, block sizes, float16
    (8, 96, 256, torch.float16), (1, 128, 8, torch.float16), (3, 96, 64, torch.bfloat16), (5, 16, 2, torch.float32),
]


def case_id(case) -> str:
    ratio, head_dim, block_size, dtype = case
    return f"gqa{ratio}-d{head_dim}-bs{block_size}-{str(dtype).removeprefix('torch.')}"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def paged_cache(seq_lens, block_size, num_kv_heads, head_dim, dtype, seed=0):
    """Caches where sequence s owns the first seq_lens[s] slots of its blocks, all else NaN.

    Blocks come from a random permutation of a pool twice as large as needed; the block tables' padding
    points at an unused (NaN) block. Returns key_cache, value_cache, block_tables (int32), all on DEVICE.
    """
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [cdiv(n, block_size) for n in seq_lens]
    num_blocks = 2 * sum(blocks_per_seq) + 2
    pool = torch.randperm(num_blocks, generator=generator)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"))
    value_cache = torch.full(shape, float("nan"))
    block_tables = torch.full((len(seq_lens), max(blocks_per_seq)), int(pool[-1]), dtype=torch.int32)
    taken = 0
    for s, n in enumerate(seq_lens):
        block_ids = pool[taken : taken + blocks_per_seq[s]]
        taken += blocks_per_seq[s]
        block_tables[s, : len(block_ids)] = block_ids
        positions = torch.arange(n)
        slots = block_ids[positions // block_size] * block_size + positions % block_size
        for cache in (key_cache, value_cache):
            cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(n, num_kv_heads, head_dim, generator=generator)
    return key_cache.to(DEVICE, dtype), value_cache.to(DEVICE, dtype), block_tables.to(DEVICE)


def random_query(num_rows, num_heads, head_dim, dtype, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, num_heads, head_dim, generator=generator).to(DEVICE, dtype)


def decode_lens(block_size: int) -> list[int]:
    """1, mid-block, exactly on a block boundary, a longer ragged one."""
    return [1, block_size + cdiv(block_size, 2) if block_size > 1 else 7, 2 * block_size, 97]


def run_decode(case, lens, sliding_window=None, split_k=False):
    ratio, head_dim, block_size, dtype = case
    num_q_heads, num_kv_heads = HEADS[ratio]
    key_cache, value_cache, block_tables = paged_cache(lens, block_size, num_kv_heads, head_dim, dtype)
    query = random_query(len(lens), num_q_heads, head_dim, dtype)
    context_lens = torch.tensor(lens, device=DEVICE)
    scale = head_dim**-0.5
    args = (query, key_cache, value_cache, block_tables, context_lens, scale, sliding_window)
    out = paged_decode(*args, split_k=split_k)
    torch.testing.assert_close(out, paged_decode_reference(*args), **TOL[dtype])


# ---------------------------------------------------------------------------------------------- decode, v1


@pytest.mark.parametrize("case", GRID + (EXTRA if FULL else []), ids=case_id)
def test_decode_matches_reference(case):
    run_decode(case, decode_lens(case[2]))


@pytest.mark.parametrize("sliding_window", [1, 7, 40, 1000])
@pytest.mark.parametrize("case", [(3, 80, 16, torch.float32), (5, 64, 1, torch.bfloat16)], ids=case_id)
def test_decode_sliding_window(case, sliding_window):
    run_decode(case, decode_lens(case[2]), sliding_window)


# ---------------------------------------------------------------------------------------- decode, split-K

SPLIT_LENS = [1, 2 * PARTITION_SIZE, 2 * PARTITION_SIZE + 77, PARTITION_SIZE - 1]  # 1, 2, 3 and 1 partition(s)
SPLIT_GRID = list(itertools.product([1, 3, 5], [64, 80], [16], [torch.float32, torch.bfloat16]))


@pytest.mark.parametrize(
    "case",
    SPLIT_GRID if FULL else [(1, 64, 16, torch.float32), (3, 80, 16, torch.bfloat16), (5, 80, 32, torch.float32)],
    ids=case_id,
)
def test_split_k_matches_reference(case):
    run_decode(case, SPLIT_LENS, split_k=True)


@pytest.mark.parametrize("sliding_window", [1, 100, PARTITION_SIZE + 3])
def test_split_k_sliding_window(sliding_window):
    """Windows that start inside, or skip whole, partitions."""
    run_decode((3, 64, 16, torch.float32), SPLIT_LENS, sliding_window, split_k=True)


def test_split_k_reuses_its_workspace():
    key_cache, value_cache, block_tables = paged_cache([700, 1100], 16, 1, 64, torch.float32)
    query, lens = random_query(2, 3, 64, torch.float32), torch.tensor([700, 1100], device=DEVICE)
    workspace: dict = {}
    first = paged_decode(query, key_cache, value_cache, block_tables, lens, split_k=True, workspace=workspace)
    buffers = {name: t.data_ptr() for name, t in workspace.items()}
    second = paged_decode(query, key_cache, value_cache, block_tables, lens, split_k=True, workspace=workspace)
    assert sorted(buffers) == ["split_k_max", "split_k_out", "split_k_sum"]
    assert {name: t.data_ptr() for name, t in workspace.items()} == buffers
    torch.testing.assert_close(first, second, rtol=0, atol=0)


def test_use_split_k_rule():
    assert use_split_k(batch_size=1, max_context_len=8192, num_kv_heads=8, num_sms=132)
    assert not use_split_k(batch_size=64, max_context_len=8192, num_kv_heads=8, num_sms=132)  # grid is full
    assert not use_split_k(batch_size=1, max_context_len=PARTITION_SIZE, num_kv_heads=8, num_sms=132)


# --------------------------------------------------------------------------------------------- prefill

# (num_context, num_new) per chunk: a lone token, a chunk ending on a block boundary, chunks after a context
# ending mid-block or on a boundary, and one longer than a query tile.
def prefill_chunks(block_size: int) -> list[tuple[int, int]]:
    return [(0, 1), (0, 2 * block_size if block_size > 1 else 9), (5, 40), (2 * block_size, 3), (17, 70)]


def run_prefill(case, chunks, sliding_window=None, index_dtype=torch.int32):
    ratio, head_dim, block_size, dtype = case
    num_q_heads, num_kv_heads = HEADS[ratio]
    key_cache, value_cache, block_tables = paged_cache([c + n for c, n in chunks], block_size, num_kv_heads,
                                                       head_dim, dtype)
    block_tables = block_tables.to(index_dtype)
    query_start_loc = torch.tensor([0] + list(itertools.accumulate(n for _, n in chunks)), device=DEVICE)
    num_context = torch.tensor([c for c, _ in chunks], device=DEVICE)
    query = random_query(int(query_start_loc[-1]), num_q_heads, head_dim, dtype)
    scale = head_dim**-0.5
    args = (query, key_cache, value_cache, query_start_loc, num_context, block_tables, scale, sliding_window)
    torch.testing.assert_close(paged_prefill(*args), paged_prefill_reference(*args), **TOL[dtype])


PREFILL_QUICK = [  # every ratio, head dim and block size with each dtype
    (1, 64, 1, torch.float32), (3, 80, 16, torch.float32), (5, 80, 32, torch.float32),
    (1, 80, 32, torch.bfloat16), (3, 64, 1, torch.bfloat16), (5, 64, 16, torch.bfloat16),
]
# On a GPU each float32 prefill variant takes ~5 s to compile (its exact dot is unrolled on FMA units), so
# the full grid there keeps only the quick float32 cases.
PREFILL_FULL = [c for c in GRID if not torch.cuda.is_available() or c[3] != torch.float32 or c in PREFILL_QUICK]


@pytest.mark.parametrize("case", PREFILL_FULL + EXTRA if FULL else PREFILL_QUICK, ids=case_id)
def test_prefill_matches_reference(case):
    run_prefill(case, prefill_chunks(case[2]))


def test_float32_head_dim_256_takes_smaller_tiles():
    """The tiles the compile test (test_kernels_compile.py) made the wrappers pick for float32 at head dim 256
    (32 keys in decode, 16 in prefill, so as to fit an L4's shared memory without spilling) are right too."""
    case = (1, 256, 16, torch.float32)
    run_decode(case, decode_lens(16))
    run_prefill(case, prefill_chunks(16))


def test_the_wrappers_hand_the_kernels_int32_indices(monkeypatch):
    """Whatever integer dtype the caller's block tables, lengths and offsets have (the engine's eager step builds
    int64 ones), the kernels read int32: one variant per tile, the one the compile grid and the sweep check (with
    int64 tables some tiles spilled on sm_80 and sm_89: issue 31). Int64 tables give the same output."""
    import pagedlab.kernels.paged_decode as decode_module
    import pagedlab.kernels.paged_prefill as prefill_module

    seen = {}

    def recorder(name, kernel):
        class Launch:
            def __getitem__(self, grid):
                def launch(*args, **constants):
                    seen[name] = [a.dtype for a in args if isinstance(a, torch.Tensor) and not a.is_floating_point()]
                    return kernel[grid](*args, **constants)
                return launch
        return Launch()

    for module, name in ((decode_module, "paged_decode_kernel"), (decode_module, "paged_decode_split_kernel"),
                         (prefill_module, "paged_prefill_kernel")):
        monkeypatch.setattr(module, name, recorder(name, getattr(module, name)))
    case = (3, 64, 16, torch.float32)
    lens = decode_lens(16)
    key_cache, value_cache, tables = paged_cache(lens, 16, 2, 64, torch.float32)
    query = random_query(len(lens), 6, 64, torch.float32)
    wide = (tables.long(), torch.tensor(lens, dtype=torch.long, device=DEVICE))
    for split_k in (False, True):
        out = paged_decode(query, key_cache, value_cache, *wide, split_k=split_k)
        narrow = paged_decode(query, key_cache, value_cache, tables, wide[1].int(), split_k=split_k)
        torch.testing.assert_close(out, narrow, rtol=0, atol=0)
    run_prefill(case, prefill_chunks(16), index_dtype=torch.long)
    assert seen == {name: [torch.int32] * len(dtypes) for name, dtypes in seen.items()} and len(seen) == 3, seen


@pytest.mark.parametrize("sliding_window", [1, 8, 33])
def test_prefill_sliding_window(sliding_window):
    run_prefill((3, 80, 16, torch.float32), prefill_chunks(16), sliding_window)


def test_prefill_rows_outside_chunks_are_untouched():
    key_cache, value_cache, block_tables = paged_cache([4], 16, 2, 64, torch.float32)
    query = random_query(6, 2, 64, torch.float32)
    out = torch.full_like(query, 7.0)
    query_start_loc = torch.tensor([2, 5], device=DEVICE)  # rows 2..4 only (one chunk of 3, 1 token cached)
    num_context = torch.tensor([1], device=DEVICE)
    paged_prefill(query, key_cache, value_cache, query_start_loc, num_context, block_tables, 0.125, out=out)
    assert (out[:2] == 7).all() and (out[5:] == 7).all() and not (out[2:5] == 7).any()


# ------------------------------------------------------------------------------------------------ store


def test_store_kv_skips_negative_slots():
    num_tokens, num_kv_heads, head_dim, block_size = 9, 3, 80, 4
    generator = torch.Generator().manual_seed(3)
    key = torch.randn(num_kv_heads, num_tokens, head_dim, generator=generator).transpose(0, 1).to(DEVICE)  # as HF
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(DEVICE)
    slots = torch.randperm(8 * block_size, generator=generator)[:num_tokens]
    slots[[0, 4, 8]] = -1  # padded tokens
    slots = slots.to(DEVICE)
    caches = [torch.full((8, block_size, num_kv_heads, head_dim), float("nan"), device=DEVICE) for _ in range(4)]
    store_kv(key, value, caches[0], caches[1], slots)
    store_kv_reference(key, value, caches[2], caches[3], slots)
    torch.testing.assert_close(caches[0], caches[2], equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(caches[1], caches[3], equal_nan=True, rtol=0, atol=0)
    assert caches[0].isnan().sum() == caches[0].numel() - 6 * num_kv_heads * head_dim  # 3 tokens skipped


# ---------------------------------------------------------------------------------------------- backend


@pytest.mark.parametrize("sliding_window", [None, 6])
def test_triton_attention_equals_torch_path(sliding_window):
    """A ragged step (2 decodes, a fresh prefill, a chunk after a cached context) through both backends."""
    from pagedlab.worker.attention import (
        AttentionMetadata,
        PagedAttentionContext,
        PrefillChunk,
        paged_attention_forward,
    )

    num_q_heads, num_kv_heads, head_dim, block_size, num_blocks = 6, 2, 80, 4, 24
    generator = torch.Generator().manual_seed(5)
    # cached tokens before this step: decode 0 has 6, decode 1 has 9, prefill 0 none, prefill 1 has 5
    block_ids = [torch.tensor(ids, device=DEVICE) for ids in ([3, 7], [11, 1, 20], [5, 9], [2, 17, 8])]
    num_cached = [6, 9, 0, 5]
    num_new = [1, 1, 7, 6]
    kv_cache = torch.randn(1, 2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(DEVICE)
    slots = torch.cat([ids[torch.arange(c, c + n, device=DEVICE) // block_size] * block_size
                       + torch.arange(c, c + n, device=DEVICE) % block_size
                       for ids, c, n in zip(block_ids, num_cached, num_new)])
    num_tokens = sum(num_new)
    metadata = AttentionMetadata(
        slot_mapping=slots,
        num_decodes=2,
        decode_block_tables=torch.tensor([[3, 7, 0], [11, 1, 20]], device=DEVICE),  # padded with block 0
        decode_context_lens=torch.tensor([7, 10], device=DEVICE),
        prefills=[PrefillChunk(2, 9, 0, block_ids[2]), PrefillChunk(9, 15, 5, block_ids[3])],
    )
    # as Hugging Face hands them over: [1, heads, num_tokens, head_dim], transposed views
    query = torch.randn(1, num_tokens, num_q_heads, head_dim, generator=generator).to(DEVICE).transpose(1, 2)
    key = torch.randn(1, num_tokens, num_kv_heads, head_dim, generator=generator).to(DEVICE).transpose(1, 2)
    value = torch.randn(1, num_tokens, num_kv_heads, head_dim, generator=generator).to(DEVICE).transpose(1, 2)
    scale = 0.1

    torch_cache = kv_cache.clone()
    module = torch.nn.Module()
    module.layer_idx = 0
    expected, _ = paged_attention_forward(module, query, key, value, None, scale, sliding_window=sliding_window,
                                          pagedlab_context=PagedAttentionContext(metadata, torch_cache))

    key_cache, value_cache = kv_cache[0]
    out = triton_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                           key_cache, value_cache, metadata, scale, sliding_window)
    torch.testing.assert_close(kv_cache, torch_cache, rtol=0, atol=0)
    torch.testing.assert_close(out, expected[0], **TOL[torch.float32])
    # the next layer of the same step writes into the same buffer: nothing is allocated per layer
    again = triton_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                             key_cache, value_cache, metadata, scale, sliding_window)
    assert again.data_ptr() == out.data_ptr()


# ----------------------------------------------------------------------------------------------- errors


def test_wrapper_errors_are_clear():
    key_cache, value_cache, block_tables = paged_cache([5, 3], 4, 2, 64, torch.float32)
    context_lens = torch.tensor([5, 3], device=DEVICE)
    query = random_query(2, 6, 64, torch.float32)

    def decode(**changes):
        args = dict(query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
                    context_lens=context_lens)
        return paged_decode(**{**args, **changes})

    with pytest.raises(ValueError, match="query has 9 heads, not a multiple of the cache's 2 KV heads"):
        decode(query=random_query(2, 9, 64, torch.float32))
    with pytest.raises(ValueError, match="query has head_dim 80 but the cache has head_dim 64"):
        decode(query=random_query(2, 6, 80, torch.float32))
    with pytest.raises(ValueError, match="query is torch.bfloat16 but the caches are torch.float32"):
        decode(query=query.bfloat16())
    with pytest.raises(ValueError, match=r"block_tables must have shape \[2, \*\]"):
        decode(block_tables=block_tables[:1])
    with pytest.raises(ValueError, match="context_lens must be an integer tensor"):
        decode(context_lens=context_lens.float())
    with pytest.raises(ValueError, match="query must be float32, float16 or bfloat16"):
        decode(query=query.double())
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        decode(context_lens=torch.empty(2, dtype=torch.int64, device="meta"))
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        decode(sliding_window=0)
    with pytest.raises(ValueError, match="must both be"):
        decode(value_cache=value_cache[:, :2])
    with pytest.raises(ValueError, match="query_start_loc must have shape"):
        paged_prefill(query, key_cache, value_cache, torch.tensor([0, 2], device=DEVICE),
                      torch.tensor([0, 0], device=DEVICE), block_tables)
    with pytest.raises(ValueError, match="slot_mapping must be an int tensor"):
        store_kv(query[:, :2], query[:, :2], key_cache, value_cache, torch.zeros(2, device=DEVICE))


def test_kernels_package_imports_no_triton():
    """pagedlab runs without Triton: `import pagedlab.kernels` (HAS_TRITON) must not import it."""
    code = "import sys, pagedlab.kernels as k; assert 'triton' not in sys.modules; print(k.HAS_TRITON)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


def test_engine_with_the_triton_backend_matches_torch():
    """Greedy tokens with attention_backend='triton' (interpreted on CPU) equal the torch backend's."""
    from pagedlab import LLM, SamplingParams
    from tests.helpers import random_prompts, tiny_model

    model = tiny_model("llama-gqa3-hd80")
    prompts = [{"prompt_token_ids": p} for p in random_prompts([5, 17, 1, 9])]
    params = SamplingParams(temperature=0, max_tokens=6)
    results = {}
    for backend in ("torch", "triton"):
        llm = LLM(model, block_size=4, num_kv_blocks=64, attention_backend=backend, enable_prefix_caching=True)
        assert llm.llm_engine.attention_backend == backend
        results[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts * 2, params, use_tqdm=False)]
    assert results["triton"] == results["torch"]


# -- decode steps recorded as graphs (CUDA graphs on a GPU; here their CPU stand-in) --------------------------


class CountingGraph(EagerGraph):
    replays = 0

    def replay(self) -> None:
        CountingGraph.replays += 1
        super().replay()


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(256)[-3:] == [192, 224, 256] and capture_sizes(300)[-2:] == [256, 300]


def test_decode_graphs_keep_the_tokens():
    """Decode steps replayed from recorded graphs at padded sizes give the eager engine's greedy tokens."""
    from pagedlab import LLM, SamplingParams
    from tests.helpers import random_prompts, tiny_model

    model = tiny_model("llama-gqa3-hd80")
    prompts = [{"prompt_token_ids": p} for p in random_prompts([5, 17, 1, 9, 12])]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (3, 6, 8, 5, 7)]  # batches of 5, 4, 3, 2, 1
    config = dict(block_size=4, num_kv_blocks=64, attention_backend="triton", max_num_seqs=6, max_model_len=64)
    eager = LLM(model, **config)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    graphed = LLM(model, **config)
    runner = graphed.llm_engine.model_runner
    assert runner.capture_decode_graphs(6, 64, graph_class=CountingGraph)
    assert sorted(runner.decode_graphs.graphs) == [1, 2, 4, 6]
    CountingGraph.replays = 0
    assert [o.outputs[0].token_ids for o in graphed.generate(prompts, params, use_tqdm=False)] == expected
    assert CountingGraph.replays >= 7, "the decode steps did not replay graphs"
    assert graphed.llm_engine.kv_cache_manager.num_free_blocks == 64


def test_decode_graphs_that_cannot_be_recorded_are_switched_off(caplog):
    from pagedlab import LLM
    from tests.helpers import tiny_model

    llm = LLM(tiny_model("llama"), block_size=4, num_kv_blocks=16, attention_backend="triton", max_num_seqs=2)
    runner = llm.llm_engine.model_runner

    class Unrecordable(EagerGraph):
        def capture(self, forward):
            raise RuntimeError("operation not permitted when stream is capturing")

    assert not runner.capture_decode_graphs(2, 32, graph_class=Unrecordable)
    assert runner.decode_graphs is None and "CUDA graphs off" in caplog.text
    with pytest.raises(ValueError, match="Triton"):
        LLM(tiny_model("llama"), block_size=4, num_kv_blocks=16).llm_engine.model_runner.capture_decode_graphs(2, 32)
