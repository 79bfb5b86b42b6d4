"""Pipeline parallelism on CPU over gloo: stages of layers, each with a KV pool for its own layers, give the tokens
of one process and of Hugging Face.

As for tensor parallelism (test_tensor_parallel.py), rank processes take seconds to start on 2 cores, so each
engine is checked for several things: greedy tokens under prefix caching, chunked prefill and a pool tight enough
to preempt, then `n > 1` seeded sampling and beam search against one process of the same configuration, then what
each stage holds. The tiny models here have 4 layers, so that 3 stages and an uneven partition are possible.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM

from pagedlab import LLM
from pagedlab.config import EngineConfig
from pagedlab.worker.executor import TensorParallelError
from pagedlab.worker.pipeline_parallel import layer_partition, pipeline_cost
from tests.helpers import TINY_CONFIG, hf_greedy, random_prompts
from tests.worker.test_tensor_parallel import (
    CONFIG,
    MAX_TOKENS,
    alive,
    assert_samples_and_beams_equal,
    greedy,
    prompts_with_shared_prefix,
    rank_pids,
)

pytestmark = pytest.mark.slow

FOUR_LAYERS = {**TINY_CONFIG, "num_hidden_layers": 4}
FAMILIES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**FOUR_LAYERS)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**FOUR_LAYERS, head_dim=16)),
    "mistral-window8": lambda: MistralForCausalLM(MistralConfig(**FOUR_LAYERS, sliding_window=8)),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    import torch

    models, paths = {}, {}
    for family, make in FAMILIES.items():
        torch.manual_seed(0)
        models[family] = make().eval()
        models[family].config.eos_token_id = models[family].generation_config.eos_token_id = None
        paths[family] = tmp_path_factory.mktemp(family)
        models[family].save_pretrained(paths[family])
    return models, paths


def test_layer_partition_even_and_chosen():
    assert layer_partition(30, 2) == [(0, 15), (15, 30)]
    assert layer_partition(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]  # the remainder to the first stages
    assert layer_partition(4, 2, [3, 1]) == [(0, 3), (3, 4)]
    cost = pipeline_cost(LlamaConfig(**FOUR_LAYERS), 2)
    assert cost.layers_per_stage == (2, 2) and cost.bubble_fraction == 0.5
    assert cost.kv_bytes_per_token_per_stage[0] == 2 * 2 * 2 * 16 * 2  # layers x (K, V) x KV heads x head dim x 2 B


@pytest.mark.parametrize("family, stages, tp, mode, partition", [
    ("llama", 2, 1, "swap", None),
    ("qwen3", 3, 1, "recompute", None),
    ("mistral-window8", 2, 2, "recompute", [3, 1]),
], ids=["llama-2-stages-swap", "qwen3-3-stages", "mistral-2x2-uneven"])
def test_stages_equal_one_process_and_hugging_face(folders, family, stages, tp, mode, partition):
    models, paths = folders
    prompts = prompts_with_shared_prefix()
    expected = hf_greedy(models[family], prompts, MAX_TOKENS)
    config = dict(CONFIG, preemption_mode=mode)
    one = LLM(paths[family], **config)
    llm = LLM(paths[family], pipeline_parallel_size=stages, tensor_parallel_size=tp,
              pipeline_layer_partition=partition, **config)
    pids = rank_pids(llm)
    assert len(pids) == stages * tp and all(alive(pid) for pid in pids)

    # greedy, under prefix caching, chunked prefill and preemption
    assert greedy(llm, prompts) == expected == greedy(one, prompts)
    stats = llm.stats()
    assert stats.prefix_cache_hits > 0
    assert getattr(stats, f"num_preemptions_{mode}") > 0
    assert stats.num_used_blocks == 0 and stats.num_used_cpu_blocks == 0

    # parallel sampling and beam search: the same sequences as one process (only the last stage samples)
    assert_samples_and_beams_equal(llm, one, prompts)

    # one block table for every stage: the same block count; each rank's pool holds its stage's layers (and its
    # heads), so its bytes are that share of one process's pool
    executor = llm.llm_engine.worker
    assert executor.info.num_blocks == one.llm_engine.worker.info.num_blocks
    bounds = layer_partition(4, stages, partition)
    assert [info.layers for info in executor.ranks] == [b for b in bounds for _ in range(tp)]
    single = one.llm_engine.worker.model_runner.kv_cache.nbytes
    assert executor.collective_rpc("kv_cache_bytes") == [
        single * (stop - start) // 4 // tp for start, stop in bounds for _ in range(tp)]
    assert executor.info.bytes_per_block == one.llm_engine.worker.info.bytes_per_block
    if mode == "swap":
        single_cpu = one.llm_engine.worker.cpu_kv_cache.cache.nbytes
        assert executor.collective_rpc("swap_cache_bytes") == [single_cpu * (b - a) // 4 for a, b in bounds]
    sent = executor.collective_rpc("pipeline_stats")
    assert all(s.num_sent > 0 for s in sent[: -tp]) and all(s.num_sent == 0 for s in sent[-tp:])
    assert all(s.num_received == 0 for s in sent[:tp]) and all(s.num_received > 0 for s in sent[tp:])
    llm.close()
    assert not any(alive(pid) for pid in pids)


def test_bad_configurations_are_refused_before_anything_starts(folders):
    models, paths = folders
    with pytest.raises(ValueError, match="folder or Hub id"):
        LLM(models["llama"], pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="pipeline_parallel_size=5 exceeds the model's 4 layers"):
        LLM(paths["llama"], pipeline_parallel_size=5)
    with pytest.raises(ValueError, match=r"covers 5 layers; the model has 4"):
        LLM(paths["llama"], pipeline_parallel_size=2, pipeline_layer_partition=[3, 2])
    with pytest.raises(ValueError, match="gives 3 stages; pipeline_parallel_size is 2"):
        LLM(paths["llama"], pipeline_parallel_size=2, pipeline_layer_partition=[1, 1, 2])
    with pytest.raises(ValueError, match="at least 1"):
        LLM(paths["llama"], pipeline_parallel_size=2, pipeline_layer_partition=[4, 0])
    with pytest.raises(ValueError, match="pipeline_parallel_size must be an integer >= 1"):
        LLM(paths["llama"], pipeline_parallel_size=0)
    for partition in (("a",), [2.0, 2], "22", 4):  # checked when the config is made, before any model
        with pytest.raises(ValueError, match="pipeline_layer_partition must be a list of layer counts"):
            EngineConfig(pipeline_parallel_size=2, pipeline_layer_partition=partition)


def test_ngram_speculation_in_two_stages_equals_hugging_face(folders):
    """Drafts are proposed in the driver; the last stage verifies them, every stage computes the chunk."""
    models, paths = folders
    prompts = prompts_with_shared_prefix() + [[3, 4, 5, 6, 7, 8] * 5, [9, 10, 11] * 8]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    with LLM(paths["llama"], pipeline_parallel_size=2, speculative_config=spec, **CONFIG) as llm:
        assert greedy(llm, prompts) == hf_greedy(models["llama"], prompts, MAX_TOKENS)
        assert llm.stats().spec_num_accepted_tokens > 0
    with pytest.raises(ValueError, match="'draft_model' .* does not combine with .*pipeline_parallel_size > 1"):
        LLM(paths["llama"], pipeline_parallel_size=2,
            speculative_config={"method": "draft_model", "model": "any", "num_speculative_tokens": 2})


def test_auto_preemption_measures_its_costs_on_every_stage(folders):
    """"auto" times a swap and a prefill at start-up: every stage runs the same passes (the sends and receives
    pair up), and the first stage's measurement, shared with all, decides."""
    models, paths = folders
    prompts = prompts_with_shared_prefix()
    with LLM(paths["llama"], pipeline_parallel_size=2, **dict(CONFIG, preemption_mode="auto")) as llm:
        assert llm.llm_engine.cost_model is not None
        assert greedy(llm, prompts) == hf_greedy(models["llama"], prompts, MAX_TOKENS)
        assert llm.stats().num_preemptions > 0


def test_a_lost_stage_ends_in_an_error_in_bounded_time(folders):
    _, paths = folders
    llm = LLM(paths["llama"], pipeline_parallel_size=2, block_size=4, num_kv_blocks=16, distributed_timeout=5.0)
    pids = rank_pids(llm)
    os.kill(pids[0], signal.SIGKILL)  # the first stage: the last one waits for hidden states that never come
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="died"):
        greedy(llm, random_prompts([5]))
    assert time.monotonic() - start < 30
    assert not any(alive(pid) for pid in pids)
    llm.close()


def test_smollm2_in_two_stages_equals_hugging_face(smollm2):
    """The embedded model's 30 layers in two stages of 15; its tied embedding and head on different stages."""
    model, tokenizer = smollm2
    prompts = [tokenizer.encode(text) for text in ("The capital of France is", "def fibonacci(n):")]
    with LLM(None, pipeline_parallel_size=2, num_kv_blocks=32, preemption_mode="recompute") as llm:
        assert greedy(llm, prompts) == hf_greedy(model, prompts, MAX_TOKENS)
        assert [info.layers for info in llm.llm_engine.worker.ranks] == [(0, 15), (15, 30)]
