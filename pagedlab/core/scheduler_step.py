"""What one call of `Scheduler.schedule()` decides, gathered as it goes and frozen into a `SchedulerOutput`.

Admitting a sequence into the step takes its tokens out of the budget and records its blocks; when the step
reaches the end of an n > 1 request's prompt, the scheduler forks its other n - 1 samples (sharing its blocks)
and each draws its first token from the prompt's last row of logits. The builder only writes down what the
scheduler decided: it changes no scheduler state.

# Explained in chapters/05_continuous_batching.ipynb
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pagedlab.core.kv_cache_manager import Allocation
from pagedlab.core.preemption import Preemption
from pagedlab.core.request import Request
from pagedlab.core.sched_output import (
    Move,
    PromptLogprobsRequest,
    SamplingRequest,
    ScheduledRequest,
    SchedulerOutput,
)


def banned_until_min_tokens(params, eos_token_ids) -> tuple[int, ...]:
    """The tokens a sequence may not draw before min_tokens: EOS (unless ignored) and the stop token ids."""
    return (() if params.ignore_eos else tuple(sorted(eos_token_ids))) + tuple(params.stop_token_ids)


def sampling_request(request: Request) -> SamplingRequest:
    """How to draw the sequence's next token: EOS and stop token ids are banned until min_tokens is reached."""
    params = request.sampling_params
    banned: tuple[int, ...] = ()
    num_banned_positions = params.min_tokens - request.num_output_tokens
    if num_banned_positions > 0:
        banned = banned_until_min_tokens(params, request.eos_token_ids)
    return SamplingRequest(request.request_id, params, banned, request.is_beam, max(num_banned_positions, 0))


def prompt_logprobs_request(request: Request, start: int, stop: int) -> PromptLogprobsRequest | None:
    """The prompt tokens that computing [start, stop) predicts, if the sequence needs their logprobs."""
    last = min(stop, request.num_prompt_tokens - 1)  # the row at position p predicts prompt token p + 1
    if not request.needs_prompt_logprobs or start >= last:
        return None
    return PromptLogprobsRequest(request.sampling_params.prompt_logprobs,
                                 tuple(request.prompt_token_ids[start + 1 : last + 1]))


class StepBuilder:
    """Collects one step's decisions as the scheduler makes them; it changes no state of the scheduler."""

    def __init__(self, budget: int) -> None:
        self.budget = budget  # tokens left in this step (max_num_batched_tokens at first)
        self.stalled = False  # with partial preemption, the newest request waits (keeping its blocks)
        self.scheduled: list[ScheduledRequest] = []
        self.allocated: list[tuple[str, tuple[int, ...]]] = []
        self.copies: list[tuple[str, int, int]] = []
        self.preempted: list[str] = []
        self.swapped_out: list[Move] = []
        self.swapped_in: list[Move] = []
        self.truncated: list[tuple[str, int]] = []
        self.forked: list[tuple[str, str]] = []
        self.restarted: list[tuple[str, str]] = []
        self.failed: list[tuple[str, str]] = []
        self.finished: list[tuple[str, str]] = []
        self.freed: list[int] = []
        self.evicted: list[int] = []

    def admit(
        self, request: Request, num_new_tokens: int, block_ids: Sequence[int], allocation: Allocation,
        forks: Sequence[Request] = (),
    ) -> None:
        """Schedule `num_new_tokens` of the sequence, whose table (`block_ids`) `allocation` has just grown. If the
        step reaches its newest token it draws one; so does each of `forks`, the samples just forked from it."""
        self.budget -= num_new_tokens
        start, stop = request.num_computed_tokens, request.num_computed_tokens + num_new_tokens
        sampling = ()
        if stop == request.num_tokens:
            sampling = tuple(sampling_request(r) for r in (request, *forks))
        self.forked += [(request.request_id, child.request_id) for child in forks]
        self.scheduled.append(ScheduledRequest(
            request.request_id, start, num_new_tokens, request.group_id, tuple(request.token_ids(start, stop)),
            tuple(block_ids), sampling, prompt_logprobs=prompt_logprobs_request(request, start, stop),
        ))
        if allocation.new_block_ids:
            self.allocated.append((request.request_id, allocation.new_block_ids))
        if allocation.copy is not None:
            self.copies.append((request.request_id, *allocation.copy))
        self.evicted += allocation.evicted

    def speculate(
        self, index: int, draft_token_ids: tuple[int, ...], block_ids: Sequence[int], allocation: Allocation
    ) -> None:
        """Extend the decode `scheduled[index]` by draft tokens to verify, whose slots `allocation` has just added."""
        work = self.scheduled[index]
        self.budget -= len(draft_token_ids)
        self.scheduled[index] = dataclasses.replace(
            work, num_new_tokens=work.num_new_tokens + len(draft_token_ids), token_ids=work.token_ids + draft_token_ids,
            block_ids=tuple(block_ids), num_spec_tokens=len(draft_token_ids),
        )
        if allocation.new_block_ids:
            self.allocated.append((work.request_id, allocation.new_block_ids))
        self.evicted += allocation.evicted

    def record(self, preemption: Preemption) -> None:
        self.preempted += preemption.request_ids
        self.swapped_out += preemption.swapped_out
        self.freed += preemption.freed
        if preemption.is_partial:
            self.truncated.append((preemption.request_ids[0], preemption.kept_tokens))

    def build(self, step: int, finished_req_ids: Sequence[str] = ()) -> SchedulerOutput:
        return SchedulerOutput(
            step=step,
            scheduled=tuple(self.scheduled),
            allocated=tuple(self.allocated),
            preempted=tuple(self.preempted),
            copies=tuple(self.copies),
            swapped_out=tuple(self.swapped_out),
            swapped_in=tuple(self.swapped_in),
            truncated=tuple(self.truncated),
            forked=tuple(self.forked),
            restarted=tuple(self.restarted),
            failed=tuple(self.failed),
            finished=tuple(self.finished),
            freed=tuple(self.freed),
            evicted=tuple(self.evicted),
            finished_req_ids=tuple(finished_req_ids),
        )
