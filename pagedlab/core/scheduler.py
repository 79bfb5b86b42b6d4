"""The continuous-batching scheduler: at every step, who runs, how many tokens each, and who must wait.

One rule drives it (vLLM V1's): each request should compute `num_tokens - num_computed_tokens` more tokens.
Running requests go first, oldest first; then swapped requests come back in; then waiting requests join,
first come first served, while the `max_num_seqs` and `max_num_batched_tokens` budgets and the free blocks
allow. When a running request needs a block and none is free, the most recently arrived running request is
preempted (`pagedlab.core.preemption`): either its blocks are freed and it goes back to the front of the
waiting queue to be recomputed later (its generated tokens are kept), or they are swapped out to the CPU
pool and it waits in the swapped queue. No request is admitted in a step that preempted, and none while a
swapped request waits to come back.

With `enable_partial_preemption`, the victim gives up only the last blocks the request needs and keeps
running from the rest (recomputing its lost tail later as a chunk); the newest request, when it cannot grow
and others ran this step, waits with its blocks instead of preempting itself.

The scheduler decides; `KVCacheManager` allocates; the model runner runs. It imports no torch.

# Explained in chapters/05_continuous_batching.ipynb
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import random

from pagedlab.core.kv_cache_manager import KVCacheManager
from pagedlab.core.preemption import PreemptionCostModel, PreemptionMode
from pagedlab.core.request import Request, RequestStatus
from pagedlab.core.swap_space import Move, SwapSpace


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = False
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE
    enable_partial_preemption: bool = False  # take only the tail blocks needed from the victim (see `_preempt_tail`)
    force_preemption_rate: float = 0.0  # for tests: preempt the newest running request in this share of steps
    seed: int = 0  # seeds the forced preemptions


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: compute tokens [num_computed_tokens, num_computed_tokens + num_new_tokens)."""

    request_id: str
    num_computed_tokens: int
    num_new_tokens: int
    samples: bool  # the step reaches the request's newest token, so a new token is sampled

    @property
    def is_decode(self) -> bool:
        """One query token: attention reads all of it from the cache (a decode, or a one-token chunk)."""
        return self.num_new_tokens == 1


@dataclass(frozen=True)
class SchedulerOutput:
    step: int
    scheduled: tuple[ScheduledRequest, ...]
    allocated: tuple[tuple[str, tuple[int, ...]], ...]  # (request_id, blocks added to its table)
    preempted: tuple[str, ...]
    copies: tuple[tuple[str, int, int], ...] = ()  # copy-on-write: (request_id, source block, its copy)
    swapped_out: tuple[Move, ...] = ()  # (request_id, ((device block, cpu block), ...)), copied before the step
    swapped_in: tuple[Move, ...] = ()  # (request_id, ((cpu block, device block), ...)), copied before the step
    truncated: tuple[tuple[str, int], ...] = ()  # partial preemptions: (request_id, tokens it keeps)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class UpdateOutput:
    appended: tuple[tuple[str, int], ...]  # (request_id, token_id) sampled this step
    finished: tuple[Request, ...]
    forked: tuple[tuple[str, str], ...] = ()  # (parent, child) sequences that now share blocks


