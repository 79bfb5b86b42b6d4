"""The continuous-batching scheduler: at every step, who runs, how many tokens each, and who must wait.

One rule drives it (vLLM V1's): each sequence should compute `num_tokens - num_computed_tokens` more tokens.
Running requests go first, oldest first; then swapped requests come back in; then waiting requests join,
first come first served, while the `max_num_seqs` and `max_num_batched_tokens` budgets and the free blocks
allow. The unit of scheduling is a request's *group* (one sequence, or its samples or beams, which share
blocks): a group's blocks are allocated together, and when they do not fit, the most recently arrived running
group is preempted whole (`pagedlab.core.preemption`). No request is admitted in a step that preempted, and none
while a swapped request waits to come back. The oldest request is therefore never a victim, so requests finish
one after the other: a group that cannot fit even alone is finished with an error instead of waiting forever.

Under pipeline parallelism the core keeps up to `max_concurrent_batches` (P) batches in flight, each scheduled
before the one before it has come back (`pagedlab.core.engine_core`). The scheduler then gives each batch about
1/P of the groups, skips the groups in flight (`in_flight`: their tokens are not known yet), and never preempts
one: a group short of blocks that only a batch in flight could give waits for it (`stalled`). A step with nothing
to schedule while batches are in flight is no step: `schedule()` returns None. Blocks freed while a batch is in
flight (an abort) may go to the next batch at once, because every stage runs its batches in order; for the same
reason a batch's full blocks are cached when it is scheduled, so that the next batch finds a prefix in flight.

The scheduler decides; `KVCacheManager` allocates; the worker runs; `update_from_output` appends the tokens,
forks samples and beams, and finishes what stopped. It imports no torch.

# Explained in chapters/05_continuous_batching.ipynb
"""

from __future__ import annotations

import bisect
import dataclasses
import random
from collections.abc import Mapping, Sequence

from pagedlab.config import EngineConfig
from pagedlab.core.kv_cache_manager import Allocation, KVCacheManager
from pagedlab.core.preemption import PreemptionCostModel, PreemptionMode, preempt_group, preempt_tail
from pagedlab.core.request import Request, RequestStatus
from pagedlab.core.sched_output import (
    BeamDecision,
    ModelRunnerOutput,
    SchedulerOutput,
    SequenceUpdate,
    UpdateOutput,
)
from pagedlab.core.scheduler_state import RUNNING, SchedulerState, runs_by_group
from pagedlab.core.scheduler_step import StepBuilder
from pagedlab.core.speculation import SpeculativeScheduling
from pagedlab.core.swap_space import SwapSpace


