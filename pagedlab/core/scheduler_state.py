"""The scheduler's state: its three queues, every unfinished sequence, and the groups they form.

Every unfinished sequence is in exactly one queue: waiting (no KV), running (a device block table) or swapped
(a CPU block table). Sequences forked from one user request (its n samples, or its beams) share blocks and form
a *group* keyed by the user's request id; the queues keep a group's sequences next to each other. `Scheduler`
decides; this class keeps the books, answers for the invariants, and takes the snapshots the trace records.

# Explained in chapters/05_continuous_batching.ipynb
"""

from __future__ import annotations

import bisect
import copy
from collections import deque
from collections.abc import Iterable, Sequence

from pagedlab.core.kv_cache_manager import KVCacheManager
from pagedlab.core.request import Request, RequestStatus
from pagedlab.core.stats import QueueStats, SchedulerStats
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


class SchedulerState:
    """Waiting, running and swapped queues over one `KVCacheManager` (and its `SwapSpace`, if any).

    Invariants:
      - every unfinished sequence is in exactly one of `waiting`, `running` and `swapped`; finished ones in none;
      - `running` and `swapped` are sorted by `order` (arrival, then place in the group), so a group's sequences
        sit together; the running groups reserve at most max_num_seqs sequence slots;
      - between steps, a running sequence holds a device block table of exactly its computed tokens (a table grows
        only for the tokens a step computes, and speculative decoding rolls back the slots of rejected drafts),
        or, while its group is in a batch still in flight (pipeline parallelism), of at least them; a swapped one
        a CPU table of exactly its computed tokens; a waiting one holds none and has computed none;
      - a group is in one batch in flight at most (`schedule` skips those in flight);
      - the block manager's and the swap space's own invariants hold.
    """

    def __init__(self, kv_cache_manager: KVCacheManager, swap_space: SwapSpace | None, max_num_seqs: int) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.swap_space = swap_space
        self.max_num_seqs = max_num_seqs
        self.stats = SchedulerStats()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, list[Request]] = {}  # group_id -> its unfinished sequences
        self.finished_req_ids: list[str] = []  # finished since the last step: the next SchedulerOutput carries them
        self.in_flight: set[str] = set()  # groups in a batch scheduled but not yet updated (pipeline parallelism)
        self.num_finished_groups = 0  # user requests finished (every sequence of the group), however they ended

    # -- requests -------------------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests or request.group_id in self.groups:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        request.prompt_block_hashes = self.kv_cache_manager.hash_prompt(request.prompt_token_ids, request.cache_salt)
        self.requests[request.request_id] = request
        self.groups[request.group_id] = [request]
        self.waiting.append(request)

    def add_fork(self, parent: Request, child: Request) -> None:
        """Run `child`, just forked from the running `parent`: it shares every block of the parent's table."""
        assert parent.status == RUNNING and child.request_id not in self.requests
        self.kv_cache_manager.fork(parent.request_id, child.request_id)
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

    def has_group(self, group_id: str) -> bool:
        """A user request with this id is unfinished here."""
        return group_id in self.groups

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

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
            freed += self.kv_cache_manager.free(request_id)
            self.finished_req_ids.append(request_id)
            members = self.groups[request.group_id]
            members.remove(request)
            if not members:
                del self.groups[request.group_id]
                self.num_finished_groups += 1
            finished.append(request)
        return finished, freed

    def finish_groups(self, group_ids: Iterable[str], status: RequestStatus) -> tuple[list[Request], list[int]]:
        """Finish every sequence of each group (an abort of the user's request, or its failure)."""
        ids = [r.request_id for group_id in group_ids for r in self.groups.get(group_id, ())]
        return self.finish_requests(ids, status)

    # -- sequence slots -------------------------------------------------------------------------------------

    @staticmethod
    def seats(sequences: Sequence[Request]) -> int:
        """Sequence slots a group takes while these of its sequences run: its reservation (the beam width, or n
        before the samples fork) or the sequences themselves, whichever is more."""
        return max([len(sequences)] + [r.num_seqs_reserved for r in sequences]) if sequences else 0

    def seats_to_run(self, sequences: Sequence[Request]) -> int:
        """The sequence slots that running `sequences` (of one group) would add to those in use."""
        running = [r for r in self.groups[sequences[0].group_id] if r.status == RUNNING]
        return self.seats(running + list(sequences)) - self.seats(running)

    @property
    def num_running_seqs(self) -> int:
        return sum(self.seats(group) for group in runs_by_group(self.running))

    def queue_stats(self) -> QueueStats:
        """The queues' lengths now and a frozen copy of the counters."""
        return QueueStats(self.num_running, self.num_waiting, self.num_swapped, copy.deepcopy(self.stats))

    def snapshot(self) -> SchedulerSnapshot:
        """The queues, the block tables of both pools and the free counts, frozen (what the trace keeps)."""
        kv, swap = self.kv_cache_manager, self.swap_space

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
        self.kv_cache_manager.check_invariants()
        if self.swap_space is not None:
            self.swap_space.check_invariants()
        queues = [self.waiting, self.running, self.swapped]
        ids = [r.request_id for queue in queues for r in queue]
        assert len(ids) == len(set(ids)) and set(ids) == set(self.requests), "a sequence is lost, twice or finished"
        assert {r.request_id for group in self.groups.values() for r in group} == set(self.requests)
        assert all(r.group_id == group_id for group_id, group in self.groups.items() for r in group)
        assert self.num_running_seqs <= self.max_num_seqs, "the running groups take too many slots"
        for queue in (self.running, self.swapped):
            orders = [r.order for r in queue]
            assert orders == sorted(orders), "running or swapped is not in arrival order"
        for request in self.swapped:
            assert request.status == RequestStatus.SWAPPED
            assert request.request_id not in self.kv_cache_manager.block_tables, (
                f"swapped {request.request_id} holds device blocks"
            )
            assert self.swap_space.block_tables[request.request_id].num_tokens == request.num_computed_tokens
        for request in self.running:
            assert request.status == RUNNING
            table = self.kv_cache_manager.block_tables.get(request.request_id)
            in_flight = request.group_id in self.in_flight
            assert table is not None and (table.num_tokens >= request.num_computed_tokens if in_flight else
                                          table.num_tokens == request.num_computed_tokens), (
                f"running {request.request_id}: {table and table.num_tokens} slots for {request.num_computed_tokens} "
                "computed tokens (a rollback missed?)"
            )
        for request in self.waiting:
            assert request.status == RequestStatus.WAITING
            assert request.request_id not in self.kv_cache_manager.block_tables, (
                f"waiting {request.request_id} holds blocks"
            )
            assert request.num_computed_tokens == 0
