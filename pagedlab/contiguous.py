"""The naive baseline: one contiguous KV reservation per request, and static batching.

`ContiguousAllocator` reserves each request a contiguous range of token slots up front (first fit) and
frees it when the request's whole batch ends; `FragmentationReport` counts where the reserved memory goes.
`ContiguousEngine` runs static batches through pagedlab's own `ModelRunner`: a reservation [start, start + r)
is simply a `BlockTable` with block_size 1, so the two engines share attention, sampling and the model call.

# Explained in chapters/01_contiguous_kv_cache.ipynb
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields

# -- the allocator (pure Python: no torch) -------------------------------------------------------------


class ContiguousAllocator:
    """A KV arena of `num_slots` token slots, handed out as contiguous reservations by first fit.

        slots:         0 1 2 3 4 5 6 7 8 9
        arena:       [ a a a . . . c c c . ]     a = (0, 3), c = (6, 3)
        holes():       (3, 3) and (9, 1)         4 slots free, but no request of 4 fits

    Invariants:
      - every reservation has length >= 1 and lies inside [0, num_slots);
      - no two reservations overlap;
      - reservations and holes cover the arena exactly, and no two holes touch (freeing merges neighbours).
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.reservations: dict[str, tuple[int, int]] = {}  # request_id -> (start, length)

    def holes(self) -> list[tuple[int, int]]:
        """The free ranges as (start, length), in address order; neighbouring free slots form one hole."""
        holes, cursor = [], 0
        for start, length in sorted(self.reservations.values()):
            if start > cursor:
                holes.append((cursor, start - cursor))
            cursor = start + length
        if cursor < self.num_slots:
            holes.append((cursor, self.num_slots - cursor))
        return holes

    @property
    def num_reserved_slots(self) -> int:
        return sum(length for _, length in self.reservations.values())

    @property
    def num_free_slots(self) -> int:
        return self.num_slots - self.num_reserved_slots

    @property
    def largest_hole(self) -> int:
        return max((length for _, length in self.holes()), default=0)

    def allocate(self, request_id: str, num_slots: int) -> int | None:
        """Reserve `num_slots` contiguous slots in the first hole big enough; return the start, or None."""
        if num_slots < 1:
            raise ValueError(f"a reservation needs at least 1 slot, got {num_slots}")
        if request_id in self.reservations:
            raise ValueError(f"request {request_id!r} already holds a reservation")
        for start, length in self.holes():
            if length >= num_slots:
                self.reservations[request_id] = (start, num_slots)
                return start
        return None

    def free(self, request_id: str) -> tuple[int, int] | None:
        """Release the request's reservation and return it as (start, length); unknown ids free nothing."""
        return self.reservations.pop(request_id, None)

    def check_invariants(self) -> None:
        owner: list[str | None] = [None] * self.num_slots
        for request_id, (start, length) in self.reservations.items():
            assert length >= 1 and 0 <= start and start + length <= self.num_slots, f"{request_id}: bad range"
            for slot in range(start, start + length):
                assert owner[slot] is None, f"slot {slot} reserved by {owner[slot]} and {request_id}"
                owner[slot] = request_id
        holes = self.holes()
        free = [slot for slot, who in enumerate(owner) if who is None]
        assert free == [s for start, length in holes for s in range(start, start + length)], "holes != free"
        for (a, n), (b, _) in zip(holes, holes[1:]):
            assert a + n < b, f"holes at {a} and {b} touch: they should be one"


# -- where the reserved memory goes ---------------------------------------------------------------------


