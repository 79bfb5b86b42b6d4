"""When memory runs out: preemption by recompute, swap or auto (whole or partial), forced preemptions, and an
engine that survives abuse (aborts anywhere, requests whose processing raises, thousands of requests in a tight
pool).

Every scheduling trick must leave greedy tokens unchanged, so each test compares with Hugging Face or with an
unconstrained run, and checks that no block is left behind in either pool.
"""

from __future__ import annotations

import random

import pytest

from pagedlab import LLM, LLMEngine, SamplingParams
from pagedlab.beam_search import BeamSearchParams
from pagedlab.config import EngineConfig
from pagedlab.core.kv_cache_manager import KVCacheManager
from pagedlab.core.preemption import PreemptionCostModel, PreemptionMode
from pagedlab.core.request import RequestStatus
from pagedlab.core.swap_space import SwapSpace
from tests.helpers import hf_greedy, random_prompts, run_engine, tiny_model

PROMPT_LENGTHS = [5, 17, 1, 33, 9, 24]
MAX_TOKENS = 24
TIGHT = dict(block_size=4, num_kv_blocks=18)  # the longest request (57 tokens, 15 blocks) and a little more


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def case(model):
    prompts = random_prompts(PROMPT_LENGTHS)
    return prompts, hf_greedy(model, prompts, MAX_TOKENS)


def engine_for(model, **config) -> LLMEngine:
    return LLMEngine(model, None, EngineConfig(**{**TIGHT, **config}))


def assert_no_leaks(engine: LLMEngine) -> None:
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks, "device blocks leaked"
    if engine.swap_space is not None:
        assert engine.swap_space.pool.num_used_blocks == 0 and not engine.swap_space.block_tables, "CPU blocks leaked"
    engine.check_invariants()


# -- the three modes keep the tokens ----------------------------------------------------------------------


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_modes_keep_tokens_under_pressure(model, case, mode, prefix_caching):
    prompts, expected = case
    engine = engine_for(model, preemption_mode=mode, enable_prefix_caching=prefix_caching)
    assert run_engine(engine, prompts, MAX_TOKENS) == expected
    stats = engine.stats()
    assert stats.num_preemptions >= 3
    assert stats.num_preemptions == stats.num_preemptions_recompute + stats.num_preemptions_swap
    if mode == "recompute":
        assert stats.num_preemptions_swap == 0 and stats.num_recomputed_tokens > 0
    if mode == "swap":
        assert stats.num_preemptions_swap > 0
        assert stats.num_swapped_out_blocks == stats.num_swapped_in_blocks > 0
        assert stats.num_swapped_bytes == 2 * stats.num_swapped_out_blocks * engine.worker.info.bytes_per_block
    assert_no_leaks(engine)


@pytest.mark.parametrize("budget", [1, 4, 16, 64])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_chunked_prefill_with_preemption(model, case, budget, mode):
    prompts, expected = case
    engine = engine_for(
        model, preemption_mode=mode, enable_chunked_prefill=True, max_num_batched_tokens=budget,
        enable_prefix_caching=budget == 4,
    )
    assert run_engine(engine, prompts, MAX_TOKENS, "staggered") == expected
    assert engine.stats().num_preemptions > 0 or budget == 1
    assert max(r.num_batched_tokens for r in engine.trace) <= budget
    assert_no_leaks(engine)


def test_full_swap_pool_falls_back_to_recompute(model, case):
    prompts, expected = case
    engine = engine_for(model, preemption_mode="swap", num_cpu_blocks=3)
    assert run_engine(engine, prompts, MAX_TOKENS) == expected
    stats = engine.stats()
    assert stats.num_preemptions_swap > 0 and stats.num_preemptions_recompute > 0
    assert_no_leaks(engine)


def test_auto_explains_its_choice(model):
    engine = engine_for(model, preemption_mode="auto")
    text = engine.cost_model.explain()
    assert "auto chooses" in text and "tokens/s" in text and "GB/s" in text
    cost = PreemptionCostModel(bytes_per_block=1000, block_size=10, copy_bytes_per_s=1e6, prefill_tokens_per_s=100)
    assert cost.choose(num_blocks=1, num_tokens=10) == PreemptionMode.SWAP  # 2 ms to move, 100 ms to recompute
    slow_copy = PreemptionCostModel(1000, 10, copy_bytes_per_s=1e3, prefill_tokens_per_s=100)
    assert slow_copy.choose(num_blocks=1, num_tokens=10) == PreemptionMode.RECOMPUTE
    assert "recompute is" in slow_copy.explain()


# -- groups keep their sharing across a swap ----------------------------------------------------------------


