"""The CPU swap space: a second block pool where preempted requests keep their KV until there is room again.

Swapping out moves a set of block tables from the device pool to the CPU pool, one CPU block per distinct
device block, so sequences that shared blocks (n > 1 samples, beams) still share them on the CPU side and
again after swapping back in:

    device  seq A [7, 1, 4]   seq B [7, 1, 9]        blocks 7 and 1 shared (ref_count 2)
       swap out A and B  ->  copies 7->0, 1->1, 4->2, 9->3
    cpu     seq A [0, 1, 2]   seq B [0, 1, 3]        blocks 0 and 1 shared (ref_count 2)

Swapping in does the reverse. The moves return the (source, target) block pairs; the worker copies the data
(one batched copy per direction per step). Pure Python, no tensors.

# Explained in chapters/06_preemption.ipynb
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedlab.core.block_pool import BlockPool
from pagedlab.core.block_table import BlockTable
from pagedlab.core.kv_cache_manager import KVCacheManager
from pagedlab.core.sched_output import Move
from pagedlab.core.stats import SwapStats


class SwapSpace:
    """The CPU block pool and the tables of the swapped requests, beside a device-side `KVCacheManager`.

    Invariants:
      - a request has a table in at most one of the two pools;
      - each CPU block's ref_count equals the number of CPU tables that hold it (the pool's own invariants
        hold too), and a CPU table holds exactly cdiv(num_tokens, block_size) blocks.
    """

    def __init__(self, kv: KVCacheManager, num_cpu_blocks: int) -> None:
        self.kv_cache_manager = kv
        self.pool = BlockPool(max(num_cpu_blocks, 1))
        self.num_cpu_blocks = num_cpu_blocks
        self.block_tables: dict[str, BlockTable] = {}
        self.num_swapped_out_blocks = 0  # distinct blocks copied, over the engine's life
        self.num_swapped_in_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks if self.num_cpu_blocks else 0

    def _distinct(self, tables: Sequence[BlockTable]) -> list[int]:
        return list(dict.fromkeys(b for table in tables for b in table.block_ids))

    def num_blocks_to_swap_out(self, request_ids: Sequence[str]) -> int:
        return len(self._distinct([self.kv_cache_manager.block_tables[r] for r in request_ids]))

    def num_blocks_to_swap_in(self, request_ids: Sequence[str]) -> int:
        return len(self._distinct([self.block_tables[r] for r in request_ids]))

    def can_swap_out(self, request_ids: Sequence[str]) -> bool:
        return self.num_blocks_to_swap_out(request_ids) <= self.num_free_blocks

    def swap_out(self, request_ids: Sequence[str]) -> tuple[list[Move], list[int]]:
        """Move the requests' tables to the CPU pool. Returns, per request, the (device, cpu) block pairs to
        copy (a shared block is listed once, under its first holder), and the device blocks that became
        free. The requests' prefix-cache hashes go with their device tables (swap-in rehashes)."""
        moves = self._move(
            [self.kv_cache_manager.block_tables[r] for r in request_ids], self.pool, request_ids, self.block_tables
        )
        freed = [b for r in request_ids for b in self.kv_cache_manager.free(r)]
        self.num_swapped_out_blocks += sum(len(pairs) for _, pairs in moves)
        return moves, freed

    def can_swap_in(self, request_ids: Sequence[str], num_spare_blocks: int = 0) -> bool:
        return self.num_blocks_to_swap_in(request_ids) + num_spare_blocks <= self.kv_cache_manager.num_free_blocks

    def swap_in(self, request_ids: Sequence[str]) -> list[Move]:
        """Move the requests' tables back to the device pool. Returns, per request, the (cpu, device) pairs."""
        tables = [self.block_tables.pop(r) for r in request_ids]
        moves = self._move(tables, self.kv_cache_manager.pool, request_ids, self.kv_cache_manager.block_tables)
        for table in tables:
            self.pool.free(table.block_ids)
        self.num_swapped_in_blocks += sum(len(pairs) for _, pairs in moves)
        return moves

    def _move(self, tables, target_pool: BlockPool, request_ids, target_tables) -> list[Move]:
        """Copy `tables` into `target_pool`, one target block per distinct source block (sharing kept)."""
        distinct = self._distinct(tables)
        source_to_target = dict(zip(distinct, target_pool.allocate(len(distinct))))
        moves, listed = [], set()
        for request_id, table in zip(request_ids, tables):
            target_ids = [source_to_target[b] for b in table.block_ids]
            target_pool.share(target_ids)  # one holder per table ...
            target_tables[request_id] = BlockTable(table.block_size, target_ids, table.num_tokens)
            pairs = tuple((b, source_to_target[b]) for b in table.block_ids if b not in listed)
            listed.update(table.block_ids)
            moves.append((request_id, pairs))
        target_pool.free(source_to_target.values())  # ... and not the one allocate() gave
        return moves

    def free(self, request_id: str) -> list[int]:
        """Drop a swapped request's CPU table (an abort). Returns the CPU blocks that became free."""
        table = self.block_tables.pop(request_id, None)
        return self.pool.free(table.block_ids) if table is not None else []

    def stats(self) -> SwapStats:
        used = self.pool.num_used_blocks if self.num_cpu_blocks else 0
        return SwapStats(self.num_cpu_blocks, used, self.num_swapped_out_blocks, self.num_swapped_in_blocks)

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        assert not set(self.block_tables) & set(self.kv_cache_manager.block_tables), (
            "a request holds tables in both pools"
        )
        holders = [0] * self.pool.num_blocks
        for request_id, table in self.block_tables.items():
            assert len(table.block_ids) == self.kv_cache_manager.num_blocks_for(table.num_tokens), (
                f"{request_id}: CPU table size"
            )
            for block_id in table.block_ids:
                holders[block_id] += 1
        assert holders == self.pool.ref_count, "CPU ref counts differ from the CPU tables"