@dataclass(frozen=True)
class FragmentationReport:
    """Slots of the arena at one moment (or, from `total`, summed over the steps of a run).

    A request has `used` tokens now (prompt + generated; the newest token's K and V land in its slot at the
    next step, and a finished request's last token keeps its slot, as in the vLLM paper's Figure 3) and
    `final_len` tokens when it finishes, so it has finished once used == final_len. Then, summed over the
    live reservations,

        reserved = used + held_after_finish + reservation_waste + internal_fragmentation

    used: tokens of requests still running (the memory doing its job);
    held_after_finish: tokens of finished requests whose static batch still runs: kept, never read again;
    reservation_waste: slots a running request will fill later but holds empty now (final_len - used);
    internal_fragmentation: slots never filled, because the request ends short of its reservation
      (reserved - final_len), running or finished;
    external_fragmentation: free slots in holes too small for the next reservation to serve;
    utilization: used / reserved, the share of reserved memory holding tokens still in use (0 if nothing).
    """

    num_slots: int
    reserved: int
    used: int
    held_after_finish: int
    reservation_waste: int
    internal_fragmentation: int
    external_fragmentation: int

    @property
    def free(self) -> int:
        return self.num_slots - self.reserved

    @property
    def utilization(self) -> float:
        return self.used / self.reserved if self.reserved else 0.0

    @classmethod
    def measure(
        cls, allocator: ContiguousAllocator, usage: Mapping[str, tuple[int, int]], want: int
    ) -> FragmentationReport:
        """usage: request_id -> (tokens used now, final length) for every live reservation (used == final
        length: the request has finished); want: the size of the next reservation to serve (0 when nothing
        waits: then no hole counts as too small)."""
        if set(usage) != set(allocator.reservations):
            raise ValueError(f"usage covers {sorted(usage)}, the arena holds {sorted(allocator.reservations)}")
        reserved = used = held = waste = internal = 0
        for request_id, (num_used, final_len) in usage.items():
            num_reserved = allocator.reservations[request_id][1]
            if not 0 <= num_used <= final_len <= num_reserved:
                raise ValueError(f"{request_id}: need 0 <= used {num_used} <= final {final_len} <= {num_reserved}")
            reserved += num_reserved
            if num_used == final_len:  # finished: its tokens stay until the batch ends, read by no one
                held += num_used
            else:
                used += num_used
                waste += final_len - num_used
            internal += num_reserved - final_len
        external = sum(length for _, length in allocator.holes() if length < want)
        return cls(allocator.num_slots, reserved, used, held, waste, internal, external)

    @classmethod
    def total(cls, reports: Iterable[FragmentationReport]) -> FragmentationReport:
        """Every field summed over the reports (slot-steps), so `utilization` = sum used / sum reserved."""
        reports = list(reports)
        return cls(*(sum(getattr(r, f.name) for r in reports) for f in fields(cls)))


# -- static batching over the contiguous arena ----------------------------------------------------------


@dataclass(frozen=True)
class ContiguousOutput:
    """What `ContiguousEngine.generate` returns; `reports`, `num_running` and `num_in_batch` have one entry per
    model step. num_in_batch - num_running is the batch's idle rows: finished requests that hold their
    reservation (and, in a padded static batch, their row) until the last one finishes."""

    token_ids: list[list[int]]
    finish_reasons: list[str]
    reports: tuple[FragmentationReport, ...]
    num_running: tuple[int, ...]  # sequences computing at each step (finished ones in the batch do not)
    num_in_batch: tuple[int, ...]  # sequences in the step's static batch, running or finished
    peak_num_seqs: int  # most sequences holding a reservation at once

    @property
    def num_steps(self) -> int:
        return len(self.reports)

    @property
    def summary(self) -> FragmentationReport:
        return FragmentationReport.total(self.reports)


