"""Speculative decoding: greedy tokens identical to Hugging Face (so to no speculation) with n-gram and draft-model
proposals, across block sizes, arrival patterns, preemption, prefix caching and chunked prefill; exact rollback;
the acceptance counters; the rejection-sampling rule checked statistically.

# Explained in chapters/11_speculative_decoding.ipynb
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedlab import LLMEngine, SamplingParams
from pagedlab.config import EngineConfig
from pagedlab.core.kv_cache_manager import KVCacheManager
from pagedlab.core.sched_output import SamplingRequest
from pagedlab.spec_decode.ngram_proposer import propose_ngram
from pagedlab.worker.rejection_sampler import verify
from pagedlab.worker.sampler import Sampler
from tests.helpers import hf_greedy, random_prompts, run_engine, tiny_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def case():
    """A tiny model, prompts of which some copy themselves (so that n-gram lookup finds drafts), HF's tokens."""
    model = tiny_model("llama")
    prompts = random_prompts([5, 17, 1, 33, 9]) + [[3, 4, 5, 6, 7, 8] * 5, [9, 10, 11] * 8]
    return model, prompts, hf_greedy(model, prompts, max_new_tokens=24)


def speculative_configs(model):
    """ngram; a tiny random draft (rarely right: mostly rollbacks); the target as its own draft (always right:
    the deepest chunks, k + 1 tokens a step)."""
    return {
        "ngram": NGRAM,
        "random-draft": {"method": "draft_model", "model": tiny_model("llama", seed=1), "num_speculative_tokens": 3},
        "self-draft": {"method": "draft_model", "model": model, "num_speculative_tokens": 4},
    }


METHODS = ["ngram", "random-draft", "self-draft"]


def check_counters(engine) -> None:
    """Drafts were verified; the trace's rolled-back slots are exactly the rejected drafts."""
    stats = engine.stats()
    assert stats.spec_num_drafts > 0 and 0 <= stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    verified = [v for record in engine.trace for v in record.verified]
    rejected = [k - a for record in engine.trace for _, k, a in record.verified]
    assert sum(len(s) for record in engine.trace for _, s in record.rolled_back) == sum(rejected)
    assert len(verified) == stats.spec_num_drafts


