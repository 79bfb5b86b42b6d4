"""Parallel sampling (n > 1): the prompt is computed once, samples share its blocks, copy-on-write on divergence."""

from __future__ import annotations

import pytest

from pagedlab import LLM, LLMEngine, SamplingParams
from pagedlab.config import EngineConfig
from tests.helpers import random_prompts, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def completions(llm, prompt, params):
    [output] = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    return [c.token_ids for c in output.outputs]


@pytest.mark.parametrize("prompt_len", [13, 16])  # ends mid-block / on a block boundary (block size 4)
def test_n_samples_equal_separate_seeded_requests(model, prompt_len):
    prompt = random_prompts([prompt_len])[0]
    llm = LLM(model, block_size=4, num_kv_blocks=128)
    together = completions(llm, prompt, SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=10))
    separate = [completions(llm, prompt, SamplingParams(temperature=1.0, seed=7 + i, max_tokens=10))[0]
                for i in range(4)]
    assert together == separate
    assert len({tuple(t) for t in together}) > 1, "the samples should differ"


def test_copy_on_write_of_the_shared_partial_block(model):
    prompt = random_prompts([13])[0]  # 3 full blocks of 4 and 1 token in the 4th
    engine = LLMEngine(model, None, EngineConfig(block_size=4, num_kv_blocks=64))
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=6))
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()
    prefill, first_decode = engine.trace[0], engine.trace[1]
    assert prefill.forked == (("r", "r:1"), ("r", "r:2"))
    tables = {t.request_id: t.block_ids for t in prefill.block_tables}
    assert tables["r"] == tables["r:1"] == tables["r:2"]  # one copy of the prompt, three holders
    # the next write goes into the shared 4th block: two of the three holders copy it, the last writes in place
    shared = tables["r"][3]
    assert [(source, rid) for rid, source, _ in first_decode.copied] == [(shared, "r"), (shared, "r:1")]
    after = {t.request_id: t.block_ids for t in first_decode.block_tables}
    assert after["r:2"][3] == shared and after["r"][3] != shared != after["r:1"][3]
    assert all(after[r][:3] == tables["r"][:3] for r in after)  # full blocks are never copied
    assert engine.kv_cache_manager.num_free_blocks == 64


def test_no_copy_when_the_prompt_fills_its_last_block(model):
    engine = LLMEngine(model, None, EngineConfig(block_size=4, num_kv_blocks=64))
    engine.add_request("r", random_prompts([16])[0], SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=6))
    while engine.has_unfinished_requests():
        engine.step()
    assert not any(record.copied for record in engine.trace)


def test_n_8_uses_the_blocks_the_design_implies(model):
    """64-token prompt, block size 16, 16 new tokens each: 4 shared prompt blocks + 1 block per sample."""
    llm = LLM(model, block_size=16, num_kv_blocks=128)
    prompt = random_prompts([64])[0]
    completions(llm, prompt, SamplingParams(n=8, temperature=1.0, seed=1, max_tokens=16, ignore_eos=True))
    shared = llm.stats().peak_used_blocks
    # without sharing: 8 sequences of 64 + 15 computed tokens = 5 blocks each
    assert shared == 4 + 8 * 1 and shared / (8 * 5) <= 0.30


def test_samples_survive_preemption_and_prefix_caching(model):
    prompt = random_prompts([21])[0]
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=12)
    roomy = completions(LLM(model, block_size=4, num_kv_blocks=256), prompt, params)
    for caching in (False, True):
        tight = LLM(model, block_size=4, num_kv_blocks=10, enable_prefix_caching=caching)
        assert completions(tight, prompt, params) == roomy
        assert tight.stats().num_preemptions > 0


def test_outputs_and_abort(model):
    engine = LLMEngine(model, None, EngineConfig(block_size=4, num_kv_blocks=64))
    engine.add_request("r", random_prompts([9])[0], SamplingParams(n=3, temperature=1.0, max_tokens=20))
    outputs = engine.step()
    assert [c.index for c in outputs[0].outputs] == [0, 1, 2] and not outputs[0].finished
    engine.step()
    engine.abort_request("r")
    assert not engine.has_unfinished_requests() and engine.kv_cache_manager.num_free_blocks == 64
    engine.check_invariants()
