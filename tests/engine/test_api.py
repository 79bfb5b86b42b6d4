"""The vLLM-style API: LLM.generate / chat, SamplingParams, outputs, the step engine, stats and the trace."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pagedlab import LLM, LLMEngine, RequestOutputKind, SamplingParams
from pagedlab.config import EngineConfig
from tests.helpers import random_prompts, tiny_model


@pytest.fixture(scope="module")
def tiny_llm():
    return LLM(tiny_model(), block_size=4, num_kv_blocks=256)


@pytest.fixture(scope="module")
def smol_llm(smollm2):
    model, tokenizer = smollm2
    return LLM(model, tokenizer, block_size=16, num_kv_blocks=256)


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_outputs_come_back_in_prompt_order(tiny_llm):
    prompts = random_prompts([30, 2, 11])
    outputs = tiny_llm.generate([{"prompt_token_ids": p} for p in prompts], [
        SamplingParams(temperature=0, max_tokens=n) for n in (2, 9, 5)], use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert [len(t) for t in tokens(outputs)] == [2, 9, 5]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outputs)


def test_prompt_forms_agree(tiny_llm):
    prompt = random_prompts([7])[0]
    params = SamplingParams(temperature=0, max_tokens=4)
    a = tiny_llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    b = tiny_llm.generate([prompt], params, use_tqdm=False)
    c = tiny_llm.generate(prompt, params, use_tqdm=False)
    assert tokens(a) == tokens(b) == tokens(c)


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_llm):
    prompt = {"prompt_token_ids": random_prompts([6])[0]}
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12)
    alone = tokens(tiny_llm.generate(prompt, params, use_tqdm=False))
    others = [{"prompt_token_ids": p} for p in random_prompts([3, 20, 9], seed=7)]
    batch = tiny_llm.generate(others[:2] + [prompt] + others[2:], [SamplingParams(temperature=1.0, max_tokens=20)] * 2
                              + [params] + [SamplingParams(temperature=0.7, max_tokens=5)], use_tqdm=False)
    assert tokens(batch)[2] == alone[0]
    other_seed = tokens(
        tiny_llm.generate(prompt, SamplingParams(temperature=1.0, seed=99, max_tokens=12), use_tqdm=False)
    )
    assert other_seed != alone


def test_top_k_1_is_greedy_and_min_tokens_holds_off_stops(tiny_llm):
    prompt = {"prompt_token_ids": random_prompts([5])[0]}
    greedy = tokens(tiny_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False))[0]
    top1_params = SamplingParams(temperature=0.8, top_k=1, seed=3, max_tokens=8)
    top1 = tokens(tiny_llm.generate(prompt, top1_params, use_tqdm=False))[0]
    assert top1 == greedy
    # stop on the greedy run's first token, unless min_tokens says otherwise
    stop_params = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[greedy[0]])
    stopped = tiny_llm.generate(prompt, stop_params, use_tqdm=False)
    assert stopped[0].outputs[0].token_ids == greedy[:1]
    assert stopped[0].outputs[0].finish_reason == "stop" and stopped[0].outputs[0].stop_reason == greedy[0]
    held = tiny_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, min_tokens=3,
                                                    stop_token_ids=[greedy[0]]), use_tqdm=False)
    assert len(held[0].outputs[0].token_ids) >= 3 and greedy[0] not in held[0].outputs[0].token_ids[:3]


def test_sampler_filters_against_a_direct_computation():
    """top-k / top-p / min-p keep exactly the tokens their definitions keep."""
    from pagedlab.worker.sampler import filtered_probs

    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    p = torch.softmax(logits, -1)[0]
    kept = lambda probs: (probs[0] > 0).nonzero().flatten().tolist()  # noqa: E731
    assert kept(filtered_probs(logits, [SamplingParams(top_k=2)])) == [0, 1]
    # top_p=0.7: p0=0.64 < 0.7 so token 1 is needed too
    assert kept(filtered_probs(logits, [SamplingParams(top_p=0.7)])) == [0, 1]
    assert kept(filtered_probs(logits, [SamplingParams(top_p=0.5)])) == [0]
    threshold = 0.2 * p[0]
    assert kept(filtered_probs(logits, [SamplingParams(min_p=0.2)])) == [i for i in range(5) if p[i] >= threshold]
    assert torch.allclose(filtered_probs(logits, [SamplingParams()])[0], p)


def test_logprobs(tiny_llm):
    prompt = {"prompt_token_ids": random_prompts([5])[0]}
    out = tiny_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3, logprobs=2), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == 3
    for token, entry in zip(completion.token_ids, completion.logprobs):
        assert token in entry and len(entry) == 2  # greedy: the chosen token is also the most likely
        assert max(entry.values()) == entry[token] <= 0.0


def test_logit_bias_moves_the_choice_and_its_values_are_checked(tiny_llm):
    prompt = {"prompt_token_ids": random_prompts([7])[0]}
    greedy = tiny_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].outputs[0]
    biased = tiny_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, logit_bias={77: 100}),
                               use_tqdm=False)[0].outputs[0]
    assert biased.token_ids == [77] * 4 != greedy.token_ids
    avoided = tiny_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, logprobs=0,
                                                       logit_bias={greedy.token_ids[0]: -100}), use_tqdm=False)
    first = avoided[0].outputs[0]
    assert first.token_ids[0] != greedy.token_ids[0]
    assert first.logprobs[0][first.token_ids[0]] < 0  # logprobs stay the model's own, before the bias
    sampled = tiny_llm.generate(prompt, SamplingParams(temperature=1.0, seed=3, max_tokens=8, logit_bias={5: 100}),
                                use_tqdm=False)[0].outputs[0]
    assert sampled.token_ids == [5] * 8
    for bias, message in [({5: 100.5}, r"in \[-100, 100\]"), ({-1: 1.0}, "token ids"), ({5: float("inf")}, "numbers")]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(logit_bias=bias)
    with pytest.raises(ValueError, match=r"logit_bias token ids \[128\] are outside the vocabulary"):
        tiny_llm.generate(prompt, SamplingParams(logit_bias={128: 1.0}), use_tqdm=False)


def test_logit_bias_holds_in_verified_drafts():
    """N-gram drafts are verified with the same biased logits as one token at a time draws from."""
    prompt = {"prompt_token_ids": [77, 77, 77, 3, 77, 77]}
    params = SamplingParams(temperature=0, max_tokens=8, logit_bias={77: 100})
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(tiny_model(), block_size=4, num_kv_blocks=64, speculative_config=ngram)
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == [77] * 8
    assert llm.llm_engine.stats().spec_num_accepted_tokens > 0


def test_allowed_token_ids_keep_every_draw_among_them(tiny_llm):
    """vLLM's allowed_token_ids: every other token is masked out before sampling, greedy or not; logprobs stay
    the model's own; the ids are checked."""
    prompt = {"prompt_token_ids": random_prompts([7])[0]}
    greedy = tiny_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].outputs[0]
    allowed = [t for t in (3, 40, 91) if t not in greedy.token_ids[:1]]
    kept = tiny_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, logprobs=0, allowed_token_ids=allowed),
                             use_tqdm=False)[0].outputs[0]
    assert set(kept.token_ids) <= set(allowed) and kept.token_ids[0] != greedy.token_ids[0]
    assert kept.logprobs[0][kept.token_ids[0]] < 0  # the model's own log-probability, before the mask
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=16, allowed_token_ids=[5, 9])
    sampled = tiny_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert set(sampled.token_ids) <= {5, 9}
    assert SamplingParams(allowed_token_ids=[5, 9]).allowed_token_ids == (5, 9)
    for value, message in [([], "at least one"), ([-1], "token ids"), ([2.5], "token ids"), ("12", "token ids")]:
        with pytest.raises(ValueError, match=f"SamplingParams.allowed_token_ids.*{message}"):
            SamplingParams(allowed_token_ids=value)
    with pytest.raises(ValueError, match=r"allowed_token_ids \[128\] are outside the vocabulary"):
        tiny_llm.generate(prompt, SamplingParams(allowed_token_ids=[5, 128]), use_tqdm=False)


