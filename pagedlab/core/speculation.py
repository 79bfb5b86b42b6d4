"""Speculative decoding in the core: which sequences may be drafted for, how many draft tokens each verifies, and
how a verified chunk is accepted and rolled back. Pure Python, like the rest of the core.

A proposer (`pagedlab.spec_decode`) drafts up to k tokens for each running decode (`draft_requests`). The
scheduler then extends each decode it scheduled by its drafts (`_speculate`), only from the token budget and free
blocks that nothing else took, so speculation never preempts or delays anyone:

    before:  seq [7, 1]  6 slots; its newest token (position 5) still to compute     block size 4
    drafts:  3 tokens -> the step computes positions 5-8: a chunk of 1 + 3 tokens, in blocks [7, 1, 12]

The model scores every row of the chunk; the worker accepts the longest prefix of drafts the target agrees with,
plus one token of its own. `_accept` appends them and rolls the table back over the rejected drafts' slots
(`KVCacheManager.rollback`): 2 of 3 accepted -> positions 5-7 stay computed, slot 8 (block 12) is freed.

# Explained in chapters/11_speculative_decoding.ipynb
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedlab.core.kv_cache_manager import Rollback
from pagedlab.core.request import Request, RequestStatus
from pagedlab.core.sched_output import ScheduledRequest, SequenceUpdate

if TYPE_CHECKING:
    from pagedlab.core.scheduler import Scheduler
    from pagedlab.core.scheduler_step import StepBuilder


@dataclass(frozen=True)
class DraftRequest:
    """What a proposer sees of one running decode: its tokens so far (prompt + output) and how many drafts it can
    use at most (its `num_speculative_tokens`, fewer near max_tokens or max_model_len)."""

    request_id: str
    token_ids: tuple[int, ...]
    max_num_draft_tokens: int
    cache_salt: str | None = None  # a draft model's prefix cache keeps the target's isolation between salts


def max_num_draft_tokens(request: Request, num_speculative_tokens: int, max_model_len: int) -> int:
    """Drafts worth verifying for a decode: k accepted drafts and the token after them must fit in max_tokens and
    in max_model_len. Beam sequences never speculate (the beam step needs every beam's full distribution at each
    position, which a verified chunk does not give)."""
    if request.is_beam or request.num_tokens - request.num_computed_tokens != 1:
        return 0
    room = min(request.max_tokens - request.num_output_tokens, max_model_len - request.num_tokens)
    return max(0, min(num_speculative_tokens, room - 1))


class SpeculativeScheduling:
    """The scheduler's methods for speculative decoding (a mixin of `Scheduler`, kept in this file): they read
    and change the scheduler's state, and nothing else does."""

    def draft_requests(self: Scheduler, num_speculative_tokens: int) -> list[DraftRequest]:
        """The running decodes that could verify drafts this step, oldest first."""
        out = []
        for request in self.running:
            if request.group_id in self.in_flight:
                continue
            limit = max_num_draft_tokens(request, num_speculative_tokens, self.config.max_model_len)
            if limit:
                tokens = tuple(request.token_ids(0, request.num_tokens))
                out.append(DraftRequest(request.request_id, tokens, limit, request.cache_salt))
        return out

    def _speculate(self: Scheduler, step: StepBuilder, draft_token_ids: Mapping[str, Sequence[int]]) -> None:
        """Extend the step's decodes by their drafts, oldest first, each within the budget and the free slots left."""
        kv, size = self.kv_cache_manager, self.kv_cache_manager.block_size
        for index, work in enumerate(step.scheduled):
            drafts = draft_token_ids.get(work.request_id)
            if not drafts or work.num_new_tokens != 1 or len(work.sampling) != 1 or step.budget <= 0:
                continue
            request = self.requests[work.request_id]
            k = min(step.budget, max_num_draft_tokens(request, len(drafts), self.config.max_model_len))
            table = kv.block_tables[work.request_id]
            free_slots = len(table.block_ids) * size - table.num_tokens + kv.num_free_blocks * size
            k = min(k, free_slots)
            if k <= 0:
                continue
            allocation = kv.allocate_slots(work.request_id, table.num_tokens + k)
            assert allocation is not None, "the draft slots were counted free"
            step.speculate(index, tuple(drafts[:k]), table.block_ids, allocation)

    def _accept(
        self: Scheduler, request: Request, work: ScheduledRequest, new_token_ids: Sequence[int],
        updates: list[SequenceUpdate],
    ) -> tuple[list[int], Rollback]:
        """After a verified step: append `new_token_ids` (the accepted drafts and the token drawn after them) up to
        the first that finishes the sequence, mark their KV computed, and roll the table back over the rejected
        drafts' slots. Returns the blocks that became free and the rollback."""
        num_accepted = len(new_token_ids) - 1
        drafts = work.spec_token_ids
        if not 0 <= num_accepted <= len(drafts) or tuple(new_token_ids[:-1]) != drafts[:num_accepted]:
            raise ValueError(f"{request.request_id}: {list(new_token_ids)} is not a prefix of its drafts {drafts} "
                             "and one token after it")
        start = work.num_computed_tokens
        computed = start + work.num_new_tokens - work.num_spec_tokens + num_accepted  # newest token + accepted
        kv = self.kv_cache_manager
        rollback = kv.rollback(request.request_id, computed)
        appended, status = [], None
        for token in new_token_ids:
            request.append_token(token)
            appended.append(token)
            status = request.check_stop(self.config.max_model_len)
            if status is not None:
                break
        request.num_computed_tokens = min(computed, request.num_tokens)
        kv.cache_full_blocks(request.request_id, request.num_computed_tokens, request.token_ids, request.cache_salt)
        self.stats.record_verification(work.num_spec_tokens, num_accepted)
        freed = list(rollback.freed)
        if status is not None:
            freed += self.finish_requests([request.request_id], status)[1]
        updates.append(SequenceUpdate(
            request.request_id, request.group_id, tuple(appended), status.finish_reason if status else None,
            request.stop_reason if status == RequestStatus.FINISHED_STOPPED else None, request.num_cached_tokens,
        ))
        return freed, rollback
