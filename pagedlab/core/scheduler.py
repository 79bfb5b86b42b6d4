"""The continuous-batching scheduler: at every step, who runs, how many tokens each, and who must wait.

One rule drives it (vLLM V1's): each sequence should compute `num_tokens - num_computed_tokens` more tokens.
Running requests go first, oldest first; then swapped requests come back in; then waiting requests join,
first come first served, while the `max_num_seqs` and `max_num_batched_tokens` budgets and the free blocks
allow. The unit of scheduling is a request's *group* (one sequence, or its samples or beams, which share
blocks): a group's blocks are allocated together, and when they do not fit, the most recently arrived running
group is preempted whole (`pagedlab.core.preemption`). No request is admitted in a step that preempted, and none
while a swapped request waits to come back. The oldest request is therefore never a victim, so requests finish
one after the other: a group that cannot fit even alone is finished with an error instead of waiting forever.

The scheduler decides; `KVCacheManager` allocates; the worker runs; `update_from_output` appends the tokens,
forks samples and beams, and finishes what stopped. It imports no torch.

# Explained in chapters/05_continuous_batching.ipynb
"""

from __future__ import annotations

import bisect
import random
from collections import deque
from collections.abc import Iterable, Mapping, Sequence

from pagedlab.config import EngineConfig
from pagedlab.core.kv_cache_manager import KVCacheManager
from pagedlab.core.preemption import Preemption, PreemptionCostModel, PreemptionMode, preempt_group, preempt_tail
from pagedlab.core.request import Request, RequestStatus
from pagedlab.core.sched_output import BeamDecision, SchedulerOutput, SequenceUpdate, UpdateOutput
from pagedlab.core.scheduler_step import StepBuilder
from pagedlab.core.stats import SchedulerStats
from pagedlab.core.swap_space import SwapSpace
from pagedlab.core.trace import BlockTableSnapshot, SchedulerSnapshot

RUNNING = RequestStatus.RUNNING


def runs_by_group(requests: Iterable[Request]) -> list[list[Request]]:
    """Consecutive requests of the same group, as lists (a queue sorted by `order` keeps groups together)."""
    runs: list[list[Request]] = []
    for request in requests:
        if runs and runs[-1][0].group_id == request.group_id:
            runs[-1].append(request)
        else:
            runs.append([request])
    return runs


