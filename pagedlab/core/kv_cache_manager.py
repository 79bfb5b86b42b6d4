"""Block tables: each request's map from logical blocks to physical blocks in the shared pool.

The manager grows a request's block table on demand, one block whenever its tokens spill past the last
block, and frees the whole table when the request finishes, is preempted or is aborted. Nothing is
reserved ahead of need: a request holds ceil(num_tokens / block_size) blocks, so only its last block can
have empty slots. With prefix caching on, a new request first takes the longest run of cached full blocks
that match its tokens, and every block it fills is hashed for those who come after.

# Explained in chapters/02_paged_blocks.ipynb
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pagedlab.core.block_hash import BlockHash, hash_block, root_hash
from pagedlab.core.block_pool import BlockPool


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class BlockTable:
    """The physical blocks of one request, in logical order, and how many token slots are in use.

    Token i of the request lives in block `block_ids[i // block_size]` at offset `i % block_size`:

        logical:   [ block 0 | block 1 | block 2 ]      num_tokens = 10, block_size = 4
        physical:  [   7     |   1     |   12    ]
        slots:     [x x x x  | x x x x | x x . . ]      last block filled 2/4
    """

    block_size: int
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0

    @property
    def num_filled_in_last_block(self) -> int:
        if not self.block_ids:
            return 0
        return self.num_tokens - (len(self.block_ids) - 1) * self.block_size

    def slot(self, position: int) -> int:
        """The flat slot index (`block_id * block_size + offset`) of the token at `position`."""
        return self.block_ids[position // self.block_size] * self.block_size + position % self.block_size


class KVCacheManager:
    """Allocates and frees the block tables of all requests over one `BlockPool`.

    Invariants:
      - each block's ref_count equals the number of block tables that hold it;
      - a table holds exactly cdiv(num_tokens, block_size) blocks;
      - no block is both free and held by a table (the pool's own invariants hold);
      - with prefix caching, a request's known block hashes cover only full blocks, and each is the hash
        its block carries in the pool, unless that content was already cached in another block.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        if block_size < 1 or block_size & (block_size - 1) or block_size > 256:
            raise ValueError(f"block_size must be a power of two from 1 to 256, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, BlockTable] = {}
        self.block_hashes: dict[str, list[BlockHash]] = {}  # hashes of each request's full blocks so far
        self.num_query_tokens = 0  # prefix-cache metrics, in tokens
        self.num_cow_copies = 0
        self._copies: list[tuple[str, int, int]] = []
        self.num_hit_tokens = 0

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

    def get_computed_blocks(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[int]:
        """The longest run of cached full blocks holding a prefix of `token_ids`.

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
            parent = hash_block(parent, tokens)
            block_id = self.pool.lookup(parent, tokens)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def record_prefix_query(self, num_tokens: int, num_hit_blocks: int) -> None:
        """Count an admitted request's lookup in the hit-rate metrics (a blocked one may look again)."""
        if self.enable_prefix_caching:
            self.num_query_tokens += num_tokens
            self.num_hit_tokens += num_hit_blocks * self.block_size

    def allocate_slots(
        self, request_id: str, num_tokens: int, computed_blocks: Sequence[int] = (), write_from: int | None = None
    ) -> list[int] | None:
        """Make the request's table cover `num_tokens` token slots in all, starting with `computed_blocks`
        (prefix-cache hits, for a request that holds no table yet), ready for writes from `write_from` on.

        Copy-on-write: if the block that holds position `write_from` is shared (ref_count > 1, after a
        fork), the request gets a private copy of it first. Only a partially filled last block can be
        shared and written; full shared blocks are never copied.

            before:  seq A [7, 1]  seq B [7, 1]    block 1 shared, 2/4 filled, B writes slot 3
            after:   seq A [7, 1]  seq B [7, 3]    block 3 = copy of 1 (pending copy 1 -> 3)

        Returns the blocks newly allocated (possibly none), or None, changing nothing, when too few are free.
        The copies to make are collected for `take_copies()`.
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
        new_block_ids = self.pool.allocate(num_new_blocks + num_copies)
        if shared_index is not None:
            source, copy = table.block_ids[shared_index], new_block_ids.pop()
            table.block_ids[shared_index] = copy
            self.pool.free([source])  # one holder fewer; the others keep reading it
            self._copies.append((request_id, source, copy))
            self.num_cow_copies += 1
            new_block_ids.append(copy)
        table.block_ids.extend(new_block_ids[: len(new_block_ids) - num_copies])
        table.num_tokens = max(table.num_tokens, num_tokens)
        return new_block_ids

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
            if self.pool.ref_count[table.block_ids[index]] > 1:
                shared_index = index
        return num_new_blocks, shared_index

    def num_blocks_short(self, request_id: str, num_tokens: int, write_from: int | None = None) -> int:
        """How many more free blocks a running request's `allocate_slots(num_tokens, write_from=...)` needs."""
        num_new_blocks, shared_index = self._growth(request_id, num_tokens, (), write_from)
        return max(num_new_blocks + (shared_index is not None) - self.pool.num_free_blocks, 0)

    def num_tail_blocks_to_release(self, request_id: str, num_blocks: int) -> int | None:
        """How many of the request's last blocks it must give up so that `num_blocks` blocks become free
        (blocks it shares with others free nothing), keeping at least its first block; None if it cannot."""
        block_ids = self.block_tables[request_id].block_ids
        freed = 0
        for count, block_id in enumerate(reversed(block_ids[1:]), start=1):
            freed += self.pool.ref_count[block_id] == 1
            if freed >= num_blocks:
                return count
        return None

    def truncate(self, request_id: str, num_blocks: int) -> list[int]:
        """Shrink the request's table to its first `num_blocks` blocks, all full (partial preemption);
        return the blocks that became free. Released last first, like `free`."""
        table = self.block_tables[request_id]
        assert 0 < num_blocks <= len(table.block_ids)
        released = table.block_ids[num_blocks:]
        del table.block_ids[num_blocks:]
        table.num_tokens = min(table.num_tokens, num_blocks * self.block_size)
        if request_id in self.block_hashes:
            del self.block_hashes[request_id][num_blocks:]
        return self.pool.free(reversed(released))

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give `child_id` a table sharing every block of the parent's (each block gets one holder more)."""
        parent = self.block_tables[parent_id]
        assert child_id not in self.block_tables
        self.block_tables[child_id] = BlockTable(self.block_size, list(parent.block_ids), parent.num_tokens)
        self.pool.share(parent.block_ids)
        if parent_id in self.block_hashes:
            self.block_hashes[child_id] = list(self.block_hashes[parent_id])

    def take_copies(self) -> tuple[tuple[str, int, int], ...]:
        """The copy-on-write copies (request_id, source block, copy) made since the last call."""
        copies, self._copies = tuple(self._copies), []
        return copies

    def cache_full_blocks(
        self, request_id: str, num_computed_tokens: int, token_ids: Callable[[int, int], list[int]],
        cache_salt: str | None = None,
    ) -> None:  # fmt: skip
        """Hash the request's blocks that `num_computed_tokens` has filled, so that later requests hit them."""
        if not self.enable_prefix_caching:
            return
        size = self.block_size
        hashes = self.block_hashes.setdefault(request_id, [])
        table = self.block_tables[request_id]
        parent = hashes[-1] if hashes else root_hash(cache_salt)
        for i in range(len(hashes), num_computed_tokens // size):
            tokens = token_ids(i * size, (i + 1) * size)
            parent = hash_block(parent, tokens)
            hashes.append(parent)
            block_id = table.block_ids[i]
            if self.pool.block_hash[block_id] is None:
                self.pool.cache(block_id, parent, tokens)  # False: the same content is cached elsewhere

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def free(self, request_id: str) -> list[int]:
        """Release the request's table; return the blocks that became free. Unknown ids free nothing.

        Blocks are released tail first, so that the free queue hands out a request's head blocks last
        (what prefix caching wants: a request's first blocks are the ones others are likeliest to share).
        """
        self.block_hashes.pop(request_id, None)
        table = self.block_tables.pop(request_id, None)
        if table is None:
            return []
        return self.pool.free(reversed(table.block_ids))

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        holders = [0] * self.pool.num_blocks
        for request_id, table in self.block_tables.items():
            assert len(table.block_ids) == self.num_blocks_for(table.num_tokens), (
                f"{request_id}: {len(table.block_ids)} blocks for {table.num_tokens} tokens"
            )
            for block_id in table.block_ids:
                holders[block_id] += 1
        for block_id, count in enumerate(holders):
            assert self.pool.ref_count[block_id] == count, (
                f"block {block_id}: ref_count {self.pool.ref_count[block_id]}, held by {count} tables"
            )
        for request_id, hashes in self.block_hashes.items():
            table = self.block_tables[request_id]
            assert len(hashes) * self.block_size <= table.num_tokens, f"{request_id}: hash of a partial block"
            for block_hash, block_id in zip(hashes, table.block_ids):
                cached = self.pool.block_hash[block_id]
                assert cached in (block_hash, None), f"{request_id}: block {block_id} carries another hash"
