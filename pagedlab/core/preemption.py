"""How a preempted request gives back its blocks: recompute them later, or swap them out to CPU memory.

- "recompute": free the blocks; the request later re-prefills its prompt and everything it generated.
- "swap": copy the blocks to a CPU block pool (`SwapSpace`) and free them; copy them back when there is room.
- "auto": per victim, whichever costs less time, by a cost model measured on the actual device at start-up:

      swap cost      = 2 x bytes of the victim's blocks / copy bandwidth     (out now, back in later)
      recompute cost = tokens it has computed / prefill speed (tokens/s)

Both costs grow linearly with the victim's length, so on one machine the choice is nearly always the same;
the model exists to make it measured, explained and reproducible instead of hard-coded. When the CPU pool
is full a swap falls back to recompute. Pure Python: the engine measures, this module decides.

# Explained in chapters/06_preemption.ipynb
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class PreemptionMode(str, enum.Enum):
    RECOMPUTE = "recompute"
    SWAP = "swap"
    AUTO = "auto"


@dataclass(frozen=True)
class PreemptionCostModel:
    """Measured speeds of the two ways back, and the choice they imply for a victim."""

    bytes_per_block: int
    block_size: int
    copy_bytes_per_s: float  # one direction, device <-> CPU swap pool, batched copy of whole blocks
    prefill_tokens_per_s: float  # the model's prefill speed on this device

    def swap_seconds(self, num_blocks: int) -> float:
        return 2 * num_blocks * self.bytes_per_block / self.copy_bytes_per_s

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s

    def choose(self, num_blocks: int, num_tokens: int) -> PreemptionMode:
        """SWAP or RECOMPUTE for a victim holding `num_blocks` blocks with `num_tokens` computed tokens."""
        if self.swap_seconds(num_blocks) < self.recompute_seconds(num_tokens):
            return PreemptionMode.SWAP
        return PreemptionMode.RECOMPUTE

    def explain(self) -> str:
        """The decision in words, per token of a victim with full blocks."""
        swap = self.swap_seconds(1) / self.block_size
        recompute = self.recompute_seconds(1)
        winner, ratio = ("swap", recompute / swap) if swap < recompute else ("recompute", swap / recompute)
        return (
            f"auto preemption: swapping a token out and back in costs {1e6 * swap:.2f} us "
            f"(2 x {self.bytes_per_block // self.block_size} bytes at {self.copy_bytes_per_s / 1e9:.1f} GB/s); "
            f"recomputing it costs {1e6 * recompute:.2f} us (prefill at {self.prefill_tokens_per_s:,.0f} tokens/s): "
            f"{winner} is {ratio:.1f}x cheaper, so auto chooses {winner} (recompute when the CPU pool is full)"
        )