def test_swap_space_keeps_sharing():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    swap = SwapSpace(kv, num_cpu_blocks=8)
    kv.allocate_slots("a", 6)  # blocks [0, 1], the second half full
    kv.fork("a", "b")
    allocation = kv.allocate_slots("b", 7, write_from=6)  # b writes into the shared partial block: copy-on-write
    kv.release_copy_sources([allocation.copy])  # the step ran: the copy is made
    shared = kv.block_tables["a"].block_ids[0]
    assert swap.num_blocks_to_swap_out(["a", "b"]) == 3
    moves, freed = swap.swap_out(["a", "b"])
    assert sum(len(pairs) for _, pairs in moves) == 3 and len(freed) == 3
    cpu_a, cpu_b = swap.block_tables["a"].block_ids, swap.block_tables["b"].block_ids
    assert cpu_a[0] == cpu_b[0] and swap.pool.ref_count[cpu_a[0]] == 2 and cpu_a[1] != cpu_b[1]
    assert (shared, cpu_a[0]) in moves[0][1]
    swap.check_invariants()
    moves = swap.swap_in(["a", "b"])
    device_a, device_b = kv.block_tables["a"].block_ids, kv.block_tables["b"].block_ids
    assert device_a[0] == device_b[0] and kv.pool.ref_count[device_a[0]] == 2
    assert kv.block_tables["b"].num_tokens == 7 and swap.pool.num_used_blocks == 0
    kv.check_invariants()
    swap.check_invariants()


def test_parallel_samples_survive_swap(model):
    prompts = random_prompts([13, 22])
    params = SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=16)
    roomy = LLM(model, block_size=4, num_kv_blocks=256)
    tight = LLM(model, block_size=4, num_kv_blocks=16, preemption_mode="swap")
    texts = lambda outs: [[c.token_ids for c in o.outputs] for o in outs]  # noqa: E731
    prompt_dicts = [{"prompt_token_ids": p} for p in prompts]
    assert texts(tight.generate(prompt_dicts, params, use_tqdm=False)) == texts(
        roomy.generate(prompt_dicts, params, use_tqdm=False)
    )
    engine = tight.llm_engine
    assert engine.stats().num_preemptions_swap > 0
    # a group swapped out together moves each shared block once
    grouped = [r for r in engine.trace if len({rid.partition(":")[0] for rid, _ in r.swapped_out}) < len(r.swapped_out)]
    assert grouped, "no n > 1 group was swapped out together"
    assert_no_leaks(engine)


def test_beam_search_survives_swap(model):
    prompts = [{"prompt_token_ids": p} for p in random_prompts([9, 14])]
    params = BeamSearchParams(beam_width=3, max_tokens=10)
    roomy = LLM(model, block_size=4, num_kv_blocks=256).beam_search(prompts, params)
    tight = LLM(model, block_size=4, num_kv_blocks=14, preemption_mode="swap")
    assert [[s.tokens for s in o.sequences] for o in tight.beam_search(prompts, params)] == [
        [s.tokens for s in o.sequences] for o in roomy
    ]
    assert tight.stats().num_preemptions_swap > 0
    assert_no_leaks(tight.llm_engine)


# -- forced preemption (vLLM's test trick) ------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_forced_preemption_keeps_tokens_and_counts(model, case, mode):
    prompts, expected = case
    engine = engine_for(model, num_kv_blocks=512, preemption_mode=mode, force_preemption_rate=0.3, seed=3)
    assert run_engine(engine, prompts, MAX_TOKENS) == expected
    happened = sum(len(record.preempted) for record in engine.trace)
    assert happened >= 5 and engine.stats().num_preemptions == happened
    assert_no_leaks(engine)


# -- partial preemption: only the tail blocks a victim must give up ------------------------------------------