@pytest.mark.parametrize("mode", ["all-at-once", "staggered"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("method", METHODS)
def test_greedy_matches_hf(case, method, block_size, mode):
    model, prompts, expected = case
    spec = speculative_configs(model)[method]
    config = EngineConfig(block_size=block_size, num_kv_blocks=2048 // block_size, speculative_config=spec)
    engine = LLMEngine(model, None, config)
    assert run_engine(engine, prompts, 24, mode) == expected
    check_counters(engine)
    if method == "self-draft":
        assert engine.stats().spec_acceptance_rate == 1.0


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
@pytest.mark.parametrize("block_size", [1, 4])
@pytest.mark.parametrize("method", METHODS)
def test_preemption_keeps_tokens(case, method, block_size, preemption_mode):
    """A pool so small that requests are preempted (recomputed or swapped) again and again, drafts and all."""
    model, prompts, expected = case
    num_blocks = -(-(33 + 24) // block_size) + 1
    config = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, preemption_mode=preemption_mode,
                          speculative_config=speculative_configs(model)[method])
    engine = LLMEngine(model, None, config)
    assert run_engine(engine, prompts, 24) == expected
    stats = engine.stats()
    assert (stats.num_preemptions_swap if preemption_mode == "swap" else stats.num_preemptions_recompute) > 0
    check_counters(engine)


@pytest.mark.parametrize("method", METHODS)
def test_prefix_caching_chunked_prefill_and_a_small_budget(case, method):
    """Shared prefixes hit the cache (the draft model's too); prompts are chunked by a small budget that also
    caps the drafts; at most two sequences run at once."""
    model, prompts, expected = case
    shared = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    prompts, expected = prompts + [shared + [1, 2], shared + [3]], None
    expected = hf_greedy(model, prompts, 24)
    config = EngineConfig(block_size=4, num_kv_blocks=256, enable_prefix_caching=True, enable_chunked_prefill=True,
                          max_num_batched_tokens=8,
                          max_num_seqs=2, speculative_config=speculative_configs(model)[method])
    engine = LLMEngine(model, None, config)
    assert run_engine(engine, prompts, 24, "staggered") == expected
    assert engine.stats().prefix_cache_hits > 0
    for record in engine.trace:
        assert record.num_batched_tokens <= 8
    check_counters(engine)


def test_a_mixed_batch(case):
    """Greedy, seeded sampling (n = 2, logprobs) and a beam search in one engine: greedy equals HF, the seeded
    samples equal those drawn without speculation (the verifier draws each token as the sampler would), beams do
    not speculate and equal a run without it."""
    from pagedlab import BeamSearchParams

    model, prompts, expected = case

    def run(spec):
        engine = LLMEngine(model, None, EngineConfig(block_size=4, num_kv_blocks=512, speculative_config=spec))
        greedy = SamplingParams(temperature=0, max_tokens=24)
        sampled = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=24, logprobs=2)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"g{i}", {"prompt_token_ids": prompt}, greedy)
            engine.add_request(f"s{i}", {"prompt_token_ids": prompt}, sampled)
        engine.add_beam_request("beam", prompts[-1], BeamSearchParams(beam_width=2, max_tokens=8))
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = [(o.token_ids, o.logprobs) for o in out.outputs]
            engine.check_invariants()
        return done, engine

    with_spec, engine = run(NGRAM)
    without, _ = run(None)
    assert [with_spec[f"g{i}"][0][0] for i in range(len(prompts))] == expected
    for i in range(len(prompts)):
        for (tokens, logprobs), (tokens0, logprobs0) in zip(with_spec[f"s{i}"], without[f"s{i}"]):
            assert tokens == tokens0 and len(logprobs) == len(tokens)
            for lp, lp0, token in zip(logprobs, logprobs0, tokens):
                assert math.isclose(lp[token], lp0[token], abs_tol=1e-4)
    assert with_spec["beam"][0][0] == without["beam"][0][0]
    assert engine.stats().spec_num_drafts > 0


def test_stats_report_acceptance(case):
    model, prompts, _ = case
    engine = LLMEngine(model, None, EngineConfig(block_size=4, num_kv_blocks=512, speculative_config=NGRAM))
    run_engine(engine, prompts, 24)
    stats = engine.stats()
    assert stats.spec_acceptance_rate == stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens
    assert stats.spec_mean_acceptance_length == 1 + stats.spec_num_accepted_tokens / stats.spec_num_drafts
    assert sum(stats.spec_num_draft_tokens_per_pos) == stats.spec_num_draft_tokens
    assert sum(stats.spec_num_accepted_tokens_per_pos) == stats.spec_num_accepted_tokens
    per_pos = stats.spec_num_accepted_tokens_per_pos
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])), "a draft is accepted only after its predecessors"
    assert "speculative decoding" in str(stats) and stats.spec_acceptance_rate > 0.2  # the copying prompts pay
    plain = LLMEngine(model, None, EngineConfig(block_size=4, num_kv_blocks=512))
    run_engine(plain, prompts, 24)
    assert plain.stats().spec_num_drafts == 0 and "speculative" not in str(plain.stats())
    assert len(engine.trace) < len(plain.trace), "accepted drafts save steps"


def test_rollback_releases_whole_blocks_and_resets_the_partial_one():
    kv = KVCacheManager(8, 4)
    kv.allocate_slots("a", 10)
    table = list(kv.block_tables["a"].block_ids)
    rollback = kv.rollback("a", 7)
    assert kv.block_tables["a"].block_ids == table[:2] and kv.block_tables["a"].num_tokens == 7
    assert rollback.freed == (table[2],)
    assert rollback.slots == (table[1] * 4 + 3, table[2] * 4, table[2] * 4 + 1)
    assert kv.rollback("a", 7).slots == ()  # nothing past the end
    kv.check_invariants()
    with pytest.raises(ValueError, match="cannot roll back to 8 of 7"):
        kv.rollback("a", 8)
    kv.allocate_slots("a", 8)  # the partial block fills again in place
    assert kv.block_tables["a"].block_ids == table[:2]


def test_ngram_lookup():
    assert propose_ngram([1, 2, 3, 4, 1, 2, 3], 1, 3, 2) == (4, 1)
    assert propose_ngram([1, 2, 3, 4, 1, 2, 3], 4, 4, 2) == ()  # no earlier 4-gram ending in 3
    assert propose_ngram([5, 1, 9, 2, 1, 7, 1], 1, 1, 3) == (7, 1)  # the latest occurrence wins
    assert propose_ngram([8, 1, 2, 5, 3, 1, 2, 6, 1, 2], 1, 2, 1) == (6,)  # the longest n, then the latest
    assert propose_ngram([1], 1, 3, 3) == () and propose_ngram([], 1, 3, 3) == ()


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
         "must not exceed"),
        ({"method": "ngram", "num_speculative_tokens": 2, "speculative": 1}, r"unknown key\(s\) \['speculative'\]"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a model"),
        ({"num_speculative_tokens": 2}, "needs 'method'"),
        ("ngram", "must be a dict"),
    ],
)
def test_bad_config_is_refused_by_name(spec, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=spec)