class Scheduler:
    """Waiting, running and swapped queues over one `KVCacheManager` (and its `SwapSpace`, if any).

    Invariants:
      - every unfinished request is in exactly one of `waiting`, `running` and `swapped`; finished ones in none;
      - `running` and `swapped` are sorted by arrival (then sample index); `running` counts at most
        max_num_seqs sequences (an n > 1 request that has not forked yet counts n);
      - a running request holds a device block table covering at least its computed tokens; a swapped one
        holds a CPU table of exactly its computed tokens; a waiting one holds none and has computed none;
      - the block manager's and the swap space's own invariants hold.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        swap_space: SwapSpace | None = None,
        cost_model: PreemptionCostModel | None = None,
    ) -> None:
        if config.preemption_mode != PreemptionMode.RECOMPUTE and swap_space is None:
            raise ValueError(f"preemption_mode={config.preemption_mode.value!r} needs a swap space")
        if config.preemption_mode == PreemptionMode.AUTO and cost_model is None:
            raise ValueError("preemption_mode='auto' needs a cost model")
        self.config = config
        self.kv = kv_cache_manager
        self.swap_space = swap_space
        self.cost_model = cost_model
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        self.num_preemptions = 0  # preemptions: whole (by either mode) and partial
        self.num_preemptions_by_mode = {PreemptionMode.RECOMPUTE: 0, PreemptionMode.SWAP: 0}
        self.num_preemptions_partial = 0  # of which partial: only the victim's tail blocks were taken
        self.num_recomputed_tokens = 0  # computed tokens whose KV a recompute preemption dropped
        self._rng = random.Random(config.seed)
        self._freed: list[int] = []  # blocks freed since the last `take_freed_blocks()`
        self._step_scheduled: set[str] = set()  # requests already given work in the step being scheduled
        self._swapped_out: list[Move] = []
        self._truncated: list[tuple[str, int]] = []

    # -- queues -------------------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish a request wherever it is (aborts, stop strings). Returns it, or None if it is unknown."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.SWAPPED:
            self.swapped.remove(request)
            self.swap_space.free(request_id)
        else:
            self.waiting.remove(request)
        request.status = status
        self._freed.extend(self.kv.free(request_id))
        return request

    def add_fork(self, parent: Request, child: Request) -> None:
        """Queue `child`, a copy of `parent`: running and sharing all its blocks, or, if the parent was
        preempted, waiting right behind it (to be recomputed like it)."""
        assert not parent.is_finished and child.request_id not in self.requests
        self.requests[child.request_id] = child
        assert parent.status != RequestStatus.SWAPPED, "a swapped sequence does not fork"
        if parent.status == RequestStatus.RUNNING:
            child.num_computed_tokens = parent.num_computed_tokens
            self.kv.fork(parent.request_id, child.request_id)
            child.status = RequestStatus.RUNNING
            bisect.insort(self.running, child, key=Request.order.fget)
        else:
            child.num_computed_tokens = 0
            child.status = RequestStatus.WAITING
            self.waiting.insert(self.waiting.index(parent) + 1, child)

    def take_freed_blocks(self) -> tuple[int, ...]:
        freed, self._freed = tuple(self._freed), []
        return freed

    # -- one step -----------------------------------------------------------------------------------------

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        """How many tokens the request may compute this step, within `budget` (0 = not this step)."""
        remaining = request.num_tokens - request.num_computed_tokens
        chunk = self.config.enable_chunked_prefill or remaining > self.config.max_num_batched_tokens
        if chunk:  # a recomputed request longer than a whole step is chunked even without chunked prefill
            return min(remaining, budget)
        return remaining if remaining <= budget else 0

    def _preemption_mode(self, victim: Request) -> PreemptionMode:
        mode = self.config.preemption_mode
        if mode == PreemptionMode.AUTO:
            num_blocks = len(self.kv.block_tables[victim.request_id].block_ids)
            mode = self.cost_model.choose(num_blocks, victim.num_computed_tokens)
        return mode

    def _preempt(self, victim: Request, current: Request | None = None) -> list[str]:
        """Preempt `victim`, by swap or recompute; return the ids of the sequences preempted.

        A swap takes along the victim's group (its n samples or beams) that has not run yet this step and
        arrived after `current` (the request being scheduled, which must keep running to make progress), so
        that their shared blocks stay shared. When the CPU pool has no room, only the victim goes, to be
        recomputed."""
        if self._preemption_mode(victim) == PreemptionMode.SWAP:
            group = [
                r for r in self.running
                if r is victim or (r.arrival_index == victim.arrival_index and r.request_id not in self._step_scheduled
                                   and (current is None or r.order > current.order))
            ]  # fmt: skip
            ids = [r.request_id for r in group]
            if self.swap_space.can_swap_out(ids):
                moves, freed = self.swap_space.swap_out(ids)
                self._swapped_out.extend(moves)
                self._freed.extend(freed)
                for request in group:
                    self.running.remove(request)
                    request.status = RequestStatus.SWAPPED
                    request.num_preemptions += 1
                    bisect.insort(self.swapped, request, key=Request.order.fget)
                self.num_preemptions += len(group)
                self.num_preemptions_by_mode[PreemptionMode.SWAP] += len(group)
                return ids
        self._recompute(victim)
        return [victim.request_id]

    def _preempt_tail(self, victim: Request, num_blocks: int) -> bool:
        """Partial preemption: take from `victim` only the last blocks whose release frees `num_blocks`.

        The victim keeps running from the full blocks it keeps and recomputes the rest of its tokens as a
        prefill chunk when room comes back; its first block always stays (else it is a whole preemption).

            before:  victim [4, 9, 2, 7]  14 tokens computed        the current request needs 2 blocks
            after:   victim [4, 9]         8 tokens computed        blocks 2 and 7 are free; 6 tokens to redo

        Returns False, changing nothing, when its unshared tail blocks are too few."""
        num_released = self.kv.num_tail_blocks_to_release(victim.request_id, num_blocks)
        if num_released is None:
            return False
        num_kept = len(self.kv.block_tables[victim.request_id].block_ids) - num_released
        self._freed.extend(self.kv.truncate(victim.request_id, num_kept))
        num_tokens_kept = min(victim.num_computed_tokens, num_kept * self.kv.block_size)
        self.num_recomputed_tokens += victim.num_computed_tokens - num_tokens_kept
        victim.num_computed_tokens = num_tokens_kept
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.num_preemptions_partial += 1
        self._truncated.append((victim.request_id, num_tokens_kept))
        return True

    def _recompute(self, request: Request, behind: Request | None = None) -> None:
        """Recompute-style preemption: free every block; the request re-prefills all its tokens later.

        It goes back into the waiting queue in arrival order (in front of everything that arrived after it,
        which is usually everything waiting), or right `behind` a given waiting request."""
        self.running.remove(request)
        self._freed.extend(self.kv.free(request.request_id))
        request.status = RequestStatus.WAITING
        self.num_recomputed_tokens += request.num_computed_tokens
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.num_preemptions_by_mode[PreemptionMode.RECOMPUTE] += 1
        if behind is None:
            bisect.insort(self.waiting, request, key=Request.order.fget)
        else:
            self.waiting.insert(self.waiting.index(behind) + 1, request)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        allocated: list[tuple[str, tuple[int, ...]]] = []
        preempted: list[str] = []
        swapped_in: list[Move] = []
        self._step_scheduled = set()

        def admit(request: Request, num_new_tokens: int, new_blocks: list[int]) -> None:
            nonlocal budget
            budget -= num_new_tokens
            start = request.num_computed_tokens
            samples = start + num_new_tokens == request.num_tokens
            scheduled.append(ScheduledRequest(request.request_id, start, num_new_tokens, samples))
            self._step_scheduled.add(request.request_id)
            if new_blocks:
                allocated.append((request.request_id, tuple(new_blocks)))

        def try_schedule(request: Request) -> None:
            """Give a running request its tokens if the budget and the free blocks allow (no preemption)."""
            num_new_tokens = self._num_new_tokens(request, budget)
            if num_new_tokens:
                start = request.num_computed_tokens
                new_blocks = self.kv.allocate_slots(request.request_id, start + num_new_tokens, write_from=start)
                if new_blocks is not None:
                    admit(request, num_new_tokens, new_blocks)

        partial = self.config.enable_partial_preemption
        stalled = False  # with partial preemption, the newest request waits (keeping its blocks) when it cannot grow

        # 0. For tests (vLLM's trick): preempt the newest running request at random steps (partially: one block).
        forced = self.config.force_preemption_rate
        if self.running and forced and self._rng.random() < forced:
            victim = self.running[-1]
            if partial and self._preempt_tail(victim, 1):
                preempted.append(victim.request_id)
            else:
                preempted += self._preempt(victim)

        # 1. Running requests, oldest first; preempt the newest when blocks run out.
        i = 0
        while i < len(self.running):
            request = self.running[i]
            num_new_tokens = self._num_new_tokens(request, budget)
            if num_new_tokens == 0:
                i += 1
                continue
            start = request.num_computed_tokens
            new_blocks = self.kv.allocate_slots(request.request_id, start + num_new_tokens, write_from=start)
            while new_blocks is None:
                victim = self.running[-1]
                if partial and victim is request and scheduled:
                    stalled = True  # the newest: nobody behind it to take blocks from, so it waits its turn
                    break
                num_short = self.kv.num_blocks_short(request.request_id, start + num_new_tokens, write_from=start)
                if partial and self._preempt_tail(victim, num_short):
                    preempted.append(victim.request_id)
                else:
                    preempted += self._preempt(victim, current=request)
                if request.status != RequestStatus.RUNNING:
                    break  # the request preempted itself: it was the newest, nothing after it runs
                new_blocks = self.kv.allocate_slots(request.request_id, start + num_new_tokens, write_from=start)
            if new_blocks is None:
                break
            admit(request, num_new_tokens, new_blocks)
            i += 1

        # 2. Swapped requests come back, oldest group first, when their blocks fit with one block to spare
        #    for each sequence's next token (or at all, when nothing else runs).
        while not preempted and not stalled and self.swapped:
            head = self.swapped[0]
            group = [r for r in self.swapped if r.arrival_index == head.arrival_index]
            ids = [r.request_id for r in group]
            spare = len(group) if self.running else 0
            if self.num_running_seqs + len(group) > self.config.max_num_seqs:
                break
            if not self.swap_space.can_swap_in(ids, spare):
                break
            swapped_in += self.swap_space.swap_in(ids)
            for request in group:
                self.swapped.remove(request)
                request.status = RequestStatus.RUNNING
                bisect.insort(self.running, request, key=Request.order.fget)
                self.kv.cache_full_blocks(
                    request.request_id, request.num_computed_tokens, request.token_ids, request.cache_salt
                )
                try_schedule(request)

        # 3. Waiting requests, first come first served, unless this step had to preempt or requests are still
        #    swapped out. With prefix caching a request starts from its longest cached prefix.
        while not (preempted or stalled or self.swapped) and self.waiting and budget > 0:
            request = self.waiting[0]
            if self.num_running_seqs + request.num_seqs > self.config.max_num_seqs:
                break
            hits = self.kv.get_computed_blocks(request.token_ids(0, request.num_tokens), request.cache_salt)
            num_cached = len(hits) * self.kv.block_size
            request.num_computed_tokens = num_cached
            num_new_tokens = self._num_new_tokens(request, budget)
            new_blocks = None
            if num_new_tokens:
                new_blocks = self.kv.allocate_slots(request.request_id, num_cached + num_new_tokens, hits)
            if new_blocks is None:
                request.num_computed_tokens = 0
                break
            self.waiting.popleft()
            self.kv.record_prefix_query(request.num_tokens, len(hits))
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=Request.order.fget)
            admit(request, num_new_tokens, new_blocks)

        # 4. Nothing could run, yet requests wait: the running ones are all idle (beams waiting for their
        #    siblings' logits) and hold the blocks the others need. Recompute the newest; the others go first.
        if not scheduled and (self.waiting or self.swapped) and self.running:
            victim = self.running[-1]
            self._recompute(victim, behind=self.waiting[0] if self.waiting else None)
            preempted.append(victim.request_id)

        self.num_steps += 1
        copies = self.kv.take_copies()
        swapped_out, self._swapped_out = tuple(self._swapped_out), []
        truncated, self._truncated = tuple(self._truncated), []
        return SchedulerOutput(
            self.num_steps, tuple(scheduled), tuple(allocated), tuple(preempted), copies, swapped_out,
            tuple(swapped_in), truncated,
        )  # fmt: skip

    @property
    def num_running_seqs(self) -> int:
        return sum(r.num_seqs for r in self.running)

    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled: Mapping[str, int],
        forks: Mapping[str, list[Request]] | None = None,
    ) -> UpdateOutput:
        """Advance each scheduled request by what was computed, append the sampled tokens, finish the done.

        `forks` maps a request that has just sampled its first token to the other samples of its group
        (n > 1): they join the running queue sharing all its blocks, each with its own sampled token.
        """
        appended: list[tuple[str, int]] = []
        finished: list[Request] = []
        forked: list[tuple[str, str]] = []
        for scheduled in output.scheduled:
            request = self.requests.get(scheduled.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted or preempted after it was scheduled
            request.num_computed_tokens += scheduled.num_new_tokens
            self.kv.cache_full_blocks(
                request.request_id, request.num_computed_tokens, request.token_ids, request.cache_salt
            )
            if not scheduled.samples:
                continue
            if request.is_beam:
                continue  # the engine's beam step decides what comes next
            group = [request]
            if forks and request.request_id in forks:
                request.forked = True
                for child in forks[request.request_id]:
                    self.add_fork(request, child)
                    forked.append((request.request_id, child.request_id))
                    group.append(child)
            for sequence in group:
                token_id = sampled[sequence.request_id]
                sequence.append_token(token_id)
                appended.append((sequence.request_id, token_id))
                status = sequence.check_stop(self.config.max_model_len)
                if status is not None:
                    finished.append(self.finish_request(sequence.request_id, status))
        return UpdateOutput(tuple(appended), tuple(finished), tuple(forked))

    # -- checks -------------------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        self.kv.check_invariants()
        if self.swap_space is not None:
            self.swap_space.check_invariants()
        waiting_ids = {r.request_id for r in self.waiting}
        running_ids = {r.request_id for r in self.running}
        swapped_ids = {r.request_id for r in self.swapped}
        assert len(waiting_ids) + len(running_ids) + len(swapped_ids) == len(waiting_ids | running_ids | swapped_ids)
        assert waiting_ids | running_ids | swapped_ids == set(self.requests), "a request is lost or finished but queued"
        assert self.num_running_seqs <= self.config.max_num_seqs
        for queue in (self.running, self.swapped):
            orders = [r.order for r in queue]
            assert orders == sorted(orders), "running or swapped is not in arrival order"
        for request in self.swapped:
            assert request.status == RequestStatus.SWAPPED
            assert request.request_id not in self.kv.block_tables, f"swapped {request.request_id} holds device blocks"
            table = self.swap_space.block_tables[request.request_id]
            assert table.num_tokens == request.num_computed_tokens
        for request in self.running:
            assert request.status == RequestStatus.RUNNING
            table = self.kv.block_tables.get(request.request_id)
            assert table is not None and table.num_tokens >= request.num_computed_tokens
        for request in self.waiting:
            assert request.status == RequestStatus.WAITING
            assert request.request_id not in self.kv.block_tables, f"waiting {request.request_id} holds blocks"
            assert request.num_computed_tokens == 0