def test_tail_release_counts_only_unshared_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate_slots("a", 14)  # 4 blocks, the last 2/4 full
    assert kv.num_tail_blocks_to_release("a", 2) == 2
    assert kv.num_tail_blocks_to_release("a", 4) is None, "the first block always stays"
    kv.fork("a", "b")
    kv.release_copy_sources([kv.allocate_slots("b", 15, write_from=14).copy])  # b copies the shared last block
    assert kv.num_tail_blocks_to_release("b", 1) == 1  # its private copy
    assert kv.num_tail_blocks_to_release("b", 2) is None  # the rest is shared with a: releasing it frees nothing
    a_blocks = list(kv.block_tables["a"].block_ids)
    freed = kv.truncate("a", 2)
    assert kv.block_tables["a"].num_tokens == 8 and kv.block_tables["a"].block_ids == a_blocks[:2]
    assert freed == [a_blocks[3]], "a's last block was its own since b's copy; block 2 stays, b holds it"
    assert kv.pool.ref_count[a_blocks[2]] == 1
    kv.check_invariants()


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("mode", ["recompute", "auto"])
def test_partial_preemption_keeps_tokens(model, case, mode, prefix_caching, chunked):
    prompts, expected = case
    config = dict(preemption_mode=mode, enable_prefix_caching=prefix_caching, enable_chunked_prefill=chunked,
                  max_num_batched_tokens=16 if chunked else 2048)
    engine = engine_for(model, enable_partial_preemption=True, **config)
    assert run_engine(engine, prompts, MAX_TOKENS, "staggered") == expected
    stats = engine.stats()
    assert stats.num_preemptions_partial > 0
    by_kind = stats.num_preemptions_recompute + stats.num_preemptions_swap + stats.num_preemptions_partial
    assert stats.num_preemptions == by_kind
    partial = [(rid, kept) for record in engine.trace for rid, kept in record.truncated]
    assert len(partial) == stats.num_preemptions_partial and all(kept % 4 == 0 and kept > 0 for _, kept in partial)
    assert_no_leaks(engine)
    if mode == "recompute":  # giving up the tail only throws away less work than giving up everything
        whole = engine_for(model, **config)
        assert run_engine(whole, prompts, MAX_TOKENS, "staggered") == expected
        assert stats.num_recomputed_tokens < whole.stats().num_recomputed_tokens


def test_partial_preemption_with_samples_and_beams(model):
    prompts = [{"prompt_token_ids": p} for p in random_prompts([13, 22])]
    params = SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=16)
    roomy = LLM(model, block_size=4, num_kv_blocks=256)
    partial = dict(preemption_mode="recompute", enable_partial_preemption=True)
    tight = LLM(model, block_size=4, num_kv_blocks=16, **partial)
    tokens = lambda outs: [[c.token_ids for c in o.outputs] for o in outs]  # noqa: E731
    expected = tokens(roomy.generate(prompts, params, use_tqdm=False))
    assert tokens(tight.generate(prompts, params, use_tqdm=False)) == expected
    beam = BeamSearchParams(beam_width=3, max_tokens=10)
    beams = lambda outs: [[s.tokens for s in o.sequences] for o in outs]  # noqa: E731
    tight_beams = LLM(model, block_size=4, num_kv_blocks=14, **partial)
    assert beams(tight_beams.beam_search(prompts, beam)) == beams(roomy.beam_search(prompts, beam))
    assert tight.stats().num_preemptions_partial + tight_beams.stats().num_preemptions_partial > 0
    assert_no_leaks(tight.llm_engine)
    assert_no_leaks(tight_beams.llm_engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_forced_partial_preemption_keeps_tokens_and_counts(model, case, mode):
    prompts, expected = case
    engine = engine_for(model, num_kv_blocks=512, preemption_mode=mode, force_preemption_rate=0.3, seed=3,
                        enable_partial_preemption=True)
    assert run_engine(engine, prompts, MAX_TOKENS) == expected
    happened = sum(len(record.preempted) for record in engine.trace)
    assert happened >= 5 and engine.stats().num_preemptions == happened
    assert engine.stats().num_preemptions_partial > 0
    assert_no_leaks(engine)


# -- abuse --------------------------------------------------------------------------------------------------


def test_abort_anywhere_frees_blocks_at_once(model):
    """Abort one request in each place it can be (waiting, mid-prefill, decoding, swapped out): its blocks on
    the device and in the CPU pool are free right after the call, and the others run to the end."""
    engine = engine_for(model, num_kv_blocks=24, preemption_mode="swap", enable_chunked_prefill=True,
                        max_num_batched_tokens=8)
    params = SamplingParams(temperature=0, max_tokens=30)
    for i in range(10):
        engine.add_request(f"r{i}", {"prompt_token_ids": random_prompts([20 + i], seed=i)[0]}, params)

    def place(request) -> str:
        if request.status == RequestStatus.RUNNING:
            return "mid-prefill" if request.num_computed_tokens < request.num_prompt_tokens else "decoding"
        return request.status.value  # waiting or swapped

    aborted = {}
    while engine.has_unfinished_requests():
        engine.step()
        scheduler = engine.scheduler
        for request in [*scheduler.running, *scheduler.swapped, *scheduler.waiting]:
            where = place(request)
            if where in aborted:
                continue
            kv, swap = engine.kv_cache_manager, engine.swap_space
            held = set(kv.block_tables.get(request.request_id, ()) and kv.block_tables[request.request_id].block_ids)
            cpu_held = set(swap.block_tables[request.request_id].block_ids) if where == "swapped" else set()
            engine.abort_request(request.request_id)
            assert request.status == RequestStatus.FINISHED_ABORTED
            assert request.request_id not in kv.block_tables and request.request_id not in swap.block_tables
            assert all(kv.pool.ref_count[b] == 0 for b in held), "device blocks not freed at once"
            assert all(swap.pool.ref_count[b] == 0 for b in cpu_held), "CPU blocks not freed at once"
            engine.check_invariants()
            aborted[where] = request.request_id
            break
    assert set(aborted) == {"waiting", "mid-prefill", "decoding", "swapped"}
    assert_no_leaks(engine)


def test_failing_request_is_isolated(model, case, monkeypatch):
    """A request whose processing raises finishes with finish_reason "error"; the others are untouched."""
    prompts, expected = case
    engine = engine_for(model, num_kv_blocks=256, preemption_mode="swap")
    runner = engine.model_runner
    execute = runner.execute

    def flaky(scheduled):
        if any(s.request_id == "r3" and s.num_computed_tokens >= 40 for s in scheduled):
            raise RuntimeError("sampling blew up")
        return execute(scheduled)

    monkeypatch.setattr(runner, "execute", flaky)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0]
        engine.check_invariants()
    failed = results.pop("r3")
    assert failed.finish_reason == "error" and "RuntimeError: sampling blew up" in failed.error
    assert failed.token_ids == expected[3][: len(failed.token_ids)] and len(failed.token_ids) == 40 - 33 + 1
    assert {rid: c.token_ids for rid, c in results.items()} == {f"r{i}": expected[i] for i in range(6) if i != 3}
    assert_no_leaks(engine)


