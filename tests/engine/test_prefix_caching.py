"""Prefix caching: requests that share a prefix compute it once, and their tokens do not change."""

from __future__ import annotations

import pytest

from pagedlab import LLMEngine, SamplingParams
from pagedlab.config import EngineConfig
from pagedlab.core.block_hash import hash_block, root_hash
from pagedlab.core.block_pool import BlockPool
from pagedlab.core.kv_cache_manager import KVCacheManager
from tests.helpers import hf_greedy, random_prompts, run_engine, tiny_model

SYSTEM = random_prompts([45], seed=11)[0]  # a shared "system prompt", ending mid-block for block size 4 and 16
QUESTIONS = random_prompts([3, 9, 1, 14, 6, 20], seed=12)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def engine_for(model, caching: bool, block_size: int = 4, num_blocks: int = 256, **kw) -> LLMEngine:
    config = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, enable_prefix_caching=caching, **kw)
    return LLMEngine(model, None, config)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("mode", ["all-at-once", "one-at-a-time", "staggered"])
def test_shared_system_prompt(model, block_size, mode):
    prompts = [SYSTEM + q for q in QUESTIONS]
    expected = hf_greedy(model, prompts, 12)
    engine = engine_for(model, True, block_size, num_blocks=1024 // block_size)
    assert run_engine(engine, prompts, 12, mode) == expected
    stats = engine.stats()
    full_system_blocks = len(SYSTEM) // block_size
    if mode == "all-at-once":  # all admitted in the first step, before any block is hashed: nothing to hit yet
        assert stats.prefix_cache_hits == 0
    else:  # every request after the first, admitted after the first's prefill, hits the whole system prompt
        assert stats.prefix_cache_hits >= (len(prompts) - 1) * full_system_blocks * block_size
    assert stats.prefix_cache_queries == sum(len(p) for p in prompts)


def test_all_at_once_shares_within_a_step_only_after_caching(model):
    """Requests admitted in the same step as the first cannot hit it yet: hashes are made once blocks fill."""
    engine = engine_for(model, True)
    prompts = [SYSTEM + q for q in QUESTIONS]
    run_engine(engine, prompts, 4, "all-at-once")
    assert engine.stats().prefix_cache_hits == 0
    run_engine(engine, prompts, 4, "all-at-once")  # the second round hits the freed-but-cached blocks
    assert engine.stats().prefix_cache_hit_rate > 0.4


def test_same_prompt_twice_leaves_the_last_token_to_compute(model):
    prompt = random_prompts([16])[0]  # exactly 4 full blocks of 4
    engine = engine_for(model, True)
    first = run_engine(engine, [prompt], 5)
    second = run_engine(engine, [prompt], 5)
    assert first == second == hf_greedy(model, [prompt], 5)
    # the 4th block holds the last prompt token, which must be computed for its logits: 3 blocks hit
    assert engine.stats().prefix_cache_hits == 3 * 4
    assert engine.trace[-5].scheduled[0].num_computed_tokens == 12


def test_outputs_carry_the_cached_tokens_of_their_first_admission(model):
    """RequestOutput.num_cached_tokens (vLLM's field): the prompt tokens found in the cache, for every sample."""
    prompt = {"prompt_token_ids": random_prompts([14])[0]}
    engine = engine_for(model, True)
    counts = []
    for request_id in ("a", "b"):
        engine.add_request(request_id, prompt, SamplingParams(n=2, temperature=1.0, max_tokens=3))
        while engine.has_unfinished_requests():
            counts += [(o.request_id, o.num_cached_tokens) for o in engine.step()]
    assert set(counts) == {("a", 0), ("b", 12)}


def test_caching_on_equals_off_under_eviction_pressure(model):
    """A pool so small that cached blocks are evicted (and requests preempted) all the time."""
    prompts = [SYSTEM + q for q in QUESTIONS] * 2
    expected = hf_greedy(model, prompts[: len(QUESTIONS)], 10) * 2
    on = engine_for(model, True, num_blocks=20)
    off = engine_for(model, False, num_blocks=20)
    assert run_engine(on, prompts, 10, "staggered") == expected == run_engine(off, prompts, 10, "staggered")
    stats = on.stats()
    assert stats.num_evicted_blocks > 0 and stats.prefix_cache_hits > 0
    assert any(record.evicted for record in on.trace)


def test_cache_salt_separates_equal_prompts(model):
    engine = engine_for(model, True)
    prompt = random_prompts([20])[0]
    params = SamplingParams(temperature=0, max_tokens=2)
    for salt in ["alice", "bob", "alice"]:
        engine.add_request(salt + str(engine.stats().num_finished), {"prompt_token_ids": prompt, "cache_salt": salt},
                           params)
        while engine.has_unfinished_requests():
            engine.step()
    assert engine.stats().prefix_cache_hits == 4 * 4  # only the second "alice" hits (4 of its 5 blocks)


def test_reset_prefix_cache_refuses_while_blocks_are_in_use(model):
    engine = engine_for(model, True)
    engine.add_request("a", {"prompt_token_ids": SYSTEM}, SamplingParams(temperature=0, max_tokens=3))
    engine.step()
    assert engine.reset_prefix_cache() is False
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_cache_manager.pool.hash_to_block
    assert engine.reset_prefix_cache() is True
    assert not engine.kv_cache_manager.pool.hash_to_block
    engine.check_invariants()


def test_eviction_takes_the_least_recently_freed_and_tail_blocks_first():
    kv = KVCacheManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    tokens = [1, 2, 3, 4, 5, 6]
    for request_id, ids in [("a", tokens), ("b", [9, 9, 9, 9])]:
        kv.allocate_slots(request_id, len(ids))
        kv.cache_full_blocks(request_id, len(ids), lambda i, j, ids=ids: ids[i:j])
    a_blocks, b_blocks = list(kv.block_tables["a"].block_ids), list(kv.block_tables["b"].block_ids)
    kv.free("a")
    kv.free("b")
    # free queue: the never-used block, then a's blocks tail first, then b's tail first
    assert kv.pool.free_block_ids() == [5] + a_blocks[::-1] + b_blocks[::-1]
    allocation = kv.allocate_slots("c", 4)  # takes block 5 and a's tail block: its hash goes, a's head stays cached
    assert allocation.evicted == (a_blocks[-1],)
    hits = kv.get_computed_blocks(tokens + [7])
    assert hits == a_blocks[:2]
    kv.check_invariants()


def test_a_hash_collision_never_returns_wrong_kv():
    pool = BlockPool(4)
    [block] = pool.allocate(1)
    digest = hash_block(root_hash(), [1, 2])
    assert pool.cache(block, digest, [1, 2])
    assert pool.lookup(digest, [1, 2]) == block
    assert pool.lookup(digest, [3, 4]) is None  # same hash, other tokens: a miss, not a hit


def test_hashes_are_stable_across_processes():
    import subprocess
    import sys

    code = (
        "from pagedlab.core.block_hash import hash_block, root_hash; "
        "print(hash_block(root_hash('s'), [1, 2, 3]).hex())"
    )
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout for _ in range(2)}
    assert len(runs) == 1 and runs.pop().strip() == hash_block(root_hash("s"), [1, 2, 3]).hex()


def test_stats_show_the_hit_rate(model):
    engine = engine_for(model, True)
    run_engine(engine, [SYSTEM + q for q in QUESTIONS], 4, "one-at-a-time")
    text = str(engine.stats())
    assert "prefix cache hit rate" in text and engine.stats().prefix_cache_hit_rate > 0.5
