"""Tensor parallelism on CPU over gloo: two rank processes give the tokens of one process and of Hugging Face.

Each rank process takes seconds to start on a 2-core machine, so the engines are few and shared: one per family
and preemption mode, each checked for greedy tokens under prefix caching, chunked prefill and a pool tight enough
to preempt, then for `n > 1` and beam search against a single-process engine of the same configuration. The
failure tests start their own engines with a short timeout. All of it is marked slow (`make test` runs it).
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pagedlab import LLM, SamplingParams
from pagedlab.beam_search import BeamSearchParams
from pagedlab.worker.executor import TensorParallelError
from pagedlab.worker.tensor_parallel import valid_tensor_parallel_sizes
from tests.helpers import hf_greedy, random_prompts, tiny_model

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
# Prefix caching, chunked prefill (the 33-token prompt takes three steps) and a pool of 18 blocks of 4 tokens,
# less than the six requests need together: the engine must preempt.
CONFIG = dict(
    block_size=4, num_kv_blocks=18, enable_prefix_caching=True, enable_chunked_prefill=True,
    max_num_batched_tokens=16,
)


def prompts_with_shared_prefix() -> list[list[int]]:
    shared = random_prompts([12], seed=5)[0]  # three full blocks that later prompts find cached
    return [shared + p for p in random_prompts([5, 1, 21], seed=1)] + random_prompts([33, 9], seed=2)


def greedy(llm: LLM, prompts) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return [list(o.outputs[0].token_ids) for o in llm.generate(_ids(prompts), params, use_tqdm=False)]


def _ids(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def assert_samples_and_beams_equal(llm: LLM, one: LLM, prompts) -> None:
    """Parallel sampling (n = 3, seeded) and beam search give the sequences of one process."""
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8)

    def samples(engine: LLM) -> list[list[list[int]]]:
        outputs = engine.generate(_ids(prompts[:3]), params, use_tqdm=False)
        return [[list(c.token_ids) for c in o.outputs] for o in outputs]

    assert samples(llm) == samples(one)
    beams = BeamSearchParams(beam_width=3, max_tokens=8)
    assert [[s.tokens for s in o.sequences] for o in llm.beam_search(_ids(prompts[:2]), beams)] == [
        [s.tokens for s in o.sequences] for o in one.beam_search(_ids(prompts[:2]), beams)
    ]


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def rank_pids(llm: LLM) -> list[int]:
    return [p.pid for p in llm.llm_engine.worker.processes]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The tiny test models saved to folders (a rank loads its shard from a folder, never from a model object)."""
    models, paths = {}, {}
    for family in ("llama", "qwen2"):
        models[family] = tiny_model(family)
        paths[family] = tmp_path_factory.mktemp(family)
        models[family].save_pretrained(paths[family])
    return models, paths