def test_failing_stop_check_is_isolated(model, case, monkeypatch):
    prompts, expected = case
    engine = engine_for(model, num_kv_blocks=256)
    processor = engine.output_processor
    apply = processor._apply

    def bad_stop(sequence, update, logprobs):
        if update.request_id == "r1":
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return apply(sequence, update, logprobs)

    monkeypatch.setattr(processor, "_apply", bad_stop)
    outputs = {}
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0, max_tokens=8, stop=["x"])
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o.outputs[0]) for o in engine.step() if o.finished)
    assert outputs["r1"].finish_reason == "error" and "UnicodeDecodeError" in outputs["r1"].error
    assert all(outputs[f"r{i}"].token_ids == expected[i][:8] for i in range(6) if i != 1)
    assert_no_leaks(engine)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap", "auto", "partial"])
def test_load_a_thousand_requests_with_aborts(model, mode):
    """1,000 requests of random lengths arriving over time (some with n = 2 samples, some beam searches), 10%
    aborted at random moments, a pool a few requests wide: the invariants hold after every step, nothing leaks,
    and every request finishes or is aborted within a bounded number of steps: the oldest unfinished request
    never stays the oldest for more than a few of its own lifetimes (it is never a victim, so nothing starves)."""
    rng = random.Random(mode)
    max_model_len = 64
    engine = LLMEngine(
        model, None,
        EngineConfig(block_size=4, num_kv_blocks=40, num_cpu_blocks=24, max_num_seqs=32, max_num_batched_tokens=64,
                     preemption_mode="auto" if mode == "partial" else mode, enable_partial_preemption=mode == "partial",
                     enable_chunked_prefill=mode != "recompute", max_model_len=max_model_len, record_trace=False),
    )
    num_requests, arrivals_per_step = 1000, 4
    pending = list(range(num_requests))
    to_abort = set(rng.sample(pending, num_requests // 10))
    added_at, done = {}, set()
    oldest, oldest_since = None, 0
    step = 0
    while pending or engine.has_unfinished_requests():
        for _ in range(min(arrivals_per_step, len(pending))):
            i = pending.pop(0)
            prompt = [rng.randrange(1, 128) for _ in range(rng.randint(1, 40))]
            kind = rng.random()
            if kind < 0.05:
                engine.add_beam_request(f"q{i}", {"prompt_token_ids": prompt}, BeamSearchParams(2, rng.randint(1, 8)))
            else:
                n = 2 if kind < 0.15 else 1
                params = SamplingParams(n=n, temperature=rng.choice([0, 0.8]) if n == 1 else 0.8,
                                        max_tokens=rng.randint(1, 24), seed=i)
                engine.add_request(f"q{i}", {"prompt_token_ids": prompt}, params)
            added_at[f"q{i}"] = step
        live = [rid for rid in added_at if rid not in done]
        for rid in live:
            if int(rid[1:]) in to_abort and rng.random() < 0.2:
                engine.abort_request(rid)
                done.add(rid)
        for out in engine.step():
            if out.finished:
                done.add(out.request_id)
                assert all(c.finish_reason in ("length", "stop") for c in out.outputs), out.outputs
        engine.check_invariants()
        step += 1
        first = next((rid for rid in added_at if rid not in done), None)
        if first != oldest:
            oldest, oldest_since = first, step
        assert step - oldest_since <= 4 * max_model_len, f"{oldest} has been the oldest for {step - oldest_since} steps"
    assert done == set(added_at)
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert_no_leaks(engine)
