"""The engine's record of what happened at each step, for the chapters to replay and draw.

Each `StepRecord` is immutable and self-contained: what was scheduled, which blocks were allocated, copied,
swapped and freed, who was preempted, forked, appended to or finished, how long the step took, and a snapshot
of every block table and queue after the step. It is built from the step's outputs (`SchedulerOutput`,
`UpdateOutput`) and the scheduler's `snapshot()`; visualisations read only these records, never the live engine.
A `Trace` keeps the most recent `max_steps` records (all of them when None), so a long run stays bounded.

# Explained in chapters/05_continuous_batching.ipynb
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pagedlab.core.sched_output import Move, ScheduledRequest, SchedulerOutput, UpdateOutput


@dataclass(frozen=True)
class BlockTableSnapshot:
    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int  # token slots in use; the last block holds num_tokens - (len(block_ids) - 1) * block_size


@dataclass(frozen=True)
class SchedulerSnapshot:
    """The queues and both pools after a step (`Scheduler.snapshot()`)."""

    block_tables: tuple[BlockTableSnapshot, ...]
    waiting: tuple[str, ...]
    running: tuple[str, ...]
    swapped: tuple[str, ...]
    num_free_blocks: int
    cached_blocks: tuple[int, ...]
    cpu_block_tables: tuple[BlockTableSnapshot, ...]
    num_free_cpu_blocks: int


@dataclass(frozen=True)
class StepRecord:
    step: int
    scheduled: tuple[ScheduledRequest, ...]
    allocated: tuple[tuple[str, tuple[int, ...]], ...]
    freed: tuple[int, ...]
    preempted: tuple[str, ...]
    appended: tuple[tuple[str, int], ...]
    finished: tuple[tuple[str, str], ...]  # (request_id, finish_reason); pruned beams read "pruned"
    block_tables: tuple[BlockTableSnapshot, ...]
    waiting: tuple[str, ...]
    running: tuple[str, ...]
    num_free_blocks: int
    cached_blocks: tuple[int, ...] = ()  # blocks findable by content hash (in use or free), prefix caching
    evicted: tuple[int, ...] = ()  # cached blocks handed out again this step (their hash is gone)
    forked: tuple[tuple[str, str], ...] = ()  # (parent, child): the child now shares all the parent's blocks
    copied: tuple[tuple[str, int, int], ...] = ()  # copy-on-write (request_id, shared block, its private copy)
    swapped: tuple[str, ...] = ()  # the swapped queue after the step (preempted, KV kept in CPU blocks)
    swapped_out: tuple[Move, ...] = ()  # (request_id, ((gpu, cpu) block, ...))
    swapped_in: tuple[Move, ...] = ()  # (request_id, ((cpu, gpu) block, ...))
    cpu_block_tables: tuple[BlockTableSnapshot, ...] = ()  # swapped requests' tables in the CPU pool
    num_free_cpu_blocks: int = 0
    truncated: tuple[tuple[str, int], ...] = ()  # partial preemptions: (request_id, computed tokens it kept)
    restarted: tuple[tuple[str, str], ...] = ()  # (group, first beam): beam searches starting again
    duration_s: float = 0.0  # wall-clock time of the step, scheduling to outputs
    verified: tuple[tuple[str, int, int], ...] = ()  # speculative decoding: (request_id, drafts, drafts accepted)
    rolled_back: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (request_id, slots its rejected drafts gave back)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_decode_tokens(self) -> int:
        """Tokens of sequences that computed exactly one (decodes, and one-token chunks)."""
        return sum(s.num_new_tokens for s in self.scheduled if s.is_decode)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_batched_tokens - self.num_decode_tokens

    @property
    def num_swapped_blocks(self) -> int:
        """Blocks copied between the pools in this step, out and in."""
        return sum(len(pairs) for _, pairs in self.swapped_out + self.swapped_in)

    @classmethod
    def build(
        cls, output: SchedulerOutput, update: UpdateOutput, state: SchedulerSnapshot, stopped: tuple = (),
        freed: tuple[int, ...] = (), duration_s: float = 0.0,
    ) -> StepRecord:
        """The record of one step: its decision, its update, and `stopped` (request_id, reason) sequences that the
        output processor finished (stop strings, errors) with the `freed` blocks they released."""
        return cls(
            step=output.step,
            scheduled=output.scheduled,
            allocated=output.allocated,
            freed=output.freed + update.freed + tuple(freed),
            preempted=output.preempted,
            appended=update.appended,
            finished=output.finished + update.finished + tuple(stopped),
            block_tables=state.block_tables,
            waiting=state.waiting,
            running=state.running,
            num_free_blocks=state.num_free_blocks,
            cached_blocks=state.cached_blocks,
            evicted=output.evicted,
            forked=output.forked + update.forked,
            copied=output.copies,
            swapped=state.swapped,
            swapped_out=output.swapped_out,
            swapped_in=output.swapped_in,
            cpu_block_tables=state.cpu_block_tables,
            num_free_cpu_blocks=state.num_free_cpu_blocks,
            truncated=output.truncated,
            restarted=output.restarted,
            duration_s=duration_s,
            verified=update.verified,
            rolled_back=update.rolled_back,
        )


@dataclass
class Trace:
    """The steps of one engine, in order. `num_blocks` and `block_size` say how to draw the pool;
    `num_cpu_blocks` is the size of the CPU swap pool (0 when the engine has none). Only the last `max_steps`
    records are kept (None: all); `num_dropped` counts the older ones let go."""

    num_blocks: int
    block_size: int
    num_cpu_blocks: int = 0
    max_steps: int | None = None
    steps: list[StepRecord] = field(default_factory=list)
    num_dropped: int = 0

    def append(self, record: StepRecord) -> None:
        self.steps.append(record)
        if self.max_steps is not None and len(self.steps) > self.max_steps:
            del self.steps[0]
            self.num_dropped += 1

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, index: int) -> StepRecord:
        return self.steps[index]

    def __iter__(self):
        return iter(self.steps)

    def group_ids(self) -> dict[str, str]:
        """Which user request each sequence of the recorded steps belongs to (read from the records, never from
        the ids): a scheduled sequence's `group_id`, and a fork's its parent's."""
        group_of: dict[str, str] = {}
        for record in self.steps:
            for scheduled in record.scheduled:
                group_of[scheduled.request_id] = scheduled.group_id
            for parent, child in record.forked:
                group_of[child] = group_of.get(parent, parent)
        return group_of


def schedule_of(record: StepRecord) -> StepRecord:
    """The record without what depends on the model: token values (kept: who got one) and the step's time. Two
    engines made the same schedule when these are equal at every step (the one definition of it)."""
    scheduled = tuple(
        dataclasses.replace(s, token_ids=(), sampling=tuple(dataclasses.replace(t, params=None) for t in s.sampling))
        for s in record.scheduled
    )
    appended = tuple((rid, 0) for rid, _ in record.appended)
    return dataclasses.replace(record, scheduled=scheduled, appended=appended, duration_s=0.0)


def first_difference(trace: Trace, other: Trace) -> str | None:
    """None if the two traces made the same decisions at every step; else the first step and field that differ."""
    if len(trace) != len(other):
        return f"{len(trace)} steps against {len(other)}"
    for a, b in zip(trace, other):
        a, b = schedule_of(a), schedule_of(b)
        for name in (f.name for f in dataclasses.fields(StepRecord)):
            x, y = getattr(a, name), getattr(b, name)
            if x != y:
                return f"step {a.step}, {name}: {x!r} against {y!r}"
    return None
