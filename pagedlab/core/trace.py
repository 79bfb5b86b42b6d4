"""The engine's record of what happened at each step, for the chapters to replay and draw.

Each `StepRecord` is immutable and self-contained: what was scheduled, which blocks were allocated, copied,
swapped and freed, who was preempted, forked, appended to or finished, how long the step took, and a snapshot
of every block table and queue after the step. It is built from the step's outputs (`SchedulerOutput`,
`UpdateOutput`) and the scheduler's `snapshot()`; visualisations read only these records, never the live engine.
A `Trace` keeps the most recent `max_steps` records (all of them when None), so a long run stays bounded.

# Explained in chapters/05_continuous_batching.ipynb
"""

from __future__ import annotations

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