def test_draft_model_must_share_the_vocabulary():
    model = tiny_model("llama")
    other = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    spec = {"method": "draft_model", "model": other, "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="vocabulary has 64 tokens and the target's 128"):
        LLMEngine(model, None, EngineConfig(block_size=4, num_kv_blocks=64, speculative_config=spec))


# -- the rejection-sampling rule, statistically -----------------------------------------------------------------


def chi2_threshold(df: int, z: float = 4.265) -> float:
    """The chi-square quantile at 1 - 1e-5 (z = 4.265), by Wilson and Hilferty's approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over bins with an expected count of at least 5 (the rest merged into one)."""
    expected = probs * counts.sum()
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = expected > 0
    return float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()), int(keep.sum()) - 1


def test_rejection_sampling_follows_the_target_distribution():
    """The verifier on a tiny model's real logits: the first emitted token follows row 0's distribution whatever
    the draft, a draft is accepted with probability p(draft), and the bonus token after an accepted draft follows
    row 1's. 20 000 seeded verifications; a real bias of a few percent would fail."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=12, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, initializer_range=0.3)
    model = LlamaForCausalLM(config).eval()
    context = [1, 5, 2]
    with torch.inference_mode():
        probs = torch.softmax(model(torch.tensor([context])).logits[0, -1], -1)
        draft = int(probs.argsort()[-2])  # the second likeliest: accepted often, rejected often
        logits = model(torch.tensor([context + [draft]])).logits[0, -2:]
    p0, p1 = torch.softmax(logits[0], -1), torch.softmax(logits[1], -1)
    assert torch.allclose(p0, probs, atol=1e-5)
    sampler = Sampler(1234, torch.device("cpu"))
    params = SamplingParams(temperature=1.0)
    num = 20_000
    rows = [((draft,), SamplingRequest(f"r{i}", params)) for i in range(num)]
    checks = verify(logits.repeat(num, 1), rows, sampler)
    first = torch.tensor([c.token_id if c.num_accepted == 0 else draft for c in checks])
    counts = torch.bincount(first, minlength=12).float()
    statistic, df = chi2(counts, p0)
    assert statistic < chi2_threshold(df), f"first token: chi2 {statistic:.1f} on {df} dof"
    accepted = sum(c.num_accepted for c in checks)
    assert abs(accepted / num - p0[draft].item()) < 4.5 * math.sqrt(p0[draft].item() * (1 - p0[draft].item()) / num)
    bonus = torch.tensor([c.token_id for c in checks if c.num_accepted == 1])
    statistic, df = chi2(torch.bincount(bonus, minlength=12).float(), p1)
    assert statistic < chi2_threshold(df), f"bonus token: chi2 {statistic:.1f} on {df} dof"
    rejected = torch.tensor([c.token_id for c in checks if c.num_accepted == 0])
    assert not (rejected == draft).any(), "after a rejection the draft itself is never drawn"


def test_stops_and_min_tokens_match_no_speculation(case):
    """A verified chunk emits several tokens at once: a stop token, a stop string or max_tokens inside it cuts
    the output exactly where one token at a time would have stopped; min_tokens bans stops at the right rows."""
    from tests.helpers import ByteTokenizer

    model, prompts, expected = case
    copying = prompts[-1]
    out = expected[-1]
    text = ByteTokenizer().decode(out)
    cases = [
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[out[3]]),
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[out[3]], min_tokens=9),
        SamplingParams(temperature=0, max_tokens=24, stop=[text[7:9]]),
        SamplingParams(temperature=0, max_tokens=7, logprobs=1),
    ]

    def run(spec):
        config = EngineConfig(block_size=4, num_kv_blocks=256, speculative_config=spec)
        engine = LLMEngine(model, ByteTokenizer(), config)
        for i, params in enumerate(cases):
            engine.add_request(f"r{i}", {"prompt_token_ids": copying}, params)
        done = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    c = o.outputs[0]
                    done[o.request_id] = (c.token_ids, c.text, c.finish_reason, c.stop_reason, len(c.logprobs or []))
            engine.check_invariants()
        assert engine.kv_cache_manager.num_free_blocks == 256
        return done, engine.stats()

    with_spec, stats = run({"method": "draft_model", "model": model, "num_speculative_tokens": 6})  # all accepted
    assert with_spec == run(None)[0]
    assert stats.spec_mean_acceptance_length > 2


def test_self_draft_shares_the_target_weights(case):
    from pagedlab.spec_decode.self_draft import self_draft

    model, prompts, expected = case
    draft = self_draft(model, 1)
    assert draft.model.layers[0] is model.model.layers[0] and draft.lm_head is model.lm_head
    assert len(model.model.layers) == 2 and model.config.num_hidden_layers == 2, "the target is left as it was"
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
    engine = LLMEngine(model, None, EngineConfig(block_size=4, num_kv_blocks=512, speculative_config=spec))
    assert run_engine(engine, prompts, 24) == expected
    with pytest.raises(ValueError, match="num_layers must be from 1 to 1"):
        self_draft(model, 2)


def test_the_trace_describes_verification_and_rollback(case):
    from pagedlab.viz import describe_step

    model, prompts, _ = case
    engine = LLMEngine(model, None, EngineConfig(block_size=4, num_kv_blocks=64, speculative_config=NGRAM))
    run_engine(engine, prompts[-2:], 12)
    texts = [describe_step(engine.trace, i) for i in range(len(engine.trace))]
    rolled = next(i for i, r in enumerate(engine.trace) if any(slots for _, slots in r.rolled_back))
    assert "verified" in texts[rolled]
    # positions are where tokens sit in the sequence; slots are physical (block id x block size + offset): the
    # text names each as what it is (issue 27: the two read alike)
    record = engine.trace[rolled]
    rid, slots = next((rid, slots) for rid, slots in record.rolled_back if slots)
    work = next(w for w in record.scheduled if w.request_id == rid)
    last = work.num_computed_tokens + work.num_new_tokens - 1
    first_rejected = last - len(slots) + 1
    where = f"position {last}" if len(slots) == 1 else f"positions {first_rejected}-{last}"
    assert f"rolled back {where} (physical slots {list(slots)})" in texts[rolled], texts[rolled]
    assert f"(positions {work.num_computed_tokens}-{last})" in texts[rolled]


def test_smollm2_greedy_matches_hf(smollm2):
    """The embedded SmolLM2: a prompt it copies from (drafts accepted deep) and two questions, batched, with
    n-gram lookup: Hugging Face's tokens."""
    model, tokenizer = smollm2
    texts = ["Repeat this sentence exactly: the quick brown fox jumps over the lazy dog near the river bank.",
             "What is the capital of France?", "List three prime numbers."]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
               for t in texts]
    prompts = [list(p if isinstance(p, list) else p["input_ids"]) for p in prompts]
    expected = hf_greedy(model, prompts, max_new_tokens=24)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    engine = LLMEngine(model, tokenizer, EngineConfig(block_size=16, num_kv_blocks=64, speculative_config=spec))
    assert run_engine(engine, prompts, 24) == expected
    assert engine.stats().spec_num_accepted_tokens > 0


