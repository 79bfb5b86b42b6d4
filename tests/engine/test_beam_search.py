"""Beam search inside the engine: the same sequences, in the same order, as Hugging Face's."""

from __future__ import annotations

import pytest
import torch

from pagedlab import LLM, BeamSearchParams, LLMEngine
from pagedlab.config import EngineConfig
from tests.helpers import hf_greedy, random_prompts, tiny_model


def hf_beams(model, prompt, k, max_tokens, early_stopping=False, length_penalty=1.0):
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=k, num_return_sequences=k,
                             do_sample=False, max_new_tokens=max_tokens, early_stopping=early_stopping,
                             length_penalty=length_penalty, pad_token_id=0)
    eos = model.generation_config.eos_token_id
    beams = []
    for row in out:
        tokens = row[len(prompt) :].tolist()
        beams.append(tokens[: tokens.index(eos) + 1] if eos in tokens else tokens)  # HF pads after EOS
    return beams


def ours(llm, prompts, params):
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    return [[s.tokens[len(p) :] for s in out.sequences] for p, out in zip(prompts, outputs)], outputs


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    """A tiny model whose EOS is a token it likes to produce, so that beams do end with EOS."""
    model = tiny_model(request.param)
    tokens = [t for out in hf_greedy(model, random_prompts([5, 12, 1, 20]), 12) for t in out]
    eos = max(set(tokens), key=tokens.count)
    model.config.eos_token_id = model.generation_config.eos_token_id = eos
    return model


@pytest.mark.parametrize("early_stopping", [False, True, "never"])
@pytest.mark.parametrize("beam_width", [2, 4])
def test_tiny_models_match_hf(model, beam_width, early_stopping):
    prompts = random_prompts([5, 12, 1, 20])
    llm = LLM(model, block_size=4, num_kv_blocks=256)
    params = BeamSearchParams(beam_width=beam_width, max_tokens=12, early_stopping=early_stopping)
    got, outputs = ours(llm, prompts, params)
    assert got == [hf_beams(model, p, beam_width, 12, early_stopping) for p in prompts]
    assert llm.stats().num_used_blocks == 0
    scores = [[s.score for s in out.sequences] for out in outputs]
    assert all(s == sorted(s, reverse=True) for s in scores)


def test_length_penalty_matches_hf(model):
    prompts = random_prompts([7, 3])
    llm = LLM(model, block_size=4, num_kv_blocks=256)
    for penalty in (0.0, 2.0):
        got, _ = ours(llm, prompts, BeamSearchParams(beam_width=3, max_tokens=10, length_penalty=penalty))
        assert got == [hf_beams(model, p, 3, 10, length_penalty=penalty) for p in prompts]


def test_some_beams_end_with_eos(model):
    """The workload above is only a test of EOS handling if EOS is chosen somewhere."""
    llm = LLM(model, block_size=4, num_kv_blocks=256)
    _, outputs = ours(llm, random_prompts([5, 12, 1, 20]), BeamSearchParams(beam_width=4, max_tokens=12))
    assert "stop" in {s.finish_reason for out in outputs for s in out.sequences}


def test_smollm2_matches_hf(smollm2):
    model, tokenizer = smollm2
    questions = ["What is the capital of France?", "Write a haiku about the sea."]
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True) for q in questions
    ]
    prompts = [list(p if isinstance(p, list) else p["input_ids"]) for p in prompts]
    llm = LLM(model, tokenizer, block_size=16, num_kv_blocks=512)
    for k in (2, 4):
        got, outputs = ours(llm, prompts, BeamSearchParams(beam_width=k, max_tokens=20))
        assert got == [hf_beams(model, p, k, 20) for p in prompts]
    assert outputs[0].sequences[0].text == "The capital of France is Paris."


