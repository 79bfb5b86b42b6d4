"""The pool of physical KV blocks: which are free, and how many block tables hold each one.

A block is `block_size` token slots of K and V in every layer. The pool hands out block ids, counts their
holders (`ref_count`) and takes them back when the last holder lets go. With prefix caching, a full block
also carries the hash of its content: freed, it stays findable by that hash until it is handed out again
(evicted), least recently freed first. It knows nothing of tensors.

# Explained in chapters/02_paged_blocks.ipynb
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from pagedlab.core.block_hash import BlockHash


class NotEnoughBlocksError(RuntimeError):
    """Raised when more blocks are asked for than are free (callers check `num_free_blocks` first)."""


class BlockPool:
    """A fixed number of physical blocks, a free queue, and a reference count per block.

    The free queue is an `OrderedDict` used as an ordered set rather than a deque: blocks are taken from its
    head and returned to its tail, so the block freed longest ago is reused first, and a block can also be
    pulled out of the middle in O(1) (what prefix caching needs when a freed block is hit again).

    Invariants:
      - every block id in [0, num_blocks) is either in the free queue or has ref_count >= 1, never both;
      - ref_count is never negative;
      - the free queue holds each free block once;
      - hash_to_block and block_hash agree: hash_to_block[h] == b  <=>  block_hash[b] == h, and such a block
        holds block_tokens[b]; a block loses its hash only when it is handed out again (evicted) or the
        cache is reset.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.hash_to_block: dict[BlockHash, int] = {}
        self.num_evicted_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """The fraction of blocks held by at least one sequence."""
        return self.num_used_blocks / self.num_blocks

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    def allocate(self, num_blocks: int, evicted: list[int] | None = None) -> list[int]:
        """Take `num_blocks` blocks from the head of the free queue, each with ref_count 1. A cached block handed
        out loses its hash (its content is evicted); its id is appended to `evicted` when a list is given."""
        if num_blocks > len(self._free):
            raise NotEnoughBlocksError(f"asked for {num_blocks} blocks, {len(self._free)} are free")
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            if self.block_hash[block_id] is not None:  # a cached block is reused: evict its content now
                self._uncache(block_id)
                self.num_evicted_blocks += 1
                if evicted is not None:
                    evicted.append(block_id)
            self.ref_count[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one holder to each block, taking free (cached) ones out of the free queue: a prefix-cache hit."""
        for block_id in block_ids:
            if self.ref_count[block_id] == 0:
                del self._free[block_id]
            self.ref_count[block_id] += 1

    # -- prefix caching -----------------------------------------------------------------------------------

    def cache(self, block_id: int, block_hash: BlockHash, token_ids: Sequence[int]) -> bool:
        """Make a full, in-use block findable by its hash. False if another block already holds that content."""
        assert self.ref_count[block_id] >= 1 and self.block_hash[block_id] is None
        if block_hash in self.hash_to_block:
            return False
        self.hash_to_block[block_hash] = block_id
        self.block_hash[block_id] = block_hash
        self.block_tokens[block_id] = tuple(token_ids)
        return True

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> int | None:
        """The cached block holding exactly these tokens after this prefix, or None."""
        block_id = self.hash_to_block.get(block_hash)
        if block_id is None or self.block_tokens[block_id] != tuple(token_ids):
            return None  # unknown, or a hash collision: never hand back the wrong KV
        return block_id

    def _uncache(self, block_id: int) -> None:
        del self.hash_to_block[self.block_hash[block_id]]
        self.block_hash[block_id] = None
        self.block_tokens[block_id] = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any block is in use."""
        if self.num_used_blocks:
            return False
        for block_id in list(self.hash_to_block.values()):
            self._uncache(block_id)
        return True

    def share(self, block_ids: Iterable[int]) -> None:
        """Add one holder to each block (a fork: two block tables now point at it)."""
        for block_id in block_ids:
            assert self.ref_count[block_id] >= 1, f"cannot share free block {block_id}"
            self.ref_count[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> list[int]:
        """Drop one holder from each block; return the blocks that became free, in the order given."""
        freed = []
        for block_id in block_ids:
            assert self.ref_count[block_id] >= 1, f"double free of block {block_id}"
            self.ref_count[block_id] -= 1
            if self.ref_count[block_id] == 0:
                self._free[block_id] = None
                freed.append(block_id)
        return freed

    def free_block_ids(self) -> list[int]:
        """The free queue, head (next to be allocated) first."""
        return list(self._free)

    def check_invariants(self) -> None:
        assert len(self._free) == len(set(self._free)) and all(0 <= b < self.num_blocks for b in self._free)
        assert sum(count > 0 for count in self.ref_count) + len(self._free) == self.num_blocks, (
            "a block is neither free nor held, or both"
        )
        for block_hash, block_id in self.hash_to_block.items():
            assert self.block_hash[block_id] == block_hash, f"hash entry of block {block_id} is stale"
        assert sum(h is not None for h in self.block_hash) == len(self.hash_to_block)
        for block_id, count in enumerate(self.ref_count):
            assert count >= 0, f"block {block_id} has ref_count {count}"
            assert (count == 0) == (block_id in self._free), (
                f"block {block_id}: ref_count {count} but {'in' if block_id in self._free else 'not in'} free queue"
            )