class Scheduler(SchedulerState, SpeculativeScheduling):
    """Decides each step over the queues of `SchedulerState` (which keeps the books and the invariants), and
    applies each step's results. It is the only thing that changes the scheduler's state."""

    def __init__(
        self,
        config: EngineConfig,
        kv_cache_manager: KVCacheManager,
        swap_space: SwapSpace | None = None,
        cost_model: PreemptionCostModel | None = None,
        max_concurrent_batches: int = 1,
    ) -> None:
        if config.max_model_len is None:
            raise ValueError("the scheduler needs a resolved max_model_len")
        self.mode = PreemptionMode(config.preemption_mode)
        if self.mode != PreemptionMode.RECOMPUTE and swap_space is None:
            raise ValueError(f"preemption_mode={self.mode.value!r} needs a swap space")
        if self.mode == PreemptionMode.AUTO and cost_model is None:
            raise ValueError("preemption_mode='auto' needs a cost model")
        super().__init__(kv_cache_manager, swap_space, config.max_num_seqs)
        self.config = config
        self.cost_model = cost_model
        self.max_concurrent_batches = max_concurrent_batches
        self._rng = random.Random(config.seed)

    # -- one step -------------------------------------------------------------------------------------------

    def schedule(self, draft_token_ids: Mapping[str, Sequence[int]] | None = None) -> SchedulerOutput | None:
        """One step's decisions. `draft_token_ids`: proposed tokens of running decodes (speculative decoding).
        None when batches are in flight and nothing else can run until one comes back."""
        step = StepBuilder(self.config.max_num_batched_tokens)
        partial = self.config.enable_partial_preemption
        full = self._micro_batch_limit()

        # 0. For tests (vLLM's trick): preempt the newest running group at random steps (partially: one block),
        #    never the only one, so that the oldest request always progresses (nor one in flight).
        forced = self.config.force_preemption_rate
        if self.running and forced and self._rng.random() < forced and len(runs_by_group(self.running)) > 1:
            victims = self._newest_preemptable(after_oldest=True)
            if victims and not (partial and len(victims) == 1 and self._preempt_tail(victims[0], 1, step)):
                self._preempt(victims, step)

        # 1. Running groups, oldest first; the newest groups are preempted when blocks run out.
        for group in runs_by_group(self.running):
            if group[0].group_id in self.in_flight:
                continue
            if full(step):
                break
            group = [r for r in group if r.status == RUNNING]  # a forced victim has left
            if group and not self._schedule_group(group, step, may_preempt=True):
                break

        # 2. Swapped groups come back, oldest first, when their blocks fit with one block to spare for each
        #    sequence's next token (or at all, when nothing else runs: then, if a group does not fit together, its
        #    sequences come back one by one).
        while not (step.preempted or step.stalled or full(step)) and self.swapped:
            group = runs_by_group(self.swapped)[0]
            if group[0].group_id in self.in_flight:  # some of its samples run: the others come back after them
                break
            if not self._can_swap_in(group) and not self.running and len(group) > 1:
                group = group[:1]
            if not self._can_swap_in(group):
                break
            step.swapped_in += self.swap_space.swap_in([r.request_id for r in group])
            for request in group:
                self.swapped.remove(request)
                request.status = RUNNING
                bisect.insort(self.running, request, key=Request.order.fget)
                self.kv_cache_manager.cache_full_blocks(
                    request.request_id, request.num_computed_tokens, request.token_ids, request.cache_salt,
                    request.prompt_block_hashes,
                )
            self._schedule_group(group, step, may_preempt=False)

        # 3. Waiting sequences, first come first served, unless this step had to preempt or requests are still
        #    swapped out. With prefix caching a sequence starts from its longest cached prefix (unless it needs
        #    its prompt's logprobs: then it computes every prompt token, as in vLLM).
        while not (step.preempted or step.stalled or self.swapped or full(step)) and self.waiting and step.budget > 0:
            request = self.waiting[0]
            if request.group_id in self.in_flight:  # a sample waiting for its group's batch, or an id re-used
                break
            if self.num_running_seqs + self.seats_to_run([request]) > self.config.max_num_seqs:
                break
            hits = [] if request.needs_prompt_logprobs else self.kv_cache_manager.get_computed_blocks(
                request.token_ids(0, request.num_tokens), request.cache_salt, request.prompt_block_hashes
            )
            request.num_computed_tokens = len(hits) * self.kv_cache_manager.block_size
            num_new_tokens = self._num_new_tokens(request, step.budget)
            allocation = None
            if num_new_tokens:
                allocation = self.kv_cache_manager.allocate_slots(
                    request.request_id, request.num_computed_tokens + num_new_tokens, hits
                )
            if allocation is None:
                request.num_computed_tokens = 0
                break
            self.waiting.popleft()
            self.kv_cache_manager.record_prefix_query(request.num_tokens, len(hits))
            if request.num_cached_tokens is None:
                request.num_cached_tokens = request.num_computed_tokens
            request.status = RUNNING
            bisect.insort(self.running, request, key=Request.order.fget)
            self._admit(request, num_new_tokens, allocation, step)

        # 4. Speculative decoding: the decodes scheduled above verify their draft tokens in the same pass, from the
        #    budget and free blocks nobody else took (`pagedlab.core.speculation`); never in a step that preempted.
        if draft_token_ids and not (step.preempted or step.stalled):
            self._speculate(step, draft_token_ids)

        output = step.build(self.stats.num_steps + 1, self.finished_req_ids)
        idle = not (output.scheduled or output.preempted or output.swapped_in or output.failed)
        if idle and self.in_flight:
            return None  # wait for a batch in flight (this decided nothing, changed nothing)
        if idle and self.requests:
            raise RuntimeError(f"the scheduler made no progress (a bug): {self.requests}")
        self.stats.num_steps += 1
        self.finished_req_ids = []
        if self.max_concurrent_batches > 1:
            groups = {s.group_id for s in output.scheduled}
            assert not groups & self.in_flight, "a group in two batches in flight"
            self.in_flight |= groups
            self._cache_scheduled(output)
        return output

    def _cache_scheduled(self, output: SchedulerOutput) -> None:
        """With batches in flight, cache a step's full blocks when it is scheduled rather than when it comes back
        (as vLLM V1 does at allocation): a request admitted to a later batch, which every stage runs after this
        one, then finds the prefix this one computes. (Not within the batch: one pass does not read its own
        writes of other sequences.)"""
        for work in output.scheduled:
            request = self.requests[work.request_id]
            self.kv_cache_manager.cache_full_blocks(
                request.request_id, work.num_computed_tokens + work.num_new_tokens - work.num_spec_tokens,
                request.token_ids, request.cache_salt, request.prompt_block_hashes,
            )

    def _micro_batch_limit(self):
        """A test of whether the step has its share of the groups: with P batches in flight, about 1/P of the
        running, swapped and waiting groups each (one batch with every group would leave the others nothing)."""
        depth = self.max_concurrent_batches
        if depth == 1:
            return lambda step: False
        groups = len(runs_by_group(self.running)) + len(runs_by_group(self.swapped)) + len(self.waiting)
        share = max(1, -(-groups // depth))
        return lambda step: len({s.group_id for s in step.scheduled}) >= share

    def _newest_preemptable(self, after_oldest: bool = False) -> list[Request] | None:
        """The newest running group not in a batch in flight (`after_oldest`: nor the oldest running group)."""
        groups = runs_by_group(self.running)[1 if after_oldest else 0:]
        return next((g for g in reversed(groups) if g[0].group_id not in self.in_flight), None)

    def _schedule_group(self, group: list[Request], step: StepBuilder, may_preempt: bool) -> bool:
        """Give a running group's sequences their tokens, allocating their blocks together. When blocks are
        short, preempt the newest running groups (or, for the newest group itself, wait or fail). Returns False
        when scheduling of running groups must stop (this group was preempted or stalled)."""
        while True:
            budget, plan = step.budget, []
            for request in group:
                num_new_tokens = self._num_new_tokens(request, budget)
                if num_new_tokens:
                    plan.append((request, num_new_tokens))
                    budget -= num_new_tokens
            growths = [(r.request_id, r.num_computed_tokens + n, r.num_computed_tokens) for r, n in plan]
            short = self.kv_cache_manager.num_blocks_needed(growths) - self.kv_cache_manager.num_free_blocks
            if short <= 0:
                for request, num_new_tokens in plan:
                    start = request.num_computed_tokens
                    allocation = self.kv_cache_manager.allocate_slots(
                        request.request_id, start + num_new_tokens, write_from=start
                    )
                    assert allocation is not None, "the group's blocks were counted free"
                    self._admit(request, num_new_tokens, allocation, step)
                return True
            if not may_preempt:
                return True  # a group just swapped in: it runs next step
            victims = self._newest_preemptable()  # this group, at the newest
            partial = self.config.enable_partial_preemption
            if victims[0].group_id != group[0].group_id:
                if not (partial and len(victims) == 1 and self._preempt_tail(victims[0], short, step)):
                    self._preempt(victims, step)
            elif partial and len(group) == 1 and step.scheduled:
                step.stalled = True  # the newest: nobody behind it to take blocks from, so it waits its turn
                return False
            elif self.in_flight:
                step.stalled = True  # the blocks it needs are held by groups in flight: wait for their batch
                return False
            elif len(self.running) > len(group):
                self._preempt(group, step)  # older groups hold the blocks: wait for them to finish
                return False
            elif len(group) > 1 and not group[0].is_beam:
                self._preempt(group[-1:], step)  # samples alone that do not fit together: they run one by one
                group = group[:-1]
            else:
                step.failed.append((group[0].group_id, self._too_big(group)))
                finished, freed = self.finish_groups([group[0].group_id], RequestStatus.FINISHED_ERROR)
                step.finished += [(r.request_id, "error") for r in finished]
                step.freed += freed
                return False

    def _admit(self, request: Request, num_new_tokens: int, allocation: Allocation, step: StepBuilder) -> None:
        """Put the sequence in the step. When the step reaches the end of an n > 1 request's prompt, its other
        n - 1 samples are forked first: running, sharing all its blocks; sample i draws with seed + i when a seed
        was given, so it equals a separate request with that seed."""
        forks = []
        if request.needs_fork and request.num_computed_tokens + num_new_tokens == request.num_tokens:
            params = request.sampling_params
            for i in range(1, params.n):
                child_params = dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
                child = request.fork(self.unique_id(f"{request.group_id}:{i}"), i, child_params)
                self.add_fork(request, child)
                forks.append(child)
            request.forked = True
        table = self.kv_cache_manager.block_tables[request.request_id]
        step.admit(request, num_new_tokens, table.block_ids, allocation, forks)

    def _can_swap_in(self, group: Sequence[Request]) -> bool:
        """Room for the group in the sequence slots and in the device pool (with a block to spare for each
        sequence's next token while others run)."""
        if self.num_running_seqs + self.seats_to_run(group) > self.config.max_num_seqs:
            return False
        spare = len(group) if self.running else 0
        return self.swap_space.can_swap_in([r.request_id for r in group], spare)

    def _too_big(self, group: Sequence[Request]) -> str:
        tokens = max(r.num_tokens for r in group) + 1
        return (
            f"the request needs more KV blocks than the cache holds: its {len(group)} sequences of up to {tokens} "
            f"tokens do not fit in {self.kv_cache_manager.num_blocks} blocks of {self.kv_cache_manager.block_size} "
            "even alone; lower beam_width or max_tokens, or give the engine more KV memory"
        )

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        """How many tokens the sequence may compute this step, within `budget` (0 = not this step)."""
        remaining = request.num_tokens - request.num_computed_tokens
        chunk = self.config.enable_chunked_prefill or remaining > self.config.max_num_batched_tokens
        if chunk:  # a recomputed request longer than a whole step is chunked even without chunked prefill
            return min(remaining, budget)
        return remaining if remaining <= budget else 0

    def _preempt(self, group: list[Request], step: StepBuilder) -> None:
        """Preempt a running group whole (see `pagedlab.core.preemption`) and move it to its new queue."""
        preemption = preempt_group(group, self.mode, self.kv_cache_manager, self.swap_space, self.cost_model)
        step.record(preemption)
        self.stats.record(preemption)
        for request in group:
            self.running.remove(request)
        if preemption.mode == PreemptionMode.SWAP:
            for request in group:
                request.status = RequestStatus.SWAPPED
                bisect.insort(self.swapped, request, key=Request.order.fget)
            return
        if preemption.restarted is not None:  # a beam search starts again from its first beam's prompt
            root, dropped = group[0], group[1:]
            for request in dropped:
                request.status = RequestStatus.FINISHED_PRUNED
                del self.requests[request.request_id]
                self.finished_req_ids.append(request.request_id)
                self.groups[root.group_id].remove(request)
            step.restarted.append((root.group_id, root.request_id))
            group = [root]
        for request in group:
            request.status = RequestStatus.WAITING
            bisect.insort(self.waiting, request, key=Request.order.fget)

    def _preempt_tail(self, victim: Request, num_blocks: int, step: StepBuilder) -> bool:
        preemption = preempt_tail(victim, num_blocks, self.kv_cache_manager)
        if preemption is None:
            return False
        step.record(preemption)
        self.stats.record(preemption)
        return True

    # -- after the model ran ---------------------------------------------------------------------------------

    def update_from_output(
        self, output: SchedulerOutput, runner_output: ModelRunnerOutput, beam_decisions: Sequence[BeamDecision] = (),
    ) -> UpdateOutput:
        """Apply the step's results: finish the groups whose processing raised, advance each scheduled sequence by
        what was computed, append its new tokens (for a verified chunk, the accepted drafts and the token after
        them; the rejected drafts' slots are rolled back), apply the beam steps (fork the parents chosen twice,
        prune the others), and finish what stopped."""
        self.in_flight -= {s.group_id for s in output.scheduled}
        freed = self.kv_cache_manager.release_copy_sources([(source, copy) for _, source, copy in output.copies])
        finished, failed_freed = self.finish_groups(runner_output.errors, RequestStatus.FINISHED_ERROR)
        freed += failed_freed
        updates = [SequenceUpdate(r.request_id, r.group_id, (), "error") for r in finished]
        verified, rolled_back = [], []
        new_token_ids = runner_output.sampled_token_ids
        for scheduled in output.scheduled:
            request = self.requests.get(scheduled.request_id)
            if request is None or request.status != RUNNING:
                continue  # aborted, failed or finished after it was scheduled
            if scheduled.num_spec_tokens:
                tokens = new_token_ids[request.request_id]
                rollback_freed, rollback = self._accept(request, scheduled, tokens, updates)
                freed += rollback_freed
                verified.append((request.request_id, scheduled.num_spec_tokens, len(tokens) - 1))
                rolled_back.append((request.request_id, rollback.slots))
                continue
            request.num_computed_tokens += scheduled.num_new_tokens
            self.kv_cache_manager.cache_full_blocks(
                request.request_id, request.num_computed_tokens, request.token_ids, request.cache_salt,
                request.prompt_block_hashes,
            )
            for target in scheduled.sampling:
                sequence = self.requests[target.request_id]
                sequence.num_computed_tokens = request.num_computed_tokens  # a sample forked this step
                if not sequence.is_beam:
                    (token_id,) = new_token_ids[sequence.request_id]
                    freed += self._append(sequence, token_id, updates)
        forked, beam_ids = [], []
        for decision in beam_decisions:
            if decision.group_id in self.groups:
                beam_ids.append((decision.group_id, self._apply_beam_decision(decision, forked, updates, freed)))
        failed = (*output.failed, *runner_output.errors.items())
        return UpdateOutput(
            tuple(updates), tuple(forked), tuple(beam_ids), failed, tuple(freed), tuple(verified), tuple(rolled_back),
        )

    def _append(self, sequence: Request, token_id: int, updates: list[SequenceUpdate]) -> list[int]:
        sequence.append_token(token_id)
        status = sequence.check_stop(self.config.max_model_len)
        freed = self.finish_requests([sequence.request_id], status)[1] if status is not None else []
        updates.append(SequenceUpdate(
            sequence.request_id, sequence.group_id, (token_id,), status.finish_reason if status else None,
            sequence.stop_reason if status == RequestStatus.FINISHED_STOPPED else None, sequence.num_cached_tokens,
        ))
        return freed

    def _apply_beam_decision(self, decision: BeamDecision, forked: list, updates: list, freed: list) -> tuple:
        """Extend each chosen beam in place with its first continuation, fork it for the others (the fork shares
        its blocks, copy-on-write on the partial last block), and finish the beams nobody chose."""
        members = {r.request_id: r for r in self.groups[decision.group_id]}
        extended, ids = set(), []
        for parent_id, token_id in decision.continuations:
            parent = members[parent_id]
            if parent_id not in extended:
                extended.add(parent_id)
                ids.append(parent_id)
                continue
            index = max(r.sample_index for r in self.groups[decision.group_id]) + 1
            child = parent.fork(self.unique_id(f"{decision.group_id}:b{index}"), index, parent.sampling_params)
            self.add_fork(parent, child)  # before the parent grows: they share its blocks
            child.append_token(token_id)
            forked.append((parent_id, child.request_id))
            updates.append(SequenceUpdate(child.request_id, child.group_id, (token_id,)))
            ids.append(child.request_id)
        for parent_id, token_id in decision.continuations:
            if parent_id in extended:
                extended.discard(parent_id)
                members[parent_id].append_token(token_id)
                updates.append(SequenceUpdate(parent_id, decision.group_id, (token_id,)))
        finished, pruned_freed = self.finish_requests(decision.pruned, RequestStatus.FINISHED_PRUNED)
        freed += pruned_freed
        updates += [SequenceUpdate(r.request_id, r.group_id, (), "pruned") for r in finished]
        return tuple(ids)