class ContiguousEngine:
    """Static batching: admit up to `max_batch_size` requests in arrival order while their reservations fit,
    run them until every one has finished (finished ones stop computing but keep their slots), free all,
    admit the next batch. reserve="max_model_len" reserves max_model_len slots per request; "max_tokens"
    reserves prompt_len + max_tokens (capped at max_model_len), which leaves holes of varied sizes. Each step's
    report counts as external fragmentation the holes too small for the next waiting request's reservation."""

    def __init__(
        self, model, tokenizer=None, *, num_slots: int, max_model_len: int, max_batch_size: int,
        reserve: str = "max_model_len", seed: int = 0,
    ) -> None:
        from pagedlab.models import eos_token_ids
        from pagedlab.worker.kv_cache import KVCacheSpec
        from pagedlab.worker.model_runner import ModelRunner

        if reserve not in ("max_model_len", "max_tokens"):
            raise ValueError(f"reserve must be 'max_model_len' or 'max_tokens', got {reserve!r}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        model_max_len = getattr(model.config, "max_position_embeddings", None) or max_model_len
        if not 2 <= max_model_len <= model_max_len:
            raise ValueError(f"max_model_len must be in [2, {model_max_len}] for this model, got {max_model_len}")
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_batch_size = max_batch_size
        self.reserve = reserve
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        self.allocator = ContiguousAllocator(num_slots)
        spec = KVCacheSpec.from_model_config(model.config, next(model.parameters()).dtype)
        # One "block" is one slot: the arena is the runner's KV cache [layers, 2, num_slots, 1, kv_heads, head_dim].
        self.model_runner = ModelRunner(model, spec, num_blocks=num_slots, block_size=1, seed=seed)

    def reservation(self, request) -> int:
        if self.reserve == "max_model_len":
            return self.max_model_len
        return min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)

    def _make_request(self, index: int, prompt, params):
        from pagedlab.core.request import Request

        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass token ids instead of text")
            prompt = self.tokenizer.encode(prompt)
        if not prompt:
            raise ValueError(f"prompt {index} is empty: it needs at least one token")
        if params.stop:
            raise ValueError("stop strings are not supported by the contiguous baseline; use stop_token_ids")
        room = self.max_model_len - len(prompt)
        if room < 1:
            raise ValueError(
                f"prompt {index} has {len(prompt)} tokens: no room left under max_model_len={self.max_model_len}"
            )
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        request = Request(str(index), prompt, params, index, max_tokens, self.eos_token_ids)
        if self.reservation(request) > self.allocator.num_slots:
            raise ValueError(
                f"request {index} reserves {self.reservation(request)} slots but the arena holds only "
                f"{self.allocator.num_slots}: it can never run; raise num_slots or lower its reservation"
            )
        return request

    def generate(self, prompts, sampling_params=None) -> ContiguousOutput:
        """Run every prompt (token ids, or text with a tokenizer) to completion, static batch by static batch."""
        from pagedlab.sampling_params import SamplingParams

        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        requests = [self._make_request(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, sampling_params))]
        waiting = deque(requests)
        reports: list[FragmentationReport] = []
        num_running: list[int] = []
        num_in_batch: list[int] = []
        peak = 0
        while waiting:
            batch = self._admit(waiting)
            peak = max(peak, len(batch))
            usage_per_step = self._run_batch(batch, num_running)
            num_in_batch += [len(batch)] * len(usage_per_step)
            want = self.reservation(waiting[0]) if waiting else 0
            final = {r.request_id: r.num_tokens for r, _ in batch}
            for usage in usage_per_step:
                usage = {rid: (used, final[rid]) for rid, used in usage.items()}
                reports.append(FragmentationReport.measure(self.allocator, usage, want))
            for request, _ in batch:
                self.allocator.free(request.request_id)
        return ContiguousOutput(
            [r.output_token_ids for r in requests],
            [r.status.finish_reason for r in requests],
            tuple(reports),
            tuple(num_running),
            tuple(num_in_batch),
            peak,
        )

    def _admit(self, waiting: deque) -> list:
        """Up to max_batch_size requests, first come first served, stopping at the first that does not fit."""
        from pagedlab.core.request import RequestStatus

        batch = []
        while waiting and len(batch) < self.max_batch_size:
            start = self.allocator.allocate(waiting[0].request_id, self.reservation(waiting[0]))
            if start is None:
                break
            request = waiting.popleft()
            request.status = RequestStatus.RUNNING
            batch.append((request, start))
        self.allocator.check_invariants()
        return batch

    def _run_batch(self, batch: list, num_running: list[int]) -> list[dict[str, int]]:
        """Step the batch until all its requests finish; return each step's {request_id: tokens used}."""
        from pagedlab.core.sched_output import ScheduledRequest
        from pagedlab.core.scheduler_step import sampling_request

        usage_per_step = []
        running = list(batch)
        while running:
            work = []
            for request, start in running:  # the first step prefills the whole prompt; later ones decode 1 token
                n, computed = request.num_tokens, request.num_computed_tokens
                work.append(ScheduledRequest(
                    request.request_id, computed, n - computed, request.request_id,
                    tuple(request.token_ids(computed, n)), tuple(range(start, start + n)), (sampling_request(request),),
                ))
            sampled = self.model_runner.execute(work).sampled_token_ids
            num_running.append(len(running))
            for request, _ in running:
                request.num_computed_tokens = request.num_tokens
                (token_id,) = sampled[request.request_id]
                request.append_token(token_id)
                status = request.check_stop(self.max_model_len)
                if status is not None:
                    request.status = status
                    self.model_runner.sampler.forget(request.request_id)
            running = [(r, start) for r, start in running if not r.is_finished]
            usage_per_step.append({r.request_id: r.num_tokens for r, _ in batch})
        return usage_per_step