def test_allowed_token_ids_that_min_tokens_bans_every_one_of_are_refused(tiny_llm):
    """min_tokens bans EOS and the stop token ids; if every allowed token is among them, no token could be drawn
    (every logit -inf): refused at add_request, naming both fields, and the engine goes on."""
    prompt = {"prompt_token_ids": random_prompts([7])[0]}
    params = SamplingParams(temperature=0, max_tokens=4, min_tokens=2, stop_token_ids=[5, 9], allowed_token_ids=[5, 9])
    with pytest.raises(ValueError, match=r"allowed_token_ids \[5, 9\] are all banned until min_tokens=2"):
        tiny_llm.generate(prompt, params, use_tqdm=False)
    for fine in (dict(min_tokens=0), dict(allowed_token_ids=[5, 9, 11])):  # nothing banned, or one token left
        kept = tiny_llm.generate(prompt, replace(params, **fine), use_tqdm=False)[0].outputs[0]
        assert set(kept.token_ids) <= {5, 9, 11}
    assert not tiny_llm.llm_engine.has_unfinished_requests()


def test_allowed_token_ids_hold_in_verified_drafts():
    prompt = {"prompt_token_ids": [77, 77, 77, 3, 77, 77]}
    params = SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=[77])
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(tiny_model(), block_size=4, num_kv_blocks=64, speculative_config=ngram)
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == [77] * 8
    assert llm.llm_engine.stats().spec_num_accepted_tokens > 0