@pytest.mark.parametrize("family, mode", [("llama", "swap"), ("qwen2", "recompute")])
def test_two_ranks_equal_one_and_hugging_face(folders, family, mode):
    models, paths = folders
    prompts = prompts_with_shared_prefix()
    expected = hf_greedy(models[family], prompts, MAX_TOKENS)
    config = dict(CONFIG, preemption_mode=mode)
    one = LLM(paths[family], **config)
    llm = LLM(paths[family], tensor_parallel_size=2, **config)
    pids = rank_pids(llm)
    assert len(pids) == 2 and all(alive(pid) for pid in pids)

    # greedy, under prefix caching, chunked prefill and preemption
    assert greedy(llm, prompts) == expected == greedy(one, prompts)
    stats = llm.stats()
    assert stats.prefix_cache_hits > 0
    assert getattr(stats, f"num_preemptions_{mode}") > 0
    assert stats.num_used_blocks == 0 and stats.num_used_cpu_blocks == 0

    assert_samples_and_beams_equal(llm, one, prompts)

    # each rank holds half of every block: the same block count, half the heads, half the bytes
    executor = llm.llm_engine.worker
    assert executor.info.num_blocks == one.llm_engine.worker.info.num_blocks
    single = one.llm_engine.worker.model_runner.kv_cache.nbytes
    assert executor.collective_rpc("kv_cache_bytes") == [single // 2] * 2
    assert [info.kv_heads for info in executor.ranks] == [(0, 1), (1, 2)]
    if mode == "swap":
        single_cpu = one.llm_engine.worker.cpu_kv_cache.cache.nbytes
        assert executor.collective_rpc("swap_cache_bytes") == [single_cpu // 2] * 2

    if family == "llama":
        llm.close()
    else:  # dropped without close(): garbage collection stops the ranks
        del llm, executor
        gc.collect()
    assert not any(alive(pid) for pid in pids)


def test_model_object_and_indivisible_heads_are_refused(folders):
    models, paths = folders
    with pytest.raises(ValueError, match="folder or Hub id"):
        LLM(models["llama"], tensor_parallel_size=2)
    # 4 query heads, 2 KV heads: 1 or 2 ranks, never 3 (refused before any process starts)
    assert valid_tensor_parallel_sizes(models["llama"].config) == [1, 2]
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 .* valid sizes: 1, 2"):
        LLM(paths["llama"], tensor_parallel_size=3)
    smollm2 = models["llama"].config.__class__(
        hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536
    )  # SmolLM2-135M
    assert valid_tensor_parallel_sizes(smollm2) == [1, 3]


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_lost_rank_ends_in_an_error_in_bounded_time(folders, how):
    _, paths = folders
    llm = LLM(paths["llama"], tensor_parallel_size=2, block_size=4, num_kv_blocks=16, distributed_timeout=5.0)
    pids = rank_pids(llm)
    os.kill(pids[1], signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="died" if how == "killed" else "did not answer"):
        greedy(llm, random_prompts([5]))
    assert time.monotonic() - start < 30
    assert not any(alive(pid) for pid in pids)
    with pytest.raises(TensorParallelError, match="stopped"):  # the engine says so, at once, from then on
        greedy(llm, random_prompts([5]))
    llm.close()


def test_no_process_outlives_a_script_that_forgets_to_close(folders):
    _, paths = folders
    script = textwrap.dedent(f"""
        import multiprocessing.forkserver as fs
        from pagedlab import LLM, SamplingParams
        if __name__ == "__main__":
            llm = LLM({str(paths["llama"])!r}, tensor_parallel_size=2, block_size=4, num_kv_blocks=16)
            llm.generate([{{"prompt_token_ids": [1, 2, 3]}}], SamplingParams(max_tokens=2), use_tqdm=False)
            print(*[p.pid for p in llm.llm_engine.worker.processes], fs._forkserver._forkserver_pid or 0)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=os.environ)
    assert out.returncode == 0, out.stderr[-3000:]
    pids = [int(p) for p in out.stdout.split()[-3:] if int(p)]
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pids and not any(alive(pid) for pid in pids)


def test_smollm2_over_three_ranks_equals_hugging_face(smollm2):
    """The embedded model's 9 query and 3 KV heads: one KV head and three query heads per rank."""
    model, tokenizer = smollm2
    prompts = [tokenizer.encode(text) for text in ("The capital of France is", "def fibonacci(n):")]
    with LLM(None, tensor_parallel_size=3, num_kv_blocks=32, preemption_mode="recompute") as llm:
        assert greedy(llm, prompts) == hf_greedy(model, prompts, MAX_TOKENS)
        assert [info.kv_heads for info in llm.llm_engine.worker.ranks] == [(0, 1), (1, 2), (2, 3)]


def test_ngram_speculation_over_two_ranks_equals_hugging_face(folders):
    """Drafts are proposed in the engine; each rank verifies its share of the same chunk."""
    models, paths = folders
    prompts = prompts_with_shared_prefix() + [[3, 4, 5, 6, 7, 8] * 5, [9, 10, 11] * 8]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(paths["llama"], tensor_parallel_size=2, speculative_config=spec, **CONFIG)
    assert greedy(llm, prompts) == hf_greedy(models["llama"], prompts, MAX_TOKENS)
    assert llm.stats().spec_num_accepted_tokens > 0
