"""How a preempted request gives back its blocks: recompute them later, or swap them out to CPU memory.

- "recompute": free the blocks; the request later re-prefills its prompt and everything it generated.
- "swap": copy the blocks to a CPU block pool (`SwapSpace`) and free them; copy them back when there is room.
- "auto": per victim, whichever costs less time, by a cost model measured on the actual device at start-up:

      swap cost      = 2 x bytes of the victim's blocks / copy bandwidth     (out now, back in later)
      recompute cost = tokens it has computed / prefill speed (tokens/s)

A victim is a whole group (a request's samples or beams, which share blocks), so that a swap keeps their
sharing. Recomputing a group of samples re-prefills each sample on its own; a beam search cannot be recomputed
beam by beam (its beams would lose the blocks they share and need more memory than before, and it takes a beam
step only when every beam is ready), so it starts again from its prompt, which gives the same beams.
`preempt_tail` is partial preemption: a one-sequence victim gives up only its last blocks.

The functions here change the victims' blocks and counters and return a frozen record; the scheduler moves
the victims between its queues. Pure Python: the engine measures the costs, this module decides.

# Explained in chapters/06_preemption.ipynb
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedlab.core.request import Request
from pagedlab.core.sched_output import Move

if TYPE_CHECKING:
    from pagedlab.core.kv_cache_manager import KVCacheManager
    from pagedlab.core.swap_space import SwapSpace


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
    prefill_tokens_per_s: float  # the model's prefill speed on this device, through the paged forward

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


@dataclass(frozen=True)
class Preemption:
    """What one preemption did."""

    request_ids: tuple[str, ...]  # the victim sequences, in order
    mode: PreemptionMode  # what was done: RECOMPUTE (KV dropped) or SWAP (KV moved to the CPU pool)
    swapped_out: tuple[Move, ...] = ()
    freed: tuple[int, ...] = ()  # device blocks that became free
    num_recomputed_tokens: int = 0  # computed tokens whose KV was dropped
    kept_tokens: int | None = None  # partial preemption: the computed tokens the victim keeps
    restarted: str | None = None  # a beam group that starts again from its prompt (its first beam stays)

    @property
    def is_partial(self) -> bool:
        return self.kept_tokens is not None


def preempt_group(
    group: Sequence[Request], mode: PreemptionMode, kv: KVCacheManager, swap_space: SwapSpace | None,
    cost_model: PreemptionCostModel | None,
) -> Preemption:
    """Preempt the running sequences of one group, all of them, by `mode` ("auto" asks the cost model; a swap
    falls back to recompute when the CPU pool has no room)."""
    ids = [r.request_id for r in group]
    if mode == PreemptionMode.AUTO:
        num_blocks = swap_space.num_blocks_to_swap_out(ids) if swap_space else 0
        mode = cost_model.choose(num_blocks, sum(r.num_computed_tokens for r in group))
    for request in group:
        request.num_preemptions += 1
    if mode == PreemptionMode.SWAP and swap_space.can_swap_out(ids):
        moves, freed = swap_space.swap_out(ids)
        return Preemption(tuple(ids), PreemptionMode.SWAP, tuple(moves), tuple(freed))
    freed = [b for request_id in ids for b in kv.free(request_id)]
    recomputed = sum(r.num_computed_tokens for r in group)
    for request in group:
        request.num_computed_tokens = 0
    restarted = None
    if group[0].is_beam and len(group) > 1:
        restarted = group[0].group_id
        group[0].output_token_ids.clear()  # the first beam becomes the root again; the others are dropped
    return Preemption(tuple(ids), PreemptionMode.RECOMPUTE, (), tuple(freed), recomputed, restarted=restarted)


def preempt_tail(victim: Request, num_blocks: int, kv: KVCacheManager) -> Preemption | None:
    """Partial preemption: take from a one-sequence `victim` only the last blocks whose release frees
    `num_blocks`.

    The victim keeps running from the full blocks it keeps and recomputes the rest of its tokens as a
    prefill chunk when room comes back; its first block always stays (else it is a whole preemption).

        before:  victim [4, 9, 2, 7]  14 tokens computed        the current request needs 2 blocks
        after:   victim [4, 9]         8 tokens computed        blocks 2 and 7 are free; 6 tokens to redo

    Returns None, changing nothing, when its unshared tail blocks are too few."""
    num_released = kv.num_tail_blocks_to_release(victim.request_id, num_blocks)
    if num_released is None:
        return None
    num_kept = len(kv.block_tables[victim.request_id].block_ids) - num_released
    freed = kv.truncate(victim.request_id, num_kept)
    kept = min(victim.num_computed_tokens, num_kept * kv.block_size)
    recomputed = victim.num_computed_tokens - kept
    victim.num_computed_tokens = kept
    victim.num_preemptions += 1
    return Preemption((victim.request_id,), PreemptionMode.RECOMPUTE, (), tuple(freed), recomputed, kept_tokens=kept)