@pytest.mark.parametrize("config", [{}, {"enable_chunked_prefill": True, "max_num_batched_tokens": 5},
                                    {"enable_prefix_caching": True}], ids=["one-step", "chunked", "prefix-caching"])
def test_prompt_logprobs_equal_hugging_faces_log_softmax(config):
    """vLLM's prompt_logprobs: None for the first token, then each prompt token's log-probability given those
    before it, with the top ones; every sample and every request gets them, cached prefix or not."""
    model = tiny_model()
    prompt = random_prompts([13])[0]
    with torch.inference_mode():
        expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    llm = LLM(model, block_size=4, num_kv_blocks=64, **config)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=3, prompt_logprobs=2)
    for _ in range(2):  # the second time, with prefix caching, the prompt's blocks are cached
        output = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt)
        for i, entry in enumerate(output.prompt_logprobs[1:], start=1):
            top = expected[i - 1].topk(2).indices.tolist()
            assert set(entry) == {*top, prompt[i]}
            assert entry[prompt[i]] == pytest.approx(expected[i - 1, prompt[i]].item(), abs=1e-4)
    no_logprobs = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert no_logprobs.prompt_logprobs is None
    if config.get("enable_prefix_caching"):
        assert no_logprobs.num_cached_tokens == 12  # the cache was there: prompt_logprobs skip it


def test_step_engine_streams_and_aborts():
    engine = LLMEngine(tiny_model(), None, EngineConfig(block_size=4, num_kv_blocks=64))
    engine.add_request("a", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=5))
    engine.add_request("b", {"prompt_token_ids": [4, 5]}, SamplingParams(
        temperature=0, max_tokens=5, output_kind=RequestOutputKind.DELTA))
    engine.add_request("c", {"prompt_token_ids": [6]}, SamplingParams(temperature=0, max_tokens=50))
    seen = {"a": [], "b": []}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id in seen:
                seen[out.request_id].append(list(out.outputs[0].token_ids))
        steps += 1
        if steps == 3:
            engine.abort_request("c")
            assert engine.get_num_unfinished_requests() == 2
    assert [len(t) for t in seen["a"]] == [1, 2, 3, 4, 5]  # cumulative
    assert [len(t) for t in seen["b"]] == [1, 1, 1, 1, 1]  # deltas
    stats = engine.stats()
    assert stats.num_used_blocks == 0 and stats.num_finished == 3 and stats.num_running == 0
    assert stats.num_generated_tokens == 5 + 5 + 3