def test_pruned_beams_free_their_blocks_at_once():
    model = tiny_model("llama")
    engine = LLMEngine(model, None, EngineConfig(block_size=2, num_kv_blocks=128))
    engine.add_beam_request("b", random_prompts([6])[0], BeamSearchParams(beam_width=3, max_tokens=10))
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()
    steps = list(engine.trace)
    pruning = [s for s in steps if any(rid.startswith("b") for rid, _ in s.finished)]
    assert pruning and any(s.freed for s in pruning), "pruned beams free the blocks only they held"
    assert any(s.copied for s in steps) or any(s.allocated for s in steps[1:])
    assert engine.kv_cache_manager.num_free_blocks == 128


def test_beam_width_4_memory_against_no_sharing():
    """64-token prompt in 4 blocks of 16; 4 beams of 16 tokens share it: at most the prompt's blocks plus
    two blocks per beam (its own tail and a copy-on-write), against 5 blocks per beam without sharing."""
    model = tiny_model("llama")
    llm = LLM(model, block_size=16, num_kv_blocks=256)
    ours(llm, random_prompts([64]), BeamSearchParams(beam_width=4, max_tokens=16, ignore_eos=True))
    no_sharing = 4 * 5
    assert llm.stats().peak_used_blocks <= 4 + 4 * 2
    assert 1 - llm.stats().peak_used_blocks / no_sharing >= 0.40


def test_beam_search_survives_preemption(model):
    prompts = random_prompts([9, 14])
    params = BeamSearchParams(beam_width=3, max_tokens=10)
    roomy, _ = ours(LLM(model, block_size=4, num_kv_blocks=256), prompts, params)
    tight = LLM(model, block_size=4, num_kv_blocks=14)
    assert ours(tight, prompts, params)[0] == roomy
    assert tight.stats().num_preemptions > 0 and tight.stats().num_used_blocks == 0


@pytest.mark.parametrize(
    "kwargs, field",
    [(dict(beam_width=0, max_tokens=4), "beam_width"), (dict(beam_width=2, max_tokens=0), "max_tokens"),
     (dict(beam_width=2, max_tokens=4, early_stopping="soon"), "early_stopping"),
     # issue 31: these raised a TypeError inside step(), after the model ran, at every step (NaN was accepted)
     *[(dict(beam_width=2, max_tokens=4, length_penalty=v), "length_penalty")
       for v in (None, "1.0", float("nan"), float("inf"), True)],
     (dict(beam_width=True, max_tokens=4), "beam_width"), (dict(beam_width=2, max_tokens=True), "max_tokens"),
     (dict(beam_width=2, max_tokens=4, ignore_eos=1), "ignore_eos"),
     (dict(beam_width=2, max_tokens=4, early_stopping=1), "early_stopping")],
)
def test_invalid_beam_params(kwargs, field):
    with pytest.raises(ValueError, match=rf"BeamSearchParams\.{field}"):
        BeamSearchParams(**kwargs)


def test_beam_search_with_prefix_caching(model):
    """Beams and prefix caching together: the second run hits the cached prompt and finds the same beams."""
    prompts = random_prompts([17, 9])
    params = BeamSearchParams(beam_width=3, max_tokens=8)
    expected = [hf_beams(model, p, 3, 8) for p in prompts]
    llm = LLM(model, block_size=4, num_kv_blocks=128, enable_prefix_caching=True)
    assert ours(llm, prompts, params)[0] == expected
    assert ours(llm, prompts, params)[0] == expected
    assert llm.stats().prefix_cache_hits >= 4 * 4 + 2 * 4


@pytest.mark.parametrize("length_penalty", [1e300, -1e300, 2**64])
def test_an_extreme_length_penalty_scores_without_overflow(length_penalty):
    """length ** length_penalty beyond the float range: the score is its limit (0 or -inf), not an OverflowError
    inside step() (2**64, an int, made Python compute a huge integer power)."""
    model = tiny_model("llama")
    model.config.eos_token_id = model.generation_config.eos_token_id = 53  # some beams end early
    llm = LLM(model, block_size=4, num_kv_blocks=64)
    params = BeamSearchParams(beam_width=2, max_tokens=6, length_penalty=length_penalty)
    [output] = llm.beam_search([{"prompt_token_ids": p} for p in random_prompts([5])], params)
    assert len(output.sequences) == 2 and all(s.finish_reason != "error" for s in output.sequences)