def test_a_draft_model_does_not_combine_with_tensor_parallelism():
    spec = {"method": "draft_model", "model": "any", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="does not combine with tensor_parallel_size or pipeline_parallel_size > 1"):
        EngineConfig(speculative_config=spec, tensor_parallel_size=2)


def test_fp8_kv_cache_speculation_changes_no_token(case):
    """With an FP8 cache the tokens are fp8's own; speculation leaves them as they are."""
    model, prompts, _ = case
    outputs = []
    for spec in (None, NGRAM):
        config = EngineConfig(block_size=4, num_kv_blocks=512, kv_cache_dtype="fp8", speculative_config=spec)
        outputs.append(run_engine(LLMEngine(model, None, config), prompts, 24))
    assert outputs[0] == outputs[1]


def test_a_draft_model_with_prefix_caching_when_a_decode_is_left_out(case):
    """n = 3 samples and a budget of 2 tokens: some running decode is left out of each step, with a length that
    is a multiple of block_size; the draft model drafts for it again (issue 31: every later step raised 'rolled
    back into a cached block'). The seeded samples are those drawn without speculation."""
    model, _, _ = case
    params = SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=8)

    def run(spec):
        config = EngineConfig(block_size=2, num_kv_blocks=64, max_num_batched_tokens=2, enable_chunked_prefill=True,
                              enable_prefix_caching=True, speculative_config=spec)
        engine = LLMEngine(model, None, config)
        engine.add_request("a", {"prompt_token_ids": [1, 2, 3, 4, 5]}, params)
        outputs = []
        while engine.has_unfinished_requests():
            outputs += [o for o in engine.step() if o.finished]
            engine.check_invariants()
            if spec:
                engine.proposer.tables.check_invariants()
        return [c.token_ids for c in outputs[0].outputs]

    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": 2}
    assert run(spec) == run(None)
