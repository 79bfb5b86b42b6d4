"""Hypothesis state machines for the pure-Python core: the block pool, the block tables and the scheduler.

Each machine keeps a small model of its own and checks the real objects against it (and their
`check_invariants()`) after every rule. Pools are tiny on purpose, so that running out of blocks,
eviction of cached blocks and recompute preemption happen often. The prefix-caching machine drives fork,
copy-on-write, prefix-cache hits, eviction and reset directly and keeps a shadow of the KV each physical block
holds, so a write into a block another table reads, a stale cached hash, or a hit on other KV is caught. The
scheduler machine also keeps a shadow KV cache (which token prefix each slot holds), so a request that reads KV
it did not write, or that a reused block overwrote, is caught.
Settings are derandomized and database-free, so CI is reproducible.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedlab.core.block_hash import hash_block, root_hash
from pagedlab.core.block_pool import BlockPool, NotEnoughBlocksError
from pagedlab.core.kv_cache_manager import BlockTable, KVCacheManager, cdiv
from pagedlab.core.request import Request, RequestStatus
from pagedlab.core.preemption import PreemptionCostModel, PreemptionMode
from pagedlab.core.scheduler import Scheduler, SchedulerConfig
from pagedlab.core.swap_space import SwapSpace
from pagedlab.sampling_params import SamplingParams

BLOCK_SIZES = (1, 2, 4, 16)
EOS = 0


def machine_settings(max_examples: int, steps: int) -> settings:
    return settings(
        max_examples=max_examples,
        stateful_step_count=steps,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )


# -- 1. BlockPool + KVCacheManager ------------------------------------------------------------------------


class KVCacheManagerMachine(RuleBasedStateMachine):
    """Grow and free block tables over a tiny pool; the model is request_id -> num_tokens and the free queue.

    No sharing here (no fork, no prefix caching), so every held block has ref_count 1.
    """

    REQUEST_IDS = tuple(f"r{i}" for i in range(6))

    @initialize(block_size=st.sampled_from(BLOCK_SIZES), num_blocks=st.integers(1, 40))
    def setup(self, block_size: int, num_blocks: int) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv = KVCacheManager(num_blocks, block_size)
        self.model_tokens: dict[str, int] = {}
        self.model_free: list[int] = list(range(num_blocks))  # head (next to be allocated) first
        self.num_failed = 0

    def _snapshot(self):
        tables = {rid: (tuple(t.block_ids), t.num_tokens) for rid, t in self.kv.block_tables.items()}
        return tables, self.kv.pool.free_block_ids(), list(self.kv.pool.ref_count)

    @rule(data=st.data(), request_id=st.sampled_from(REQUEST_IDS))
    def allocate_slots(self, data, request_id: str) -> None:
        # Up to a little more than the whole pool, so that both success and failure are common.
        num_tokens = data.draw(st.integers(0, self.num_blocks * self.block_size + self.block_size), "num_tokens")
        before = self._snapshot()
        old_blocks = list(self.kv.block_tables[request_id].block_ids) if request_id in self.kv.block_tables else []
        needed = cdiv(num_tokens, self.block_size) - len(old_blocks)

        new_blocks = self.kv.allocate_slots(request_id, num_tokens)

        if new_blocks is None:
            self.num_failed += 1
            assert needed > len(self.model_free), "allocate_slots failed although enough blocks were free"
            assert self._snapshot() == before, "a failed allocate_slots changed something"
            return
        assert needed <= len(self.model_free)
        expected_new = self.model_free[: max(needed, 0)]
        assert new_blocks == expected_new, "new blocks must come from the head of the free queue, in order"
        del self.model_free[: len(expected_new)]
        self.model_tokens[request_id] = max(self.model_tokens.get(request_id, 0), num_tokens)
        table = self.kv.block_table(request_id)
        assert table.block_ids == old_blocks + new_blocks, "existing blocks must keep their logical position"

    @rule(request_id=st.sampled_from(REQUEST_IDS))
    def free(self, request_id: str) -> None:
        table = self.kv.block_tables.get(request_id)
        expected = list(reversed(table.block_ids)) if table is not None else []
        freed = self.kv.free(request_id)
        assert freed == expected, "free releases the table tail first, and every block (ref_count 1) becomes free"
        self.model_free.extend(expected)
        self.model_tokens.pop(request_id, None)
        assert request_id not in self.kv.block_tables

    @rule(request_id=st.sampled_from(("unknown", "r", "")))
    def free_unknown(self, request_id: str) -> None:
        before = self._snapshot()
        assert self.kv.free(request_id) == []
        assert self._snapshot() == before

    @invariant()
    def agrees_with_model(self) -> None:
        kv = self.kv
        kv.check_invariants()
        assert {rid: t.num_tokens for rid, t in kv.block_tables.items()} == self.model_tokens
        seen: set[int] = set()
        for rid, table in kv.block_tables.items():
            assert len(table.block_ids) == cdiv(self.model_tokens[rid], self.block_size)
            if table.block_ids:
                assert 1 <= table.num_filled_in_last_block <= self.block_size
            assert not seen & set(table.block_ids), f"{rid} shares a block with another table"
            seen |= set(table.block_ids)
            assert all(kv.pool.ref_count[b] == 1 for b in table.block_ids)
        assert kv.pool.free_block_ids() == self.model_free, "free queue order differs from the LRU model"
        assert kv.num_free_blocks + kv.pool.num_used_blocks == self.num_blocks
        assert kv.pool.num_used_blocks == len(seen)

    def teardown(self) -> None:
        if not hasattr(self, "kv"):
            return
        for request_id in list(self.kv.block_tables):
            self.kv.free(request_id)
        self.kv.check_invariants()
        assert self.kv.num_free_blocks == self.num_blocks
        assert not self.kv.block_tables
        assert all(count == 0 for count in self.kv.pool.ref_count)


TestKVCacheManagerMachine = KVCacheManagerMachine.TestCase
TestKVCacheManagerMachine.settings = machine_settings(max_examples=250, steps=40)


# -- 2. Prefix caching, fork and copy-on-write ------------------------------------------------------------

ALPHABET = (1, 2)  # two token values: equal blocks, cache hits and deduplicated content are all common
SALTS = (None, "salt")
Content = tuple[str | None, tuple[int, ...]]  # (cache salt, the whole token prefix up to a block's last slot)


class PrefixCachingMachine(RuleBasedStateMachine):
    """Fork, copy-on-write, prefix caching, eviction and reset over a tiny pool, against a shadow KV.

    The model: each live request's cache salt, token list (its table covers exactly these tokens, all written)
    and block ids; and for each physical block, the KV last written into it, as (salt, the writer's token
    prefix up to the block's last written slot): a slot's KV depends on every token before it, so two blocks
    hold the same KV only if these agree. A freed block keeps its content (that is what a cache hit reuses); it
    changes only when a table writes into the block, and a write must only ever reach a block that nobody else
    holds and that the prefix cache does not point at.
    """

    REQUEST_IDS = tuple(f"r{i}" for i in range(6))

    @initialize(block_size=st.sampled_from((2, 4, 1)), num_blocks=st.integers(1, 16))
    def setup(self, block_size: int, num_blocks: int) -> None:
        self.bs = block_size
        self.num_blocks = num_blocks
        self.max_len = num_blocks * block_size + block_size  # one block more than the pool: allocation can fail
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
        self.salt: dict[str, str | None] = {}
        self.tokens: dict[str, list[int]] = {}
        self.tables: dict[str, list[int]] = {}
        self.content: dict[int, Content] = {}  # physical block -> the KV written into it (kept when freed)
        self.history: list[tuple[str | None, tuple[int, ...]]] = []  # token lists requests had: shared prefixes
        self.num_query_tokens = self.num_hit_tokens = 0

    # -- model helpers --------------------------------------------------------------------------------------

    def _content_of(self, request_id: str, index: int) -> Content:
        """What block `index` of the request's table must hold."""
        tokens = self.tokens[request_id]
        return self.salt[request_id], tuple(tokens[: min((index + 1) * self.bs, len(tokens))])

    def _chain(self, salt: str | None, tokens) -> list[bytes]:
        """The chained hashes of the full blocks of `tokens`."""
        parent, hashes = root_hash(salt), []
        for i in range(len(tokens) // self.bs):
            parent = hash_block(parent, list(tokens[i * self.bs : (i + 1) * self.bs]))
            hashes.append(parent)
        return hashes

    def _snapshot(self):
        kv, pool = self.kv, self.kv.pool
        return (
            {rid: (tuple(t.block_ids), t.num_tokens) for rid, t in kv.block_tables.items()},
            {rid: tuple(h) for rid, h in kv.block_hashes.items()},
            pool.free_block_ids(),
            list(pool.ref_count),
            dict(pool.hash_to_block),
            list(pool.block_hash),
            list(pool.block_tokens),
            (pool.num_evicted_blocks, kv.num_cow_copies, kv.num_query_tokens, kv.num_hit_tokens),
        )

    def _new_request_ids(self) -> list[str]:
        return [rid for rid in self.REQUEST_IDS if rid not in self.tokens]

    def _draw_tokens(self, data, min_len: int) -> tuple[str | None, list[int]]:
        """A salt and a token list, often starting with (part of) an earlier request's tokens."""
        base_salt, base = data.draw(st.sampled_from(SALTS), "salt"), ()
        if self.history and data.draw(st.integers(0, 3), "share_prefix"):
            base_salt, base = data.draw(st.sampled_from(self.history[-12:]), "prefix_of")
            base_salt = data.draw(st.just(base_salt) | st.just(base_salt) | st.sampled_from(SALTS), "salt")
        top = min(len(base), self.max_len)
        near_top = st.just(top) | st.integers(max(top - self.bs, 0), top)  # whole blocks of it, or nearly
        prefix_len = data.draw(near_top | st.integers(0, top), "prefix_len")
        tail_len = data.draw(self._lengths(max(min_len - prefix_len, 0), self.max_len - prefix_len), "tail_len")
        tail = data.draw(st.lists(st.sampled_from(ALPHABET), min_size=tail_len, max_size=tail_len), "tail")
        return base_salt, [*base[:prefix_len], *tail]

    def _lengths(self, lo: int, hi: int) -> st.SearchStrategy[int]:
        """Mostly up to a block or two more than `lo` (small pools stay usable), sometimes up to `hi`."""
        hi = max(lo, hi)
        short = st.integers(lo, min(lo + 2 * self.bs, hi))
        return short | short | st.integers(lo, hi)

    def _write(self, request_id: str, write_from: int) -> None:
        """The model runner writes the KV of positions [write_from, len(tokens)) into the request's blocks."""
        pool, table = self.kv.pool, self.kv.block_table(request_id)
        for index in range(write_from // self.bs, cdiv(len(self.tokens[request_id]), self.bs)):
            block_id = table.block_ids[index]
            holders = pool.ref_count[block_id]
            assert holders == 1, f"{request_id} writes block {block_id}, which {holders} tables hold (no copy-on-write)"
            assert pool.block_hash[block_id] is None, f"{request_id} writes block {block_id}, a prefix-cache block"
            self.content[block_id] = self._content_of(request_id, index)

    def _check_evictions(self, allocated: list[int], hash_before: list, ref_before: list[int]) -> None:
        evicted = self.kv.pool.take_evicted()
        assert evicted == tuple(b for b in allocated if hash_before[b] is not None), (
            f"evicted {evicted}: the cached blocks among those handed out ({allocated}) are the ones evicted"
        )
        for block_id in evicted:
            assert ref_before[block_id] == 0, f"block {block_id} was evicted while {ref_before[block_id]} held it"
            assert block_id not in self.kv.pool.hash_to_block.values()
        if evicted:
            event("evicted cached blocks")

    def _check_hits(self, salt: str | None, tokens, hits: list[int]) -> None:
        """A hit never hands back other KV, leaves the last token to compute, and stops only at a real miss."""
        assert len(hits) <= (len(tokens) - 1) // self.bs if tokens else not hits
        for i, block_id in enumerate(hits):
            want = (salt, tuple(tokens[: (i + 1) * self.bs]))
            assert self.content.get(block_id) == want, (
                f"hit {i} is block {block_id}, which holds {self.content.get(block_id)}, not {want}"
            )
        k = len(hits)
        if tokens and k < (len(tokens) - 1) // self.bs:
            want = (salt, tuple(tokens[: (k + 1) * self.bs]))
            for block_id in self.kv.pool.hash_to_block.values():
                assert self.content.get(block_id) != want, f"missed a hit: cached block {block_id} holds block {k}"

    # -- rules ----------------------------------------------------------------------------------------------

    @rule(data=st.data())
    def allocate(self, data) -> None:
        """Grow (or start, without a cache lookup) a table and write the new tokens; maybe rewrite from inside
        the partial last block (what rejected speculative tokens would do). Then maybe cache its full blocks."""
        live = sorted(self.tokens)
        request_id = data.draw(
            (st.sampled_from(live) if live else st.nothing()) | st.sampled_from(self.REQUEST_IDS), "request_id"
        )
        self._make_room(data, request_id)
        self._grow(data, request_id)

    def _make_room(self, data, *keep: str) -> None:
        """With no block free, often preempt another request first (as the scheduler would), so that growth,
        new requests and copy-on-write do not just fail once the pool has filled up."""
        others = [rid for rid in sorted(self.tokens) if rid not in keep]
        if self.kv.num_free_blocks == 0 and others and data.draw(st.booleans(), "make_room"):
            self.free(data.draw(st.sampled_from(others), "preempt"))

    def _grow(self, data, request_id: str) -> None:
        """allocate_slots for `request_id`, checked against the model, then the writes (see `_write`)."""
        kv, pool, bs = self.kv, self.kv.pool, self.bs
        old = self.tokens.get(request_id)
        held = list(self.tables.get(request_id, []))
        if old is None:
            salt, old = data.draw(st.sampled_from(SALTS), "salt"), []
            write_from, pass_write_from = 0, data.draw(st.booleans(), "pass_write_from")
            new_len = data.draw(self._lengths(0, self.max_len), "num_tokens")
        else:
            salt, n = self.salt[request_id], len(old)
            # positions before write_from keep their KV; only the partial last block may be rewritten
            write_from = data.draw(st.integers(n - n % bs, n), "write_from") if n % bs else n
            last_shared = n % bs and pool.ref_count[held[-1]] > 1
            # write_from=None is only right when no shared block gets written
            pass_write_from = last_shared or data.draw(st.booleans(), "pass_write_from")
            lo = max(n, write_from + 1)
            end_of_last_block = cdiv(n, bs) * bs  # staying within it needs no new block
            in_last_block = st.integers(lo, max(lo, end_of_last_block))
            new_len = data.draw(in_last_block | self._lengths(lo, self.max_len), "num_tokens")
        written = st.lists(st.sampled_from(ALPHABET), min_size=new_len - write_from, max_size=new_len - write_from)
        tokens = [*old[:write_from], *data.draw(written, "new_tokens")]

        num_new = max(cdiv(new_len, bs) - len(held), 0)
        cow_index = write_from // bs if pass_write_from and write_from // bs < len(held) else None
        if cow_index is not None and pool.ref_count[held[cow_index]] == 1:
            cow_index = None
        need = num_new + (cow_index is not None)
        before, free_before = self._snapshot(), pool.free_block_ids()
        hash_before, ref_before = list(pool.block_hash), list(pool.ref_count)

        result = kv.allocate_slots(request_id, new_len, write_from=write_from if pass_write_from else None)

        if result is None:
            event("allocate: not enough blocks")
            assert need > len(free_before), f"allocate_slots failed needing {need} blocks with {len(free_before)} free"
            assert self._snapshot() == before, "a failed allocate_slots changed something"
            assert kv.take_copies() == () and pool.take_evicted() == ()
            return
        assert need <= len(free_before), f"allocate_slots succeeded needing {need} blocks with {len(free_before)} free"
        allocated = free_before[:need]
        assert result == allocated, f"new blocks {result}, expected the free queue's head {allocated}"
        copies = kv.take_copies()
        if cow_index is not None:
            event("allocate: copy-on-write")
            source, copy = held[cow_index], allocated[-1]
            assert copies == ((request_id, source, copy),), f"copies {copies}, expected {source} -> {copy}"
            self.content[copy] = self.content[source]  # the engine copies the block's KV before the write
            held[cow_index] = copy
            allocated = allocated[:-1]
        else:
            assert copies == (), f"unexpected copies {copies}"
        self._check_evictions(result, hash_before, ref_before)
        self.salt[request_id], self.tokens[request_id] = salt, tokens
        self.tables[request_id] = held + allocated
        self.history.append((salt, tuple(tokens)))
        self._write(request_id, write_from)
        if data.draw(st.booleans(), "cache_after"):
            self._cache(request_id, len(tokens))

    # Rules that do not apply return at once rather than having preconditions: with several rules disabled at
    # a time, Hypothesis often gives up on drawing a rule and throws the whole example away.

    @rule(data=st.data())
    def fork(self, data) -> None:
        """A parallel sample or beam: the child shares every block; maybe one of them writes at once."""
        if not self.tokens or not self._new_request_ids():
            return
        parent = data.draw(st.sampled_from(sorted(self.tokens)), "parent")
        child = data.draw(st.sampled_from(self._new_request_ids()), "child")
        free_before, cached_before = self.kv.pool.free_block_ids(), dict(self.kv.pool.hash_to_block)
        self.kv.fork(parent, child)
        event("fork")
        assert self.kv.pool.free_block_ids() == free_before and self.kv.pool.hash_to_block == cached_before
        assert self.kv.block_hashes.get(child) == self.kv.block_hashes.get(parent)
        self.salt[child], self.tokens[child] = self.salt[parent], list(self.tokens[parent])
        self.tables[child] = list(self.tables[parent])
        if data.draw(st.booleans(), "write_after_fork"):  # the samples diverge: copy-on-write of a partial block
            self._make_room(data, parent, child)
            self._grow(data, data.draw(st.sampled_from((parent, child)), "writer"))

    @rule(data=st.data())
    def cache_full_blocks(self, data) -> None:
        if not self.tokens:
            return
        request_id = data.draw(st.sampled_from(sorted(self.tokens)), "request_id")
        self._cache(request_id, data.draw(st.integers(0, len(self.tokens[request_id])), "num_computed_tokens"))

    def _cache(self, request_id: str, num_computed: int) -> None:
        """cache_full_blocks, checked: the request's hashes are its chain, and what it hashed is now findable."""
        kv, pool, bs = self.kv, self.kv.pool, self.bs
        salt, tokens = self.salt[request_id], self.tokens[request_id]
        num_hashed_before = len(kv.block_hashes.get(request_id, ()))
        free_before = pool.free_block_ids()

        def token_ids(start: int, end: int) -> list[int]:
            assert 0 <= start < end <= num_computed and start % bs == 0 and end - start == bs, (start, end)
            return list(tokens[start:end])

        kv.cache_full_blocks(request_id, num_computed, token_ids, salt)

        hashes = kv.block_hashes[request_id]
        assert hashes == self._chain(salt, tokens)[: max(num_hashed_before, num_computed // bs)]
        for index in range(num_hashed_before, len(hashes)):
            block_id = self.tables[request_id][index]
            cached = pool.hash_to_block.get(hashes[index])
            assert cached is not None, f"{request_id}'s block {index} was hashed but its content is not cached"
            assert cached == block_id or pool.block_hash[block_id] is None  # cached here, or already elsewhere
            if cached != block_id:
                event("cache_full_blocks: content already cached in another block")
        assert pool.free_block_ids() == free_before

    @rule(data=st.data())
    def start_from_prefix_cache(self, data) -> None:
        """A new request takes its longest cached prefix, then fresh blocks for the rest (as the scheduler does)."""
        if not self._new_request_ids():
            return
        kv, pool, bs = self.kv, self.kv.pool, self.bs
        request_id = data.draw(st.sampled_from(self._new_request_ids()), "request_id")
        salt, tokens = self._draw_tokens(data, min_len=1)
        self._make_room(data, request_id)

        hits = kv.get_computed_blocks(tokens, salt)

        self._check_hits(salt, tokens, hits)
        event(f"start_from_prefix_cache: {min(len(hits), 2)}{'+' if len(hits) >= 2 else ''} hits")
        num_new = cdiv(len(tokens), bs) - len(hits)
        free_hits = [b for b in hits if pool.is_free(b)]
        need = num_new + len(free_hits)
        write_from = len(hits) * bs
        before, free_before = self._snapshot(), pool.free_block_ids()
        hash_before, ref_before = list(pool.block_hash), list(pool.ref_count)

        result = kv.allocate_slots(request_id, len(tokens), hits, data.draw(st.sampled_from([None, write_from])))

        if result is None:
            event("start_from_prefix_cache: not enough blocks")
            assert need > len(free_before), f"allocate_slots failed needing {need} blocks with {len(free_before)} free"
            assert self._snapshot() == before, "a failed allocate_slots changed something"
            assert kv.take_copies() == () and pool.take_evicted() == ()
            return
        assert need <= len(free_before)
        if free_hits:
            event("start_from_prefix_cache: revived freed cached blocks")
        kv.record_prefix_query(len(tokens), len(hits))
        self.num_query_tokens += len(tokens)
        self.num_hit_tokens += len(hits) * bs
        assert (kv.num_query_tokens, kv.num_hit_tokens) == (self.num_query_tokens, self.num_hit_tokens)
        allocated = [b for b in free_before if b not in hits][:num_new]
        assert result == allocated, f"new blocks {result}, expected the free queue's head {allocated} (hits {hits})"
        assert kv.take_copies() == ()
        self._check_evictions(result, hash_before, ref_before)
        assert kv.block_hashes.get(request_id, []) == self._chain(salt, tokens)[: len(hits)]
        self.salt[request_id], self.tokens[request_id] = salt, tokens
        self.tables[request_id] = hits + allocated
        self.history.append((salt, tuple(tokens)))
        self._write(request_id, write_from)
        if data.draw(st.booleans(), "cache_after"):
            self._cache(request_id, len(tokens))

    @rule(data=st.data())
    def finish(self, data) -> None:
        """A request finishes, is preempted or aborted: its table goes (the scheduler frees often too)."""
        if not self.tokens:
            return
        self.free(data.draw(st.sampled_from(sorted(self.tokens)), "request_id"))

    @rule(request_id=st.sampled_from(("*all*", "unknown", *REQUEST_IDS)))
    def free_any(self, request_id: str) -> None:
        """Free everything (so that reset_prefix_cache can succeed), an unknown id, or any id, live or not."""
        if request_id == "*all*":
            self.free_all()
        else:
            self.free(request_id)

    def free(self, request_id: str) -> None:
        """kv.free, checked: the blocks no other table holds become free, tail first; the cache keeps them."""
        pool = self.kv.pool
        held = self.tables.get(request_id, [])
        expected = [b for b in reversed(held) if pool.ref_count[b] == 1]  # tail first; shared blocks stay held
        free_before, cached_before = pool.free_block_ids(), dict(pool.hash_to_block)
        assert self.kv.free(request_id) == expected
        assert pool.free_block_ids() == free_before + expected, "freed blocks go to the tail of the free queue"
        assert pool.hash_to_block == cached_before, "freeing keeps cached blocks findable"
        for model in (self.salt, self.tokens, self.tables):
            model.pop(request_id, None)
        assert request_id not in self.kv.block_tables and request_id not in self.kv.block_hashes

    def free_all(self) -> None:
        for request_id in sorted(self.tokens):
            self.free(request_id)
        assert self.kv.num_free_blocks == self.num_blocks, "every request is freed, yet some block is not free"

    @rule(data=st.data())
    def reset_prefix_cache(self, data) -> None:
        """Refused (changing nothing) while any block is in use; otherwise forgets every cached block."""
        pool = self.kv.pool
        in_use = any(self.tables.values())
        if not in_use and pool.hash_to_block and data.draw(st.booleans(), "keep_cache"):
            return  # a reset wipes every hit: do it only now and then
        before, had_cached = self._snapshot(), bool(pool.hash_to_block)
        ok = self.kv.reset_prefix_cache()
        if in_use:
            event("reset_prefix_cache: refused")
            assert ok is False, "reset_prefix_cache succeeded while blocks are in use"
            assert self._snapshot() == before, "a refused reset_prefix_cache changed something"
            return
        event(f"reset_prefix_cache: done{'' if had_cached else ' (nothing cached)'}")
        assert ok is True, "reset_prefix_cache refused although no block is in use"
        assert not pool.hash_to_block and all(h is None for h in pool.block_hash)
        assert all(t is None for t in pool.block_tokens)
        tables, hashes, free_queue, ref_count, *_ = before
        assert self._snapshot()[:4] == (tables, hashes, free_queue, ref_count)

    # -- invariants -----------------------------------------------------------------------------------------

    @invariant()
    def agrees_with_model(self) -> None:
        kv, pool, bs = self.kv, self.kv.pool, self.bs
        kv.check_invariants()
        assert {rid: (t.block_ids, t.num_tokens) for rid, t in kv.block_tables.items()} == {
            rid: (self.tables[rid], len(self.tokens[rid])) for rid in self.tables
        }
        holders = [0] * self.num_blocks
        for request_id, block_ids in self.tables.items():
            assert len(set(block_ids)) == len(block_ids)
            for index, block_id in enumerate(block_ids):
                holders[block_id] += 1
                assert self.content.get(block_id) == self._content_of(request_id, index), (
                    f"{request_id} reads block {block_id} at {index}, which holds {self.content.get(block_id)}"
                )
        assert pool.ref_count == holders, f"ref_count {pool.ref_count}, held by {holders} tables"
        if not any(self.tables.values()):
            assert pool.num_free_blocks == self.num_blocks
        # A cached hash points at a block holding exactly the KV that hash names.
        for block_hash, block_id in pool.hash_to_block.items():
            salt, prefix = self.content[block_id]
            assert prefix and len(prefix) % bs == 0, f"cached block {block_id} is not full: {prefix}"
            assert pool.block_tokens[block_id] == prefix[-bs:]
            assert block_hash == self._chain(salt, prefix)[-1], f"cached block {block_id} has a stale hash"
        for request_id, hashes in kv.block_hashes.items():
            assert hashes == self._chain(self.salt[request_id], self.tokens[request_id])[: len(hashes)]
        # Lookups (they change nothing) for the live requests' tokens and a few earlier ones.
        queries = [(self.salt[rid], self.tokens[rid]) for rid in sorted(self.tokens)] + self.history[-4:]
        for salt, tokens in queries:
            self._check_hits(salt, tokens, kv.get_computed_blocks(tokens, salt))
        assert kv.take_copies() == () and pool.take_evicted() == ()

    def teardown(self) -> None:
        if not hasattr(self, "kv"):
            return
        self.free_all()
        self.agrees_with_model()
        assert all(count == 0 for count in self.kv.pool.ref_count)
        assert self.kv.reset_prefix_cache() is True
        assert not self.kv.pool.hash_to_block
        self.kv.check_invariants()


TestPrefixCachingMachine = PrefixCachingMachine.TestCase
TestPrefixCachingMachine.settings = machine_settings(max_examples=500, steps=50)


# -- 3. Scheduler -----------------------------------------------------------------------------------------


@st.composite
def scheduler_setups(draw, chunked: bool | st.SearchStrategy[bool], swap: bool = False):
    """A tight KV pool: max_model_len is at least half the pool, so two long requests already run it dry.
    With `swap`, preemption swaps (or, in auto mode, picks by a cost model) into a CPU pool that is often too
    small, and some steps force a preemption."""
    if not isinstance(chunked, bool):
        chunked = draw(chunked, "enable_chunked_prefill")
    block_size = draw(st.sampled_from(BLOCK_SIZES), "block_size")
    num_blocks = draw(st.integers(cdiv(2, block_size), max(1, 48 // block_size)), "num_blocks")
    capacity = num_blocks * block_size
    max_model_len = draw(st.integers(max(2, capacity // 2), capacity), "max_model_len")
    max_num_seqs = draw(st.integers(1, 8), "max_num_seqs")
    # Often smaller than the prompts. With chunked prefill that is the chunking path; without it prompts are
    # kept within the budget (as the engine does), but a recomputed request longer than a step is still chunked.
    max_num_batched_tokens = draw(
        st.integers(1, 4) | st.integers(1, max_model_len) | st.integers(max_model_len, 2 * max_model_len),
        "max_num_batched_tokens",
    )
    mode, num_cpu_blocks, force_rate = PreemptionMode.RECOMPUTE, 0, 0.0
    partial = draw(st.booleans(), "enable_partial_preemption")
    if swap:
        mode = draw(st.sampled_from([PreemptionMode.SWAP, PreemptionMode.AUTO]), "preemption_mode")
        num_cpu_blocks = draw(st.integers(0, 2 * num_blocks), "num_cpu_blocks")
        force_rate = draw(st.sampled_from([0.0, 0.1, 0.3]), "force_preemption_rate")
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        preemption_mode=mode,
        enable_partial_preemption=partial,
        force_preemption_rate=force_rate,
    )
    return config, num_blocks, block_size, num_cpu_blocks


class SchedulerMachine(RuleBasedStateMachine):
    """Drive a Scheduler with a fake model; check budgets, preemption order, finishing and liveness."""

    MAX_TEARDOWN_STEPS = 10_000  # a cap; the bound used is usually much lower (see teardown)
    PREFIX_CACHING = False

    def _setup(self, setup) -> None:
        config, num_blocks, block_size, num_cpu_blocks = setup
        self.config = config
        self.num_blocks = num_blocks
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=self.PREFIX_CACHING)
        self.swap = None
        if config.preemption_mode != PreemptionMode.RECOMPUTE:
            self.swap = SwapSpace(self.kv, num_cpu_blocks)
        # auto: with these speeds a victim is swapped when its blocks are on average more than 3/4 full
        copy_speed = 2 * 64 / (0.75 * block_size * 1e-3)
        cost_model = PreemptionCostModel(64, block_size, copy_bytes_per_s=copy_speed, prefill_tokens_per_s=1e3)
        self.scheduler = Scheduler(config, self.kv, self.swap, cost_model)
        self.cpu_slot_content: dict[int, tuple[int, ...]] = {}  # shadow of the CPU pool
        assert config.max_model_len <= num_blocks * block_size
        self.max_prompt_len = config.max_model_len - 1
        if not config.enable_chunked_prefill:  # the engine rejects longer prompts without chunked prefill
            self.max_prompt_len = min(self.max_prompt_len, config.max_num_batched_tokens)
        self.num_arrivals = 0
        self.eos_at: dict[str, int | None] = {}  # request_id -> output index at which the fake model says EOS
        self.expected_output: dict[str, list[int]] = {}
        self.finished: dict[str, RequestStatus] = {}
        self.num_preemptions_seen = 0
        self.num_steps_with_chunks = 0
        self.num_hit_tokens_seen = 0
        self.slot_content: dict[int, tuple[int, ...]] = {}  # shadow KV: slot -> the token prefix it holds

    # -- the fake model -------------------------------------------------------------------------------------

    def _next_token(self, request: Request) -> int:
        index = request.num_output_tokens
        if self.eos_at[request.request_id] == index:
            return EOS
        return 1 + (request.arrival_index * 7 + index) % 50

    @staticmethod
    def _expected_finish(token: int, num_output: int, max_tokens: int) -> RequestStatus | None:
        """What `Request.check_stop` should say (min_tokens 0, no stop ids; prompt + max_tokens <= max_model_len)."""
        if token == EOS:
            return RequestStatus.FINISHED_STOPPED
        if num_output >= max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    # -- rules ----------------------------------------------------------------------------------------------

    @rule(count=st.integers(1, 3), data=st.data())
    def add_requests(self, count: int, data) -> None:
        for _ in range(count):
            self._add_request(data)

    def _add_request(self, data) -> None:
        prompt_len = data.draw(st.integers(1, self.max_prompt_len), "prompt_len")
        max_tokens = data.draw(st.integers(1, self.config.max_model_len - prompt_len), "max_tokens")
        eos_at = data.draw(st.none() | st.integers(0, max_tokens), "eos_at")
        request_id = f"req{self.num_arrivals}"
        family = data.draw(st.integers(0, 2), "prompt_family")  # same family, same prefix: prefix-cache hits
        prompt = [1 + (family * 31 + i) % 97 for i in range(prompt_len)]
        request = Request(
            request_id,
            prompt,
            SamplingParams(temperature=0, max_tokens=max_tokens),
            self.num_arrivals,
            max_tokens,
            eos_token_ids=frozenset({EOS}),
        )
        self.num_arrivals += 1
        self.eos_at[request_id] = eos_at
        self.expected_output[request_id] = []
        self.scheduler.add_request(request)
        assert self.scheduler.waiting[-1] is request and request.status == RequestStatus.WAITING
        with pytest.raises(ValueError):
            self.scheduler.add_request(request)

    @rule(num_steps=st.integers(1, 4), abort_mid_step=st.booleans(), data=st.data())
    def step(self, num_steps: int, abort_mid_step: bool, data) -> None:
        for i in range(num_steps):
            self._step(data if abort_mid_step and i == num_steps - 1 else None)
            self.scheduler_invariants()

    @precondition(lambda self: self.scheduler.requests)
    @rule(data=st.data())
    def abort(self, data) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.scheduler.requests)), "abort_id")
        request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        assert request is not None and request.request_id == request_id
        assert request.status == RequestStatus.FINISHED_ABORTED and request.is_finished
        assert request_id not in self.kv.block_tables
        assert self.swap is None or request_id not in self.swap.block_tables
        self.finished[request_id] = RequestStatus.FINISHED_ABORTED

    @rule(data=st.data())
    def abort_unknown(self, data) -> None:
        request_id = data.draw(st.sampled_from(["unknown", *sorted(self.finished)]), "unknown_id")
        free_before = self.kv.pool.free_block_ids()
        queues_before = self._queue_ids()
        assert self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED) is None
        assert self.kv.pool.free_block_ids() == free_before
        assert self._queue_ids() == queues_before

    def _queue_ids(self) -> tuple[list[str], list[str]]:
        return [r.request_id for r in self.scheduler.waiting], [r.request_id for r in self.scheduler.running]

    # -- one step, checked ----------------------------------------------------------------------------------

    def _step(self, abort_data=None) -> None:
        scheduler, config = self.scheduler, self.config
        running_before = list(scheduler.running)
        running_ids_before = {r.request_id for r in running_before}
        computed_before = {rid: r.num_computed_tokens for rid, r in scheduler.requests.items()}
        tokens_before = {rid: r.num_tokens for rid, r in scheduler.requests.items()}
        free_before = set(self.kv.pool.free_block_ids())
        had_unfinished = scheduler.has_unfinished_requests()
        oldest = min(scheduler.requests.values(), key=lambda r: r.order, default=None)
        swapped_before = {r.request_id for r in scheduler.swapped}
        scheduler.take_freed_blocks()

        out = scheduler.schedule()

        ids = [s.request_id for s in out.scheduled]
        assert len(ids) == len(set(ids)), f"a request is scheduled twice: {ids}"
        assert out.num_batched_tokens <= config.max_num_batched_tokens
        assert len(scheduler.running) <= config.max_num_seqs
        if had_unfinished:
            assert not out.is_empty or out.preempted or out.swapped_in, "a step with unfinished requests did nothing"
            # No starvation: the oldest request runs first with the whole budget and is never the victim. With
            # swapping and forced preemptions it can be a victim, and swapped requests come back before waiting
            # ones: then only a running oldest request is sure to run (liveness is checked at teardown).
            if oldest.request_id not in out.preempted and (self.swap is None or oldest.request_id in running_ids_before):
                assert oldest.request_id in ids, f"the oldest request {oldest.request_id} was not scheduled"
        truncated = dict(out.truncated)  # partial preemption: the victim keeps running from its first blocks
        assert not truncated or config.enable_partial_preemption
        for s in out.scheduled:
            request = scheduler.requests[s.request_id]
            assert request.status == RequestStatus.RUNNING
            assert s.num_new_tokens >= 1
            assert s.num_computed_tokens == request.num_computed_tokens
            if s.request_id in truncated:
                assert s.num_computed_tokens == truncated[s.request_id]
            elif s.request_id in running_ids_before or s.request_id in swapped_before:
                assert s.num_computed_tokens == computed_before[s.request_id]
            else:  # just admitted: from scratch, or from its longest cached prefix of full blocks
                assert computed_before[s.request_id] == 0
                assert s.num_computed_tokens % self.kv.block_size == 0
                assert s.num_computed_tokens < tokens_before[s.request_id], "the last token is always computed"
                if not self.PREFIX_CACHING:
                    assert s.num_computed_tokens == 0
                self.num_hit_tokens_seen += s.num_computed_tokens
            remaining = tokens_before[s.request_id] - s.num_computed_tokens
            assert s.num_new_tokens <= remaining
            assert s.samples == (s.num_new_tokens == remaining)
            if not config.enable_chunked_prefill and remaining <= config.max_num_batched_tokens:
                assert s.num_new_tokens == remaining, "without chunked prefill, a prefill that fits is not split"
            table = self.kv.block_table(s.request_id)
            assert table.num_tokens >= s.num_computed_tokens + s.num_new_tokens
            if not s.samples:
                self.num_steps_with_chunks += 1
        for rid, blocks in out.allocated:
            assert rid in ids and set(blocks) <= set(self.kv.block_table(rid).block_ids)

        # Preemption: the victims are the most recently arrived running requests, newest first. Recomputed
        # ones go back to the front of the waiting queue with no blocks and nothing computed; swapped ones
        # keep what they computed, in a CPU table.
        if out.preempted:
            self.num_preemptions_seen += len(out.preempted)
            victims = list(dict.fromkeys(out.preempted))  # a partial victim may give up blocks more than once
            newest_first = sorted(running_before, key=lambda r: r.order, reverse=True)
            expected = [r.request_id for r in newest_first[: len(victims)]]
            assert victims == expected, f"preempted {out.preempted}, expected the newest {expected}"
            whole = [rid for rid in victims if scheduler.requests[rid].status != RequestStatus.RUNNING]
            assert len(out.preempted) - len(out.truncated) == len(whole), "a whole preemption per victim at most"
            assert set(ids) <= running_ids_before, "a step that preempted admitted a new request"
            assert not out.swapped_in, "a step that preempted swapped a request in"
            assert {r.request_id for r in scheduler.running} <= running_ids_before
            assert not (set(out.preempted) - set(truncated)) & set(ids)
            still_running = [rid for rid in victims if scheduler.requests[rid].status == RequestStatus.RUNNING]
            for rid in still_running:  # only its tail was taken
                victim, table = scheduler.requests[rid], self.kv.block_table(rid)
                assert rid in truncated and victim.num_computed_tokens <= computed_before[rid] and table.block_ids
                if rid not in ids:  # (a forced partial preemption may be followed by the victim's own turn)
                    assert victim.num_computed_tokens == truncated[rid] == table.num_tokens
                    assert table.num_tokens % self.kv.block_size == 0
            recomputed = [rid for rid in victims if scheduler.requests[rid].status == RequestStatus.WAITING]
            if self.swap is None:  # with swapping, a swapped-in request may be younger than one waiting
                front = [r.request_id for r in list(scheduler.waiting)[: len(recomputed)]]
                assert front == list(reversed(recomputed)), "recomputed requests go to the front of waiting"
            swapped_out = [rid for rid, _ in out.swapped_out]
            assert sorted(swapped_out) == sorted(set(victims) - set(recomputed) - set(still_running))
            for rid in set(victims) - set(still_running):
                victim = scheduler.requests[rid]
                assert rid not in self.kv.block_tables
                assert victim.num_preemptions >= 1
                if rid in recomputed:
                    assert victim.num_computed_tokens == 0
                else:
                    assert victim.status == RequestStatus.SWAPPED
                    assert victim.num_computed_tokens == truncated.get(rid, computed_before[rid])
                    assert self.swap.block_tables[rid].num_tokens == victim.num_computed_tokens
        else:
            assert not out.swapped_out
        if scheduler.swapped or swapped_before - {rid for rid, _ in out.swapped_in}:
            assert set(ids) <= running_ids_before | swapped_before, "admitted while requests were swapped out"
        for rid, _ in out.swapped_in:
            assert rid in swapped_before and scheduler.requests[rid].status == RequestStatus.RUNNING

        # Blocks reported freed: whatever became free was reported, and what was reported is free or reused.
        freed = set(scheduler.take_freed_blocks())
        free_now = set(self.kv.pool.free_block_ids())
        reallocated = {b for _, blocks in out.allocated for b in blocks}
        reallocated |= {device for _, pairs in out.swapped_in for _, device in pairs}
        assert free_now <= free_before | freed
        assert freed <= free_now | reallocated

        aborted = None
        if abort_data is not None and ids:
            aborted = abort_data.draw(st.sampled_from(ids), "abort_mid_step")
            scheduler.finish_request(aborted, RequestStatus.FINISHED_ABORTED)
            self.finished[aborted] = RequestStatus.FINISHED_ABORTED

        self._run_shadow_model(out, aborted)

        sampled = {}
        for s in out.scheduled:
            if s.samples and s.request_id != aborted:
                sampled[s.request_id] = self._next_token(scheduler.requests[s.request_id])
        live = {rid: scheduler.requests[rid] for rid in ids if rid != aborted}

        update = scheduler.update_from_output(out, sampled)

        assert dict(update.appended) == sampled
        finished_ids = {r.request_id for r in update.finished}
        for s in out.scheduled:
            if s.request_id == aborted:
                continue
            request = live[s.request_id]
            if s.samples:
                self.expected_output[s.request_id].append(sampled[s.request_id])
                want = self._expected_finish(
                    sampled[s.request_id], len(self.expected_output[s.request_id]), request.max_tokens
                )
                assert request.status == (want or RequestStatus.RUNNING), (
                    f"{s.request_id}: status {request.status}, expected {want}"
                )
                assert (want is not None) == (s.request_id in finished_ids)
                if want is not None:
                    self.finished[s.request_id] = want
                    assert s.request_id not in self.kv.block_tables
            assert request.output_token_ids == self.expected_output[s.request_id]
            if not request.is_finished:
                assert request.num_computed_tokens == s.num_computed_tokens + s.num_new_tokens
                assert request.num_computed_tokens < request.num_tokens
        self._check_bookkeeping()

    def _check_bookkeeping(self) -> None:
        """Every request ever added is unfinished in the scheduler or recorded as finished, never both."""
        live, done = set(self.scheduler.requests), set(self.finished)
        assert not live & done and live | done == set(self.eos_at)

    def _run_shadow_model(self, out, aborted: str | None) -> None:
        """What the model runner would do: swap blocks out, then in (in the engine's order), then read the KV of
        tokens [0, start), write that of [start, start + new)."""
        size = self.kv.block_size
        for source_content, target_content, moves in (
            (self.slot_content, self.cpu_slot_content, out.swapped_out),
            (self.cpu_slot_content, self.slot_content, out.swapped_in),
        ):
            for _, pairs in moves:
                for source, target in pairs:
                    for offset in range(size):
                        content = source_content.get(source * size + offset)
                        target_content[target * size + offset] = content
        for s in out.scheduled:
            if s.request_id == aborted:
                continue
            request = self.scheduler.requests[s.request_id]
            table = self.kv.block_table(s.request_id)
            tokens = tuple(request.token_ids(0, request.num_tokens))
            for position in range(s.num_computed_tokens):
                assert self.slot_content.get(table.slot(position)) == tokens[: position + 1], (
                    f"{s.request_id} reads position {position} from slot {table.slot(position)}, which holds the KV "
                    "of other tokens"
                )
            for position in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens):
                self.slot_content[table.slot(position)] = tokens[: position + 1]

    # -- invariants and liveness ----------------------------------------------------------------------------

    @invariant()
    def scheduler_invariants(self) -> None:
        scheduler = self.scheduler
        scheduler.check_invariants()  # the block manager's too
        # FCFS admission plus "victims go to the front" keep the waiting queue in arrival order.
        waiting_orders = [r.order for r in scheduler.waiting]
        assert waiting_orders == sorted(waiting_orders), "waiting is not in arrival order"
        for request in scheduler.requests.values():
            assert not request.is_finished
            assert request.num_tokens <= self.config.max_model_len
            assert request.output_token_ids == self.expected_output[request.request_id]
        for request in scheduler.running:
            table = self.kv.block_table(request.request_id)
            assert len(table.block_ids) == cdiv(table.num_tokens, self.kv.block_size)
        assert self.kv.num_free_blocks + self.kv.pool.num_used_blocks == self.num_blocks

    def teardown(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        self.scheduler.config = dataclasses.replace(self.scheduler.config, force_preemption_rate=0.0)
        # Liveness. The oldest unfinished request is scheduled every step and needs at most max_model_len
        # tokens, one step each at worst, so the requests finish one by one within this many steps. A tight
        # bound keeps a livelocking regression from making shrinking crawl.
        max_steps = min(self.MAX_TEARDOWN_STEPS, len(self.scheduler.requests) * (self.config.max_model_len + 1))
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                break
            self._step()
            self.scheduler_invariants()
        assert not self.scheduler.has_unfinished_requests(), (
            f"not finished after {max_steps} steps: {list(self.scheduler.requests.values())}"
        )
        self._check_bookkeeping()
        assert self.kv.num_free_blocks == self.num_blocks
        assert not self.kv.block_tables
        assert not self.scheduler.requests
        if self.swap is not None:
            assert not self.swap.block_tables and self.swap.pool.num_used_blocks == 0, "CPU blocks leaked"


class SchedulerMachineNoChunking(SchedulerMachine):
    @initialize(setup=scheduler_setups(chunked=False))
    def setup(self, setup) -> None:
        self._setup(setup)


class SchedulerMachineChunked(SchedulerMachine):
    @initialize(setup=scheduler_setups(chunked=True))
    def setup(self, setup) -> None:
        self._setup(setup)


class SchedulerMachinePrefixCaching(SchedulerMachine):
    """Same rules and checks with prefix caching on: admitted requests may start from cached blocks."""

    PREFIX_CACHING = True

    @initialize(setup=scheduler_setups(chunked=st.booleans()))
    def setup(self, setup) -> None:
        self._setup(setup)


class SchedulerMachineSwap(SchedulerMachine):
    """Preemption by swap (or auto) into a small CPU pool, forced preemptions, chunked prefill on or off."""

    @initialize(setup=scheduler_setups(chunked=st.booleans(), swap=True))
    def setup(self, setup) -> None:
        self._setup(setup)


class SchedulerMachineSwapPrefixCaching(SchedulerMachineSwap):
    """Swapping with prefix caching: swapped-in requests rehash their blocks; hits and swaps interleave."""

    PREFIX_CACHING = True


TestSchedulerMachineNoChunking = SchedulerMachineNoChunking.TestCase
TestSchedulerMachineNoChunking.settings = machine_settings(max_examples=200, steps=50)
TestSchedulerMachineChunked = SchedulerMachineChunked.TestCase
TestSchedulerMachineChunked.settings = machine_settings(max_examples=200, steps=50)
TestSchedulerMachinePrefixCaching = SchedulerMachinePrefixCaching.TestCase
TestSchedulerMachinePrefixCaching.settings = machine_settings(max_examples=200, steps=50)
TestSchedulerMachineSwap = SchedulerMachineSwap.TestCase
TestSchedulerMachineSwap.settings = machine_settings(max_examples=300, steps=50)
TestSchedulerMachineSwapPrefixCaching = SchedulerMachineSwapPrefixCaching.TestCase
TestSchedulerMachineSwapPrefixCaching.settings = machine_settings(max_examples=200, steps=50)


# -- 4. Plain unit tests ----------------------------------------------------------------------------------


def test_block_pool_allocates_from_head_and_frees_to_tail():
    pool = BlockPool(5)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.free_block_ids() == [3, 4]
    assert pool.free([1, 0]) == [1, 0]
    assert pool.free_block_ids() == [3, 4, 1, 0]  # freed longest ago is reused first
    assert pool.allocate(3) == [3, 4, 1]
    assert pool.free_block_ids() == [0]
    assert pool.num_free_blocks == 1 and pool.num_used_blocks == 4
    pool.check_invariants()


def test_block_pool_refuses_more_than_free():
    pool = BlockPool(2)
    pool.allocate(1)
    with pytest.raises(NotEnoughBlocksError):
        pool.allocate(2)
    assert pool.free_block_ids() == [1]
    pool.check_invariants()


def test_block_pool_double_free_asserts():
    pool = BlockPool(3)
    [block_id] = pool.allocate(1)
    assert pool.free([block_id]) == [block_id]
    with pytest.raises(AssertionError, match="double free"):
        pool.free([block_id])
    pool.check_invariants()


def test_block_pool_shared_block_is_freed_by_its_last_holder():
    pool = BlockPool(2)
    [block_id] = pool.allocate(1)
    pool.share([block_id])
    assert pool.free([block_id]) == []
    assert not pool.is_free(block_id)
    assert pool.free([block_id]) == [block_id]
    assert pool.is_free(block_id)
    pool.check_invariants()


@pytest.mark.parametrize("block_size", [0, 3, 6, 512])
def test_kv_cache_manager_rejects_bad_block_size(block_size):
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(8, block_size)


def test_block_table_slots_by_hand():
    table = BlockTable(block_size=4, block_ids=[7, 1], num_tokens=6)
    assert table.slot(5) == 1 * 4 + 1
    assert [table.slot(i) for i in range(6)] == [28, 29, 30, 31, 4, 5]
    assert table.num_filled_in_last_block == 2
    assert BlockTable(block_size=4).num_filled_in_last_block == 0


def test_allocate_slots_grows_by_blocks_and_frees_tail_first():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert kv.allocate_slots("a", 5) == [0, 1]
    assert kv.allocate_slots("a", 8) == []  # still fits in two blocks
    assert kv.allocate_slots("a", 9) == [2]
    assert kv.allocate_slots("b", 8) is None  # needs 2, 1 free: nothing changes
    assert "b" not in kv.block_tables and kv.num_free_blocks == 1
    assert kv.free("a") == [2, 1, 0]
    assert kv.pool.free_block_ids() == [3, 2, 1, 0]
    kv.check_invariants()


def test_failed_allocate_slots_keeps_an_empty_table():
    """Regression: a failed call changes nothing, even for a table that holds no block yet."""
    kv = KVCacheManager(num_blocks=1, block_size=4)
    assert kv.allocate_slots("a", 0) == []  # a table with no blocks yet
    assert kv.allocate_slots("b", 4) == [0]  # the pool is now full
    assert kv.allocate_slots("a", 4) is None
    assert kv.block_table("a").block_ids == [] and kv.block_table("a").num_tokens == 0
    kv.check_invariants()