class Scheduler:
    """Waiting, running and swapped queues over one `KVCacheManager` (and its `SwapSpace`, if any).

    Invariants:
      - every unfinished sequence is in exactly one of `waiting`, `running` and `swapped`; finished ones in none;
      - `running` and `swapped` are sorted by `order` (arrival, then place in the group), so a group's sequences
        sit together; the running groups reserve at most max_num_seqs sequence slots;
      - a running sequence holds a device block table covering at least its computed tokens; a swapped one a
        CPU table of exactly its computed tokens; a waiting one holds none and has computed none;
      - the block manager's and the swap space's own invariants hold.
    """

    def __init__(
        self,
        config: EngineConfig,
        kv_cache_manager: KVCacheManager,
        swap_space: SwapSpace | None = None,
        cost_model: PreemptionCostModel | None = None,
    ) -> None:
        if config.max_model_len is None:
            raise ValueError("the scheduler needs a resolved max_model_len")
        self.mode = PreemptionMode(config.preemption_mode)
        if self.mode != PreemptionMode.RECOMPUTE and swap_space is None:
            raise ValueError(f"preemption_mode={self.mode.value!r} needs a swap space")
        if self.mode == PreemptionMode.AUTO and cost_model is None:
            raise ValueError("preemption_mode='auto' needs a cost model")
        self.config = config
        self.kv = kv_cache_manager
        self.swap_space = swap_space
        self.cost_model = cost_model
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, list[Request]] = {}  # group_id -> its unfinished sequences
        self.stats = SchedulerStats()
        self._rng = random.Random(config.seed)

    # -- requests -------------------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests or request.group_id in self.groups:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        self.requests[request.request_id] = request
        self.groups[request.group_id] = [request]
        self.waiting.append(request)

    def add_fork(self, parent: Request, child: Request) -> None:
        """Run `child`, just forked from the running `parent`: it shares every block of the parent's table."""
        assert parent.status == RUNNING and child.request_id not in self.requests
        self.kv.fork(parent.request_id, child.request_id)
        self.requests[child.request_id] = child
        self.groups[child.group_id].append(child)
        child.status = RUNNING
        bisect.insort(self.running, child, key=Request.order.fget)

    def unique_id(self, base: str) -> str:
        """`base`, or `base#2`, `base#3`, ... : the first id no unfinished sequence holds."""
        request_id, k = base, 1
        while request_id in self.requests:
            k += 1
            request_id = f"{base}#{k}"
        return request_id

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> tuple[list[Request], list[int]]:
        """Finish sequences wherever they are (aborts, stop strings, errors). Unknown ids are skipped.
        Returns the sequences finished and the device blocks that became free."""
        finished, freed = [], []
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is None:
                continue
            queue = {RUNNING: self.running, RequestStatus.SWAPPED: self.swapped}.get(request.status, self.waiting)
            queue.remove(request)
            if request.status == RequestStatus.SWAPPED:
                self.swap_space.free(request_id)
            request.status = status
            freed += self.kv.free(request_id)
            members = self.groups[request.group_id]
            members.remove(request)
            if not members:
                del self.groups[request.group_id]
            finished.append(request)
        return finished, freed

    def finish_groups(self, group_ids: Iterable[str], status: RequestStatus) -> tuple[list[Request], list[int]]:
        """Finish every sequence of each group (an abort of the user's request, or its failure)."""
        ids = [r.request_id for group_id in group_ids for r in self.groups.get(group_id, ())]
        return self.finish_requests(ids, status)

    # -- one step -------------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        step = StepBuilder(self)
        partial = self.config.enable_partial_preemption

        # 0. For tests (vLLM's trick): preempt the newest running group at random steps (partially: one block).
        forced = self.config.force_preemption_rate
        if self.running and forced and self._rng.random() < forced:
            victims = runs_by_group(self.running)[-1]
            if not (partial and len(victims) == 1 and self._preempt_tail(victims[0], 1, step)):
                self._preempt(victims, step)

        # 1. Running groups, oldest first; the newest groups are preempted when blocks run out.
        for group in runs_by_group(self.running):
            group = [r for r in group if r.status == RUNNING]  # a forced victim has left
            if group and not self._schedule_group(group, step, may_preempt=True):
                break

        # 2. Swapped groups come back, oldest first, when their blocks fit with one block to spare for each
        #    sequence's next token (or at all, when nothing else runs).
        while not (step.preempted or step.stalled) and self.swapped:
            group = runs_by_group(self.swapped)[0]
            ids = [r.request_id for r in group]
            spare = len(group) if self.running else 0
            if self.num_running_seqs + self._seats(group) > self.config.max_num_seqs:
                break
            if not self.swap_space.can_swap_in(ids, spare):
                break
            step.swapped_in += self.swap_space.swap_in(ids)
            for request in group:
                self.swapped.remove(request)
                request.status = RUNNING
                bisect.insort(self.running, request, key=Request.order.fget)
                self.kv.cache_full_blocks(
                    request.request_id, request.num_computed_tokens, request.token_ids, request.cache_salt
                )
            self._schedule_group(group, step, may_preempt=False)

        # 3. Waiting sequences, first come first served, unless this step had to preempt or requests are still
        #    swapped out. With prefix caching a sequence starts from its longest cached prefix.
        while not (step.preempted or step.stalled or self.swapped) and self.waiting and step.budget > 0:
            request = self.waiting[0]
            running = self.groups[request.group_id]
            if self.num_running_seqs - self._seats(running) + self._seats(running, plus=request) > self.config.max_num_seqs:
                break
            hits = self.kv.get_computed_blocks(request.token_ids(0, request.num_tokens), request.cache_salt)
            request.num_computed_tokens = len(hits) * self.kv.block_size
            num_new_tokens = self._num_new_tokens(request, step.budget)
            allocation = None
            if num_new_tokens:
                allocation = self.kv.allocate_slots(request.request_id, request.num_computed_tokens + num_new_tokens, hits)
            if allocation is None:
                request.num_computed_tokens = 0
                break
            self.waiting.popleft()
            self.kv.record_prefix_query(request.num_tokens, len(hits))
            request.status = RUNNING
            bisect.insort(self.running, request, key=Request.order.fget)
            step.admit(request, num_new_tokens, allocation)

        self.stats.num_steps += 1
        return step.build(self.stats.num_steps)

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
            short = self.kv.num_blocks_needed(growths) - self.kv.num_free_blocks
            if short <= 0:
                for request, num_new_tokens in plan:
                    start = request.num_computed_tokens
                    allocation = self.kv.allocate_slots(request.request_id, start + num_new_tokens, write_from=start)
                    assert allocation is not None, "the group's blocks were counted free"
                    step.admit(request, num_new_tokens, allocation)
                return True
            if not may_preempt:
                return True  # a group just swapped in: it runs next step
            victims = runs_by_group(self.running)[-1]
            partial = self.config.enable_partial_preemption
            if victims[0].group_id != group[0].group_id:
                if not (partial and len(victims) == 1 and self._preempt_tail(victims[0], short, step)):
                    self._preempt(victims, step)
            elif partial and len(group) == 1 and step.scheduled:
                step.stalled = True  # the newest: nobody behind it to take blocks from, so it waits its turn
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

    def _too_big(self, group: Sequence[Request]) -> str:
        tokens = max(r.num_tokens for r in group) + 1
        return (
            f"the request needs more KV blocks than the cache holds: its {len(group)} sequences of up to {tokens} "
            f"tokens do not fit in {self.kv.num_blocks} blocks of {self.kv.block_size} even alone; lower "
            "beam_width or max_tokens, or give the engine more KV memory"
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
        preemption = preempt_group(group, self.mode, self.kv, self.swap_space, self.cost_model)
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
                self.groups[root.group_id].remove(request)
            step.restarted.append((root.group_id, root.request_id))
            group = [root]
        for request in group:
            request.status = RequestStatus.WAITING
            bisect.insort(self.waiting, request, key=Request.order.fget)

    def _preempt_tail(self, victim: Request, num_blocks: int, step: StepBuilder) -> bool:
        preemption = preempt_tail(victim, num_blocks, self.kv)
        if preemption is None:
            return False
        step.record(preemption)
        self.stats.record(preemption)
        return True

    # -- sequence slots -------------------------------------------------------------------------------------

    @staticmethod
    def _seats(group: Sequence[Request], plus: Request | None = None) -> int:
        """Sequence slots a group takes while its `group` sequences (and `plus`) run: its reservation (beam
        width, or n before the samples fork) or its running sequences, whichever is more."""
        running = [r for r in group if r.status == RUNNING]
        if plus is not None:
            running.append(plus)
        return max([len(running)] + [r.num_seqs_reserved for r in running]) if running else 0

    @property
    def num_running_seqs(self) -> int:
        return sum(self._seats(group) for group in runs_by_group(self.running))

    # -- after the model ran ---------------------------------------------------------------------------------

    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled: Mapping[str, int],
        beam_decisions: Sequence[BeamDecision] = (),
        failed: Mapping[str, str] | None = None,
    ) -> UpdateOutput:
        """Advance each scheduled sequence by what was computed, append the sampled tokens, apply the beam steps
        (fork the parents chosen twice, prune the others), and finish what stopped. `failed` maps the groups
        whose processing raised to the error: they are finished first."""
        freed = self.kv.release_copy_sources([(source, copy) for _, source, copy in output.copies])
        failed = dict(failed or {})
        finished, failed_freed = self.finish_groups(failed, RequestStatus.FINISHED_ERROR)
        freed += failed_freed
        updates = [SequenceUpdate(r.request_id, r.group_id, (), "error") for r in finished]
        for scheduled in output.scheduled:
            request = self.requests.get(scheduled.request_id)
            if request is None or request.status != RUNNING:
                continue  # aborted, failed or finished after it was scheduled
            request.num_computed_tokens += scheduled.num_new_tokens
            self.kv.cache_full_blocks(
                request.request_id, request.num_computed_tokens, request.token_ids, request.cache_salt
            )
            for target in scheduled.sampling:
                sequence = self.requests[target.request_id]
                sequence.num_computed_tokens = request.num_computed_tokens  # a sample forked this step
                if not sequence.is_beam:
                    freed += self._append(sequence, sampled[sequence.request_id], updates)
        forked, beam_ids = [], []
        for decision in beam_decisions:
            if decision.group_id in self.groups:
                beam_ids.append((decision.group_id, self._apply_beam_decision(decision, forked, updates, freed)))
        return UpdateOutput(tuple(updates), tuple(forked), tuple(beam_ids), tuple(failed.items()), tuple(freed))

    def _append(self, sequence: Request, token_id: int, updates: list[SequenceUpdate]) -> list[int]:
        sequence.append_token(token_id)
        status = sequence.check_stop(self.config.max_model_len)
        freed = self.finish_requests([sequence.request_id], status)[1] if status is not None else []
        updates.append(SequenceUpdate(
            sequence.request_id, sequence.group_id, (token_id,), status.finish_reason if status else None,
            sequence.stop_reason if status == RequestStatus.FINISHED_STOPPED else None,
        ))  # fmt: skip
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

    def snapshot(self) -> SchedulerSnapshot:
        """The queues, the block tables of both pools and the free counts, frozen (what the trace keeps)."""
        kv, swap = self.kv, self.swap_space

        def tables(block_tables) -> tuple[BlockTableSnapshot, ...]:
            return tuple(BlockTableSnapshot(rid, tuple(t.block_ids), t.num_tokens) for rid, t in block_tables.items())

        return SchedulerSnapshot(
            block_tables=tables(kv.block_tables),
            waiting=tuple(r.request_id for r in self.waiting),
            running=tuple(r.request_id for r in self.running),
            swapped=tuple(r.request_id for r in self.swapped),
            num_free_blocks=kv.num_free_blocks,
            cached_blocks=tuple(sorted(kv.pool.hash_to_block.values())) if kv.enable_prefix_caching else (),
            cpu_block_tables=tables(swap.block_tables) if swap else (),
            num_free_cpu_blocks=swap.num_free_blocks if swap else 0,
        )

    # -- checks ---------------------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        self.kv.check_invariants()
        if self.swap_space is not None:
            self.swap_space.check_invariants()
        queues = [self.waiting, self.running, self.swapped]
        ids = [r.request_id for queue in queues for r in queue]
        assert len(ids) == len(set(ids)) and set(ids) == set(self.requests), "a sequence is lost, twice or finished"
        assert {r.request_id for group in self.groups.values() for r in group} == set(self.requests)
        assert all(r.group_id == group_id for group_id, group in self.groups.items() for r in group)
        assert self.num_running_seqs <= self.config.max_num_seqs, "the running groups take too many slots"
        for queue in (self.running, self.swapped):
            orders = [r.order for r in queue]
            assert orders == sorted(orders), "running or swapped is not in arrival order"
        for request in self.swapped:
            assert request.status == RequestStatus.SWAPPED
            assert request.request_id not in self.kv.block_tables, f"swapped {request.request_id} holds device blocks"
            assert self.swap_space.block_tables[request.request_id].num_tokens == request.num_computed_tokens
        for request in self.running:
            assert request.status == RUNNING
            table = self.kv.block_tables.get(request.request_id)
            assert table is not None and table.num_tokens >= request.num_computed_tokens
        for request in self.waiting:
            assert request.status == RequestStatus.WAITING
            assert request.request_id not in self.kv.block_tables, f"waiting {request.request_id} holds blocks"
            assert request.num_computed_tokens == 0
