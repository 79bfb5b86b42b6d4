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

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pagedlab.core.block_hash import hash_block, root_hash
from pagedlab.core.block_pool import BlockPool, NotEnoughBlocksError
from pagedlab.core.kv_cache_manager import BlockTable, KVCacheManager, cdiv

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
        self.kv_cache_manager = KVCacheManager(num_blocks, block_size)
        self.model_tokens: dict[str, int] = {}
        self.model_free: list[int] = list(range(num_blocks))  # head (next to be allocated) first
        self.num_failed = 0

    def _snapshot(self):
        tables = {rid: (tuple(t.block_ids), t.num_tokens) for rid, t in self.kv_cache_manager.block_tables.items()}
        return tables, self.kv_cache_manager.pool.free_block_ids(), list(self.kv_cache_manager.pool.ref_count)

    @rule(data=st.data(), request_id=st.sampled_from(REQUEST_IDS))
    def allocate_slots(self, data, request_id: str) -> None:
        # Up to a little more than the whole pool, so that both success and failure are common.
        num_tokens = data.draw(st.integers(0, self.num_blocks * self.block_size + self.block_size), "num_tokens")
        before = self._snapshot()
        tables = self.kv_cache_manager.block_tables
        old_blocks = list(tables[request_id].block_ids) if request_id in tables else []
        needed = cdiv(num_tokens, self.block_size) - len(old_blocks)

        allocation = self.kv_cache_manager.allocate_slots(request_id, num_tokens)

        if allocation is None:
            self.num_failed += 1
            assert needed > len(self.model_free), "allocate_slots failed although enough blocks were free"
            assert self._snapshot() == before, "a failed allocate_slots changed something"
            return
        assert allocation.copy is None and allocation.evicted == (), "no sharing and no cache: no copy, no eviction"
        new_blocks = list(allocation.new_block_ids)
        assert needed <= len(self.model_free)
        expected_new = self.model_free[: max(needed, 0)]
        assert new_blocks == expected_new, "new blocks must come from the head of the free queue, in order"
        del self.model_free[: len(expected_new)]
        self.model_tokens[request_id] = max(self.model_tokens.get(request_id, 0), num_tokens)
        table = self.kv_cache_manager.block_table(request_id)
        assert table.block_ids == old_blocks + new_blocks, "existing blocks must keep their logical position"

    @rule(request_id=st.sampled_from(REQUEST_IDS))
    def free(self, request_id: str) -> None:
        table = self.kv_cache_manager.block_tables.get(request_id)
        expected = list(reversed(table.block_ids)) if table is not None else []
        freed = self.kv_cache_manager.free(request_id)
        assert freed == expected, "free releases the table tail first, and every block (ref_count 1) becomes free"
        self.model_free.extend(expected)
        self.model_tokens.pop(request_id, None)
        assert request_id not in self.kv_cache_manager.block_tables

    @rule(request_id=st.sampled_from(("unknown", "r", "")))
    def free_unknown(self, request_id: str) -> None:
        before = self._snapshot()
        assert self.kv_cache_manager.free(request_id) == []
        assert self._snapshot() == before

    @invariant()
    def agrees_with_model(self) -> None:
        kv = self.kv_cache_manager
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
        assert kv.num_free_blocks == self.num_blocks - len(seen), "free blocks and held blocks do not add up"
        assert kv.pool.num_used_blocks == len(seen)

    def teardown(self) -> None:
        if not hasattr(self, "kv"):
            return
        for request_id in list(self.kv_cache_manager.block_tables):
            self.kv_cache_manager.free(request_id)
        self.kv_cache_manager.check_invariants()
        assert self.kv_cache_manager.num_free_blocks == self.num_blocks
        assert not self.kv_cache_manager.block_tables
        assert all(count == 0 for count in self.kv_cache_manager.pool.ref_count)


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
        self.kv_cache_manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
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
        kv, pool = self.kv_cache_manager, self.kv_cache_manager.pool
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
        pool, table = self.kv_cache_manager.pool, self.kv_cache_manager.block_table(request_id)
        for index in range(write_from // self.bs, cdiv(len(self.tokens[request_id]), self.bs)):
            block_id = table.block_ids[index]
            holders = pool.ref_count[block_id]
            assert holders == 1, f"{request_id} writes block {block_id}, which {holders} tables hold (no copy-on-write)"
            assert pool.block_hash[block_id] is None, f"{request_id} writes block {block_id}, a prefix-cache block"
            self.content[block_id] = self._content_of(request_id, index)

    def _check_evictions(self, allocation, hash_before: list, ref_before: list[int]) -> None:
        evicted, allocated = allocation.evicted, allocation.new_block_ids
        assert evicted == tuple(b for b in allocated if hash_before[b] is not None), (
            f"evicted {evicted}: the cached blocks among those handed out ({allocated}) are the ones evicted"
        )
        for block_id in evicted:
            assert ref_before[block_id] == 0, f"block {block_id} was evicted while {ref_before[block_id]} held it"
            assert block_id not in self.kv_cache_manager.pool.hash_to_block.values()
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
            for block_id in self.kv_cache_manager.pool.hash_to_block.values():
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
        if self.kv_cache_manager.num_free_blocks == 0 and others and data.draw(st.booleans(), "make_room"):
            self.free(data.draw(st.sampled_from(others), "preempt"))

    def _grow(self, data, request_id: str) -> None:
        """allocate_slots for `request_id`, checked against the model, then the writes (see `_write`)."""
        kv, pool, bs = self.kv_cache_manager, self.kv_cache_manager.pool, self.bs
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
            return
        assert need <= len(free_before), f"allocate_slots succeeded needing {need} blocks with {len(free_before)} free"
        allocated = free_before[:need]
        assert list(result.new_block_ids) == allocated, (
            f"new blocks {result}, expected the free queue's head {allocated}"
        )
        if cow_index is not None:
            event("allocate: copy-on-write")
            source, copy = held[cow_index], allocated[-1]
            assert result.copy == (source, copy), f"copy {result.copy}, expected {source} -> {copy}"
            assert not pool.is_free(source), "the source of a pending copy is held until the copy is made"
            self.content[copy] = self.content[source]  # the engine copies the block's KV before the write
            kv.release_copy_sources([result.copy])
            held[cow_index] = copy
            allocated = allocated[:-1]
        else:
            assert result.copy is None, f"unexpected copy {result.copy}"
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
        pool = self.kv_cache_manager.pool
        free_before, cached_before = pool.free_block_ids(), dict(pool.hash_to_block)
        self.kv_cache_manager.fork(parent, child)
        event("fork")
        assert pool.free_block_ids() == free_before and pool.hash_to_block == cached_before
        assert self.kv_cache_manager.block_hashes.get(child) == self.kv_cache_manager.block_hashes.get(parent)
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
        kv, pool, bs = self.kv_cache_manager, self.kv_cache_manager.pool, self.bs
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
        kv, pool, bs = self.kv_cache_manager, self.kv_cache_manager.pool, self.bs
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
            return
        assert need <= len(free_before)
        if free_hits:
            event("start_from_prefix_cache: revived freed cached blocks")
        kv.record_prefix_query(len(tokens), len(hits))
        self.num_query_tokens += len(tokens)
        self.num_hit_tokens += len(hits) * bs
        assert (kv.num_query_tokens, kv.num_hit_tokens) == (self.num_query_tokens, self.num_hit_tokens)
        allocated = [b for b in free_before if b not in hits][:num_new]
        assert list(result.new_block_ids) == allocated, (
            f"new blocks {result}, expected the free queue's head {allocated} (hits {hits})"
        )
        assert result.copy is None
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
        pool = self.kv_cache_manager.pool
        held = self.tables.get(request_id, [])
        expected = [b for b in reversed(held) if pool.ref_count[b] == 1]  # tail first; shared blocks stay held
        free_before, cached_before = pool.free_block_ids(), dict(pool.hash_to_block)
        assert self.kv_cache_manager.free(request_id) == expected
        assert pool.free_block_ids() == free_before + expected, "freed blocks go to the tail of the free queue"
        assert pool.hash_to_block == cached_before, "freeing keeps cached blocks findable"
        for model in (self.salt, self.tokens, self.tables):
            model.pop(request_id, None)
        kv_cache_manager = self.kv_cache_manager
        assert request_id not in kv_cache_manager.block_tables and request_id not in kv_cache_manager.block_hashes

    def free_all(self) -> None:
        for request_id in sorted(self.tokens):
            self.free(request_id)
        assert self.kv_cache_manager.num_free_blocks == self.num_blocks, (
            "every request is freed, yet some block is not free"
        )

    @rule(data=st.data())
    def reset_prefix_cache(self, data) -> None:
        """Refused (changing nothing) while any block is in use; otherwise forgets every cached block."""
        pool = self.kv_cache_manager.pool
        in_use = any(self.tables.values())
        if not in_use and pool.hash_to_block and data.draw(st.booleans(), "keep_cache"):
            return  # a reset wipes every hit: do it only now and then
        before, had_cached = self._snapshot(), bool(pool.hash_to_block)
        ok = self.kv_cache_manager.reset_prefix_cache()
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
        kv, pool, bs = self.kv_cache_manager, self.kv_cache_manager.pool, self.bs
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
        assert not kv.pending_copy_sources, "every copy was made and its source let go"

    def teardown(self) -> None:
        if not hasattr(self, "kv"):
            return
        self.free_all()
        self.agrees_with_model()
        assert all(count == 0 for count in self.kv_cache_manager.pool.ref_count)
        assert self.kv_cache_manager.reset_prefix_cache() is True
        assert not self.kv_cache_manager.pool.hash_to_block
        self.kv_cache_manager.check_invariants()


TestPrefixCachingMachine = PrefixCachingMachine.TestCase
TestPrefixCachingMachine.settings = machine_settings(max_examples=500, steps=50)


# -- 3. Plain unit tests ----------------------------------------------------------------------------------


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
    assert kv.allocate_slots("a", 5).new_block_ids == (0, 1)
    assert kv.allocate_slots("a", 8).new_block_ids == ()  # still fits in two blocks
    assert kv.allocate_slots("a", 9).new_block_ids == (2,)
    assert kv.allocate_slots("b", 8) is None  # needs 2, 1 free: nothing changes
    assert "b" not in kv.block_tables and kv.num_free_blocks == 1
    assert kv.free("a") == [2, 1, 0]
    assert kv.pool.free_block_ids() == [3, 2, 1, 0]
    kv.check_invariants()


def test_failed_allocate_slots_keeps_an_empty_table():
    """Regression: a failed call changes nothing, even for a table that holds no block yet."""
    kv = KVCacheManager(num_blocks=1, block_size=4)
    assert kv.allocate_slots("a", 0).new_block_ids == ()  # a table with no blocks yet
    assert kv.allocate_slots("b", 4).new_block_ids == (0,)  # the pool is now full
    assert kv.allocate_slots("a", 4) is None
    assert kv.block_table("a").block_ids == [] and kv.block_table("a").num_tokens == 0
    kv.check_invariants()
