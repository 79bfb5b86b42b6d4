"""The scheduler's counters over an engine's life: steps, preemptions by kind, recomputed tokens, speculative
decoding's drafts verified and accepted.

# Explained in chapters/06_preemption.ipynb
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedlab.core.preemption import Preemption, PreemptionMode


@dataclass
class SchedulerStats:
    num_steps: int = 0
    num_preemptions: int = 0  # preempted sequences: whole (by either mode) and partial
    num_preemptions_recompute: int = 0
    num_preemptions_swap: int = 0
    num_preemptions_partial: int = 0  # of which partial: only the victim's tail blocks were taken
    num_recomputed_tokens: int = 0  # computed tokens whose KV a recompute or partial preemption dropped
    spec_num_drafts: int = 0  # speculative decoding: verifications (a sequence's drafts checked in one step)
    spec_num_draft_tokens: int = 0  # draft tokens verified (proposed and scheduled)
    spec_num_accepted_tokens: int = 0
    spec_num_draft_tokens_per_pos: list[int] = field(default_factory=list)  # [i]: drafts verified at position i
    spec_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i

    def record_verification(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_draft_tokens
        self.spec_num_accepted_tokens += num_accepted
        for counts, n in ((self.spec_num_draft_tokens_per_pos, num_draft_tokens),
                          (self.spec_num_accepted_tokens_per_pos, num_accepted)):
            counts.extend([0] * (num_draft_tokens - len(counts)))
            for i in range(n):
                counts[i] += 1

    def record(self, preemption: Preemption) -> None:
        count = len(preemption.request_ids)
        self.num_preemptions += count
        self.num_recomputed_tokens += preemption.num_recomputed_tokens
        if preemption.is_partial:
            self.num_preemptions_partial += count
        elif preemption.mode == PreemptionMode.SWAP:
            self.num_preemptions_swap += count
        else:
            self.num_preemptions_recompute += count


@dataclass(frozen=True)
class KVCacheStats:
    """The device pool and its prefix cache (`KVCacheManager.stats()`)."""

    num_kv_blocks: int
    num_used_blocks: int
    block_size: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of which found cached (not computed)
    num_evicted_blocks: int


@dataclass(frozen=True)
class SwapStats:
    """The CPU swap pool (`SwapSpace.stats()`); all zero without one."""

    num_cpu_blocks: int = 0
    num_used_cpu_blocks: int = 0
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0


@dataclass(frozen=True)
class QueueStats:
    """The scheduler's queues now, and its counters over the engine's life (`Scheduler.queue_stats()`)."""

    num_running: int
    num_waiting: int
    num_swapped: int
    counters: SchedulerStats


@dataclass(frozen=True)
class CoreStats:
    """The engine core's own counters: what its steps computed and generated, and the pool's peak."""

    peak_used_blocks: int = 0
    num_computed_tokens: int = 0  # tokens run through the model (prompts, recomputation and decodes)
    num_generated_tokens: int = 0
    num_finished: int = 0  # user requests finished, however they ended
