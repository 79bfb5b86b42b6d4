"""The scheduler's counters over an engine's life: steps, preemptions by kind, recomputed tokens.

# Explained in chapters/06_preemption.ipynb
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedlab.core.preemption import Preemption, PreemptionMode


@dataclass
class SchedulerStats:
    num_steps: int = 0
    num_preemptions: int = 0  # preempted sequences: whole (by either mode) and partial
    num_preemptions_recompute: int = 0
    num_preemptions_swap: int = 0
    num_preemptions_partial: int = 0  # of which partial: only the victim's tail blocks were taken
    num_recomputed_tokens: int = 0  # computed tokens whose KV a recompute or partial preemption dropped

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