def test_delta_outputs_of_n_samples_report_each_finish_once():
    """A sample that finished is not in later deltas: only the samples with something new, or a new finish."""
    engine = LLMEngine(tiny_model(), None, EngineConfig(block_size=4, num_kv_blocks=64))
    params = SamplingParams(n=3, temperature=1.0, seed=42, max_tokens=30, stop_token_ids=list(range(40)),
                            output_kind=RequestOutputKind.DELTA)
    engine.add_request("a", {"prompt_token_ids": [1, 2, 3]}, params)
    finishes, tokens, num_steps = [], {0: [], 1: [], 2: []}, 0
    while engine.has_unfinished_requests() and num_steps < 100:
        for output in engine.step():
            for c in output.outputs:
                assert c.token_ids or c.finish_reason is not None  # nothing empty is sent
                tokens[c.index] += c.token_ids
                finishes += [c.index] if c.finish_reason is not None else []
        num_steps += 1
    assert sorted(finishes) == [0, 1, 2]
    assert len({len(t) for t in tokens.values()}) > 1  # they finished at different steps
    final = LLMEngine(tiny_model(), None, EngineConfig(block_size=4, num_kv_blocks=64))
    final.add_request("a", {"prompt_token_ids": [1, 2, 3]}, replace(params, output_kind=RequestOutputKind.FINAL_ONLY))
    outputs = []
    while final.has_unfinished_requests():
        outputs += final.step()
    assert [c.token_ids for c in outputs[0].outputs] == [tokens[i] for i in range(3)]


def test_trace_records_every_step():
    engine = LLMEngine(tiny_model(), None, EngineConfig(block_size=4, num_kv_blocks=64))
    engine.add_request("a", {"prompt_token_ids": list(range(1, 10))}, SamplingParams(temperature=0, max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()
    trace = engine.trace
    assert len(trace) == 3 and trace.num_blocks == 64 and trace.block_size == 4
    first, last = trace[0], trace[-1]
    assert first.scheduled[0].num_new_tokens == 9 and first.allocated == (("a", (0, 1, 2)),)
    assert first.block_tables[0].block_ids == (0, 1, 2) and first.block_tables[0].num_tokens == 9
    assert trace[1].allocated == () and trace[1].block_tables[0].num_tokens == 10
    assert last.finished == (("a", "length"),) and set(last.freed) == {0, 1, 2} and last.block_tables == ()
    assert [rid for step in trace for rid, _ in step.appended] == ["a"] * 3


def test_stats_and_kv_budget():
    engine = LLMEngine(tiny_model(), None, EngineConfig(block_size=16, kv_cache_memory=1 << 20))
    # tiny model: 2 layers x 2 kv heads x 16 head dim x 4 bytes x 2 (K and V) = 512 bytes/token
    assert engine.kv_cache_manager.num_blocks == (1 << 20) // (512 * 16)
    assert "KV blocks 0/128 used" in str(engine.stats())


def test_chat_and_text(smol_llm):
    out = smol_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                        SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert out.outputs[0].text == "The capital of France is Paris."
    assert out.outputs[0].finish_reason == "stop"  # <|im_end|> is the model's EOS
    assert out.prompt.startswith("<|im_start|>system")


def test_stop_strings(smol_llm):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    out = smol_llm.chat(question, SamplingParams(temperature=0, max_tokens=32, stop=["Paris"]), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert completion.text == "The capital of France is "
    assert completion.finish_reason == "stop" and completion.stop_reason == "Paris"
    assert smol_llm.stats().num_used_blocks == 0


def test_text_prompt_and_tqdm(smol_llm, capsys):
    out = smol_llm.generate(["The capital of France is", "1, 2, 3,"], SamplingParams(temperature=0, max_tokens=4))
    assert out[1].outputs[0].text.strip().startswith("4")
    assert "Processed prompts" in capsys.readouterr().err


def test_load_from_a_local_folder(tmp_path):
    model = tiny_model("qwen2")
    model.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), block_size=8, num_kv_blocks=64)
    prompt = random_prompts([6])[0]
    params = SamplingParams(temperature=0, max_tokens=6)
    expected = tokens(LLM(model, block_size=8, num_kv_blocks=64).generate(prompt, params, use_tqdm=False))
    assert tokens(llm.generate(prompt, params, use_tqdm=False)) == expected
    assert llm.get_tokenizer() is None


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs(dtype):
    llm = LLM(tiny_model().to(getattr(torch, dtype)), block_size=4, num_kv_blocks=64)  # the model as it is
    assert llm.llm_engine.model_runner.kv_cache.dtype == getattr(torch, dtype)
    out = llm.generate(random_prompts([5, 9]), SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert [len(t) for t in tokens(out)] == [5, 5]
