"""Block tables: each request's map from logical blocks to physical blocks in the shared pool.

The manager grows a request's block table on demand, one block whenever its tokens spill past the last
block, and frees the whole table when the request finishes, is preempted or is aborted. Nothing is
reserved ahead of need: a request holds ceil(num_tokens / block_size) blocks, so only its last block can
have empty slots.

# Explained in chapters/02_paged_blocks.ipynb
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
      - no block is both free and held by a table (the pool's own invariants hold).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1 or block_size & (block_size - 1) or block_size > 256:
            raise ValueError(f"block_size must be a power of two from 1 to 256, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, BlockTable] = {}

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

    def allocate_slots(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Make the request's table cover `num_tokens` token slots in all.

        Returns the blocks newly added (possibly none), or None, changing nothing, when too few are free.
        """
        table = self.block_tables.get(request_id)
        if table is None:
            table = self.block_tables[request_id] = BlockTable(self.block_size)
        num_new_blocks = self.num_blocks_for(num_tokens) - len(table.block_ids)
        if num_new_blocks > self.pool.num_free_blocks:
            if not table.block_ids:
                del self.block_tables[request_id]
            return None
        new_block_ids = self.pool.allocate(num_new_blocks) if num_new_blocks > 0 else []
        table.block_ids.extend(new_block_ids)
        table.num_tokens = max(table.num_tokens, num_tokens)
        return new_block_ids

    def free(self, request_id: str) -> list[int]:
        """Release the request's table; return the blocks that became free. Unknown ids free nothing.

        Blocks are released tail first, so that the free queue hands out a request's head blocks last
        (what prefix caching wants: a request's first blocks are the ones others are likeliest to share).
        """
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
