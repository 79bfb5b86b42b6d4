"""Block tables: each sequence's map from logical blocks to physical blocks in the shared pool.

The manager grows a sequence's block table on demand, one block whenever its tokens spill past the last
block, and frees the whole table when the sequence finishes, is preempted or is aborted. Nothing is reserved
ahead of need: a sequence holds ceil(num_tokens / block_size) blocks, so only its last block can have empty
slots. Forked sequences share blocks (copy-on-write on the partially filled last block). With prefix caching
on, a new sequence first takes the longest run of cached full blocks that match its tokens, and every block
it fills is hashed for those who come after.

# Explained in chapters/02_paged_blocks.ipynb and chapters/04_copy_on_write.ipynb
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagedlab.core.block_hash import BlockHash, hash_block, root_hash
from pagedlab.core.block_pool import BlockPool
from pagedlab.core.block_table import BlockTable, cdiv
from pagedlab.core.stats import KVCacheStats

__all__ = ["Allocation", "BlockTable", "KVCacheManager", "Rollback", "cdiv"]


@dataclass(frozen=True)
class Allocation:
    """What one `allocate_slots` call did to a table."""

    new_block_ids: tuple[int, ...]  # blocks added to the table this call (a copy-on-write copy included)
    copy: tuple[int, int] | None = None  # copy-on-write: (shared source block, its private copy) to fill
    evicted: tuple[int, ...] = ()  # cached blocks whose content was dropped to hand them out


@dataclass(frozen=True)
class Rollback:
    """What one `rollback` call gave back: the token slots past the table's new end, and the whole blocks
    among them that became free."""

    request_id: str
    slots: tuple[int, ...]  # flat slots (block_id * block_size + offset) of the positions given back, in order
    freed: tuple[int, ...]  # blocks that became free


class KVCacheManager:
    """Allocates and frees the block tables of all sequences over one `BlockPool`.

    A copy-on-write copy is made by the worker before the step's forward pass, so until then its source block
    is held by the pending copy as well: it cannot be freed and handed out again (and overwritten) in the
    same step. `release_copy_sources` lets go of it once the step has run.

    Invariants:
      - each block's ref_count equals the number of block tables that hold it plus the pending copies that
        read it;
      - a table holds exactly cdiv(num_tokens, block_size) blocks;
      - with prefix caching, a sequence's known block hashes cover only full blocks, and each is the hash its
        block carries in the pool, unless that content was already cached in another block.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        if block_size < 1 or block_size & (block_size - 1) or block_size > 256:
            raise ValueError(f"block_size must be a power of two from 1 to 256, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, BlockTable] = {}
        self.block_hashes: dict[str, list[BlockHash]] = {}  # hashes of each sequence's full blocks so far
        self.pending_copy_sources: Counter[int] = Counter()  # blocks read by copies not yet made
        self.num_query_tokens = 0  # prefix-cache metrics, in tokens
        self.num_hit_tokens = 0
        self.num_cow_copies = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def block_table(self, request_id: str) -> BlockTable:
        return self.block_tables[request_id]

    # -- prefix caching -----------------------------------------------------------------------------------

    def get_computed_blocks(
        self, token_ids: Sequence[int], cache_salt: str | None = None, known_hashes: Sequence[BlockHash] = ()
    ) -> list[int]:
        """The longest run of cached full blocks holding a prefix of `token_ids`. `known_hashes`: the hashes of its
        first blocks, computed once when the request arrived (`hash_prompt`); later blocks are hashed here.

        The last token is always left to compute (its logits are needed), so at most
        (len(token_ids) - 1) // block_size blocks can hit. Nothing is taken yet: see `allocate_slots`.
        """
        if not self.enable_prefix_caching:
            return []
        size = self.block_size
        hits: list[int] = []
        parent = root_hash(cache_salt)
        for i in range((len(token_ids) - 1) // size):
            tokens = token_ids[i * size : (i + 1) * size]
            parent = known_hashes[i] if i < len(known_hashes) else hash_block(parent, tokens)
            block_id = self.pool.lookup(parent, tokens)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def hash_prompt(self, token_ids: Sequence[int], cache_salt: str | None = None) -> tuple[BlockHash, ...]:
        """The hashes of a prompt's full blocks (none without prefix caching): a request keeps them from arrival."""
        if not self.enable_prefix_caching:
            return ()
        size, parent, hashes = self.block_size, root_hash(cache_salt), []
        for i in range(len(token_ids) // size):
            parent = hash_block(parent, token_ids[i * size : (i + 1) * size])
            hashes.append(parent)
        return tuple(hashes)

    def stats(self) -> KVCacheStats:
        return KVCacheStats(self.pool.num_blocks, self.pool.num_used_blocks, self.block_size, self.num_query_tokens,
                            self.num_hit_tokens, self.pool.num_evicted_blocks)

    def record_prefix_query(self, num_tokens: int, num_hit_blocks: int) -> None:
        """Count an admitted sequence's lookup in the hit-rate metrics (a blocked one may look again)."""
        if self.enable_prefix_caching:
            self.num_query_tokens += num_tokens
            self.num_hit_tokens += num_hit_blocks * self.block_size

    def cache_full_blocks(
        self, request_id: str, num_computed_tokens: int, token_ids: Callable[[int, int], list[int]],
        cache_salt: str | None = None, known_hashes: Sequence[BlockHash] = (),
    ) -> None:
        """Hash the sequence's blocks that `num_computed_tokens` has filled, so that later requests hit them.
        `known_hashes`: its prompt's, computed on arrival (`hash_prompt`), are taken as they are."""
        if not self.enable_prefix_caching:
            return
        size = self.block_size
        hashes = self.block_hashes.setdefault(request_id, [])
        table = self.block_tables[request_id]
        parent = hashes[-1] if hashes else root_hash(cache_salt)
        for i in range(len(hashes), num_computed_tokens // size):
            tokens = token_ids(i * size, (i + 1) * size)
            parent = known_hashes[i] if i < len(known_hashes) else hash_block(parent, tokens)
            hashes.append(parent)
            block_id = table.block_ids[i]
            if self.pool.block_hash[block_id] is None:
                self.pool.cache(block_id, parent, tokens)  # False: the same content is cached elsewhere

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    # -- growing tables -------------------------------------------------------------------------------------

    def allocate_slots(
        self, request_id: str, num_tokens: int, computed_blocks: Sequence[int] = (), write_from: int | None = None
    ) -> Allocation | None:
        """Make the sequence's table cover `num_tokens` token slots in all, starting with `computed_blocks`
        (prefix-cache hits, for a sequence that holds no table yet), ready for writes from `write_from` on.

        Copy-on-write: if the block that holds position `write_from` is shared (ref_count > 1, after a
        fork), the sequence gets a private copy of it first. Only a partially filled last block can be
        shared and written; full shared blocks are never copied.

            before:  seq A [7, 1]  seq B [7, 1]    block 1 shared, 2/4 filled, B writes slot 3
            after:   seq A [7, 1]  seq B [7, 3]    block 3 = copy of 1 (pending copy 1 -> 3)

        Returns what was done, or None, changing nothing, when too few blocks are free.
        """
        table = self.block_tables.get(request_id)
        num_new_blocks, shared_index = self._growth(request_id, num_tokens, computed_blocks, write_from)
        num_copies = shared_index is not None
        num_free_hits = sum(1 for b in computed_blocks if self.pool.is_free(b))  # taking them uses free room
        if num_new_blocks + num_copies + num_free_hits > self.pool.num_free_blocks:
            return None
        if table is None:
            table = self.block_tables[request_id] = BlockTable(self.block_size)
        if computed_blocks:
            assert not table.block_ids, "prefix-cache hits only start a table"
            self.pool.touch(computed_blocks)
            table.block_ids.extend(computed_blocks)
            self.block_hashes[request_id] = [self.pool.block_hash[b] for b in computed_blocks]
        evicted: list[int] = []
        new_block_ids = self.pool.allocate(num_new_blocks + num_copies, evicted)
        copy = None
        if shared_index is not None:
            source, target = table.block_ids[shared_index], new_block_ids.pop()
            table.block_ids[shared_index] = target
            self.pending_copy_sources[source] += 1  # the table's hold on the source passes to the copy
            self.num_cow_copies += 1
            copy = (source, target)
        table.block_ids.extend(new_block_ids)
        table.num_tokens = max(table.num_tokens, num_tokens)
        if copy is not None:
            new_block_ids.append(copy[1])
        return Allocation(tuple(new_block_ids), copy, tuple(evicted))

    def _growth(
        self, request_id: str, num_tokens: int, computed_blocks: Sequence[int] = (), write_from: int | None = None
    ) -> tuple[int, int | None]:
        """What `allocate_slots` needs: the number of new blocks, and the index of a shared block to copy."""
        table = self.block_tables.get(request_id)
        num_held = len(table.block_ids) if table is not None else 0
        num_new_blocks = max(self.num_blocks_for(num_tokens) - num_held - len(computed_blocks), 0)
        shared_index = None
        if table is not None and write_from is not None and write_from // self.block_size < num_held:
            index = write_from // self.block_size
            if self._num_table_holders(table.block_ids[index]) > 1:
                shared_index = index
        return num_new_blocks, shared_index

    def _num_table_holders(self, block_id: int) -> int:
        """Tables holding the block (a pending copy only reads it before the step's writes)."""
        return self.pool.ref_count[block_id] - self.pending_copy_sources[block_id]

    def num_blocks_needed(self, growths: Sequence[tuple[str, int, int]]) -> int:
        """Free blocks that `allocate_slots(request_id, num_tokens, write_from=...)` for each of `growths`, in
        order, would take: new blocks, plus a copy for each write into a block another table still shares (the
        last writer of a shared block writes in place)."""
        holders: dict[int, int] = {}
        total = 0
        for request_id, num_tokens, write_from in growths:
            num_new_blocks, shared_index = self._growth(request_id, num_tokens, (), write_from)
            total += num_new_blocks
            if shared_index is not None:
                block_id = self.block_tables[request_id].block_ids[shared_index]
                count = holders.get(block_id, self._num_table_holders(block_id))
                if count > 1:
                    total += 1
                holders[block_id] = count - 1
        return total

    def release_copy_sources(self, copies: Sequence[tuple[int, int]]) -> list[int]:
        """The step's copies have been made: let go of their sources. Returns the blocks that became free."""
        freed = []
        for source, _ in copies:
            self.pending_copy_sources[source] -= 1
            if not self.pending_copy_sources[source]:
                del self.pending_copy_sources[source]
            freed += self.pool.free([source])
        return freed

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give `child_id` a table sharing every block of the parent's (each block gets one holder more)."""
        parent = self.block_tables[parent_id]
        assert child_id not in self.block_tables
        self.block_tables[child_id] = BlockTable(self.block_size, list(parent.block_ids), parent.num_tokens)
        self.pool.share(parent.block_ids)
        if parent_id in self.block_hashes:
            self.block_hashes[child_id] = list(self.block_hashes[parent_id])

    # -- giving blocks back ---------------------------------------------------------------------------------

    def num_tail_blocks_to_release(self, request_id: str, num_blocks: int) -> int | None:
        """How many of the sequence's last blocks it must give up so that `num_blocks` blocks become free
        (blocks it shares with others free nothing), keeping at least its first block; None if it cannot."""
        block_ids = self.block_tables[request_id].block_ids
        freed = 0
        for count, block_id in enumerate(reversed(block_ids[1:]), start=1):
            freed += self.pool.ref_count[block_id] == 1
            if freed >= num_blocks:
                return count
        return None

    def truncate(self, request_id: str, num_blocks: int) -> list[int]:
        """Shrink the sequence's table to its first `num_blocks` blocks, all full (partial preemption);
        return the blocks that became free. Released last first, like `free`."""
        table = self.block_tables[request_id]
        assert 0 < num_blocks <= len(table.block_ids)
        released = table.block_ids[num_blocks:]
        del table.block_ids[num_blocks:]
        table.num_tokens = min(table.num_tokens, num_blocks * self.block_size)
        if request_id in self.block_hashes:
            del self.block_hashes[request_id][num_blocks:]
        return self.pool.free(reversed(released))

    def rollback(self, request_id: str, num_tokens: int) -> Rollback:
        """Shrink the sequence's table to its first `num_tokens` token slots (speculative decoding: the slots of
        the proposed tokens that verification rejected). Whole blocks past the new end are released (last first,
        like `free`); the new last block keeps its place and its fill count drops, so its empty slots are
        written again by the next tokens. Block size 4, 10 slots in use, 3 proposed tokens rejected:

            before:  [7, 1, 12]   10 slots: 7 committed + 3 rejected (positions 7, 8, 9)
            after:   [7, 1]        7 slots: block 12 freed, block 1 filled 3/4 again (its slot 3 is empty)

        The slots given back were written in this step only, so none of them is in a block with a cached hash
        (hashes cover full blocks of committed tokens only)."""
        table = self.block_tables[request_id]
        if not 0 <= num_tokens <= table.num_tokens:
            raise ValueError(f"{request_id}: cannot roll back to {num_tokens} of {table.num_tokens} slots")
        size = self.block_size
        slots = tuple(table.slot(p) for p in range(num_tokens, table.num_tokens))
        num_kept = self.num_blocks_for(num_tokens)
        if num_tokens % size:
            assert self.pool.block_hash[table.block_ids[num_kept - 1]] is None, "rolled back into a cached block"
        released = table.block_ids[num_kept:]
        del table.block_ids[num_kept:]
        table.num_tokens = num_tokens
        if request_id in self.block_hashes:
            del self.block_hashes[request_id][num_tokens // size :]
        return Rollback(request_id, slots, tuple(self.pool.free(reversed(released))))

    def free(self, request_id: str) -> list[int]:
        """Release the sequence's table; return the blocks that became free. Unknown ids free nothing.

        Blocks are released tail first, so that the free queue hands out a sequence's head blocks last
        (what prefix caching wants: a sequence's first blocks are the ones others are likeliest to share).
        """
        self.block_hashes.pop(request_id, None)
        table = self.block_tables.pop(request_id, None)
        if table is None:
            return []
        return self.pool.free(reversed(table.block_ids))

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        holders = Counter(self.pending_copy_sources)
        for request_id, table in self.block_tables.items():
            assert len(table.block_ids) == self.num_blocks_for(table.num_tokens), (
                f"{request_id}: {len(table.block_ids)} blocks for {table.num_tokens} tokens"
            )
            holders.update(table.block_ids)
        for block_id in range(self.pool.num_blocks):
            assert self.pool.ref_count[block_id] == holders[block_id], (
                f"block {block_id}: ref_count {self.pool.ref_count[block_id]}, held by {holders[block_id]} "
                "tables and pending copies"
            )
        for request_id, hashes in self.block_hashes.items():
            table = self.block_tables[request_id]
            assert len(hashes) * self.block_size <= table.num_tokens, f"{request_id}: hash of a partial block"
            for block_hash, block_id in zip(hashes, table.block_ids):
                cached = self.pool.block_hash[block_id]
                assert cached in (block_hash, None), f"{request_id}: block {block_id} carries another hash"
