"""The engine's record of what happened at each step, for the chapters to replay and draw.

Each `StepRecord` is immutable and self-contained: what was scheduled, which blocks were allocated and freed,
who was preempted, appended to or finished, and a snapshot of every block table and queue after the step.
Visualisations read only these records, never the live engine.

# Explained in chapters/05_continuous_batching.ipynb
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedlab.core.scheduler import ScheduledRequest


@dataclass(frozen=True)
class BlockTableSnapshot:
    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int  # token slots in use; the last block holds num_tokens - (len(block_ids) - 1) * block_size


@dataclass(frozen=True)
class StepRecord:
    step: int
    scheduled: tuple[ScheduledRequest, ...]
    allocated: tuple[tuple[str, tuple[int, ...]], ...]
    freed: tuple[int, ...]
    preempted: tuple[str, ...]
    appended: tuple[tuple[str, int], ...]
    finished: tuple[tuple[str, str], ...]  # (request_id, finish_reason)
    block_tables: tuple[BlockTableSnapshot, ...]
    waiting: tuple[str, ...]
    running: tuple[str, ...]
    num_free_blocks: int
    cached_blocks: tuple[int, ...] = ()  # blocks findable by content hash (in use or free), prefix caching
    evicted: tuple[int, ...] = ()  # cached blocks handed out again this step (their hash is gone)
    forked: tuple[tuple[str, str], ...] = ()  # (parent, child): the child now shares all the parent's blocks
    copied: tuple[tuple[str, int, int], ...] = ()  # copy-on-write (request_id, shared block, its private copy)
    swapped: tuple[str, ...] = ()  # the swapped queue after the step (preempted, KV kept in CPU blocks)
    swapped_out: tuple[tuple[str, tuple[tuple[int, int], ...]], ...] = ()  # (request_id, ((gpu, cpu) block, ...))
    swapped_in: tuple[tuple[str, tuple[tuple[int, int], ...]], ...] = ()  # (request_id, ((cpu, gpu) block, ...))
    cpu_block_tables: tuple[BlockTableSnapshot, ...] = ()  # swapped requests' tables in the CPU pool
    num_free_cpu_blocks: int = 0
    truncated: tuple[tuple[str, int], ...] = ()  # partial preemptions: (request_id, computed tokens it kept)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass
class Trace:
    """All steps of one engine, in order. `num_blocks` and `block_size` say how to draw the pool;
    `num_cpu_blocks` is the size of the CPU swap pool (0 when the engine has none)."""

    num_blocks: int
    block_size: int
    num_cpu_blocks: int = 0
    steps: list[StepRecord] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, index: int) -> StepRecord:
        return self.steps[index]

    def __iter__(self):
        return iter(self.steps)
