"""The same workload over contiguous KV memory: each sequence reserves one contiguous range of slots when it is
admitted (`pagedlab.contiguous.ContiguousAllocator`, first fit) and keeps it until it may give it back.

Two policies, on the same budgets as the paged engine (`max_num_seqs`, `max_num_batched_tokens`) and timed by
the same `StepCostModel`:
  - "continuous" (Orca's iteration-level scheduling): a sequence leaves, and frees its range, the step it
    finishes; waiting sequences join, first come first served, whenever their reservation fits in a hole;
  - "static" (what `ContiguousEngine` runs): a batch is admitted only when the previous one has wholly ended,
    so a finished sequence holds its range until the batch's longest one ends.
A reservation is `max_model_len` slots, or with reserve="max_tokens" the sequence's prompt plus output (the
oracle that knows its length). Samples and beams share nothing here: a request with n samples or a beam width
reserves and prefills that many sequences. No sequence is ever preempted: its reservation covers all it will
need. Every step records a `FragmentationReport`, the queues and the reservations.

# Explained in chapters/14_playground.ipynb
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedlab.contiguous import ContiguousAllocator, FragmentationReport
from pagedlab.sim.cost_model import StepCostModel, step_features
from pagedlab.sim.synthetic_workload import SimRequest


@dataclass(frozen=True)
class ContiguousStep:
    step: int
    duration_s: float
    report: FragmentationReport
    num_waiting: int  # sequences that have arrived and hold no reservation, after the step
    num_running: int  # sequences that computed in the step
    reservations: tuple[tuple[str, int, int, int], ...]  # (sequence id, start, length, tokens used) after the step
    appended: tuple[tuple[str, int], ...]  # (sequence id, token): one per sequence that sampled


@dataclass
class ContiguousTrace:
    """The steps of a contiguous run, with the simulated clock (the same attributes `pagedlab.sim.metrics` reads
    from a `SimTrace`)."""

    num_slots: int
    max_model_len: int
    batching: str
    steps: list[ContiguousStep] = field(default_factory=list)
    step_start_s: list[float] = field(default_factory=list)
    arrival_s: dict[str, float] = field(default_factory=dict)
    group_of: dict[str, str] = field(default_factory=dict)
    peak_num_seqs: int = 0

    @property
    def step_end_s(self) -> list[float]:
        return [start + r.duration_s for start, r in zip(self.step_start_s, self.steps)]

    def __len__(self) -> int:
        return len(self.steps)


@dataclass
class _Sequence:
    sequence_id: str
    num_prompt_tokens: int
    final_len: int  # prompt + output
    num_computed: int = 0
    num_tokens: int = 0  # prompt + generated so far

    @property
    def finished(self) -> bool:
        return self.num_tokens >= self.final_len


def simulate_contiguous(
    requests: Sequence[SimRequest], *, num_slots: int, max_model_len: int, cost_model: StepCostModel,
    max_num_seqs: int = 256, max_num_batched_tokens: int = 2048, batching: str = "continuous",
    reserve: str = "max_model_len",
) -> ContiguousTrace:
    """Run `requests` over an arena of `num_slots` contiguous token slots (see the module docstring)."""
    if batching not in ("continuous", "static"):
        raise ValueError(f"batching must be 'continuous' or 'static', got {batching!r}")
    if reserve not in ("max_model_len", "max_tokens"):
        raise ValueError(f"reserve must be 'max_model_len' or 'max_tokens', got {reserve!r}")
    pending = deque(sorted(enumerate(requests), key=lambda item: item[1].arrival_s))
    trace = ContiguousTrace(num_slots, max_model_len, batching)
    for index, spec in pending:
        length = spec.num_prompt_tokens + spec.output_len
        need = max_model_len if reserve == "max_model_len" else length
        if length > max_model_len or need > num_slots or spec.num_prompt_tokens > max_num_batched_tokens:
            raise ValueError(f"request {index} ({spec.num_prompt_tokens} + {spec.output_len} tokens) can never run: "
                             f"max_model_len={max_model_len}, {num_slots} slots, a step of "
                             f"{max_num_batched_tokens} tokens")
    allocator = ContiguousAllocator(num_slots)
    waiting: deque[_Sequence] = deque()
    batch: list[_Sequence] = []  # every sequence holding a reservation
    clock, number = 0.0, 0

    def reservation(seq: _Sequence) -> int:
        return max_model_len if reserve == "max_model_len" else seq.final_len

    while pending or waiting or batch:
        if not waiting and not batch:
            clock = max(clock, pending[0][1].arrival_s)
        while pending and pending[0][1].arrival_s <= clock:
            index, spec = pending.popleft()
            request_id = str(len(trace.arrival_s))
            trace.arrival_s[request_id] = spec.arrival_s
            for k in range(max(spec.n, spec.beam_width, 1)):
                sequence_id = request_id if k == 0 else f"{request_id}:{k}"
                trace.group_of[sequence_id] = request_id
                final_len = spec.num_prompt_tokens + spec.output_len
                waiting.append(_Sequence(sequence_id, spec.num_prompt_tokens, final_len, 0, spec.num_prompt_tokens))
        # Decodes first, then admissions (static: only into an empty arena), within both budgets.
        running = [s for s in batch if not s.finished]
        budget = max_num_batched_tokens - len(running)
        if batching == "continuous" or not batch:
            while waiting and len(batch) < max_num_seqs and waiting[0].num_prompt_tokens <= budget:
                if allocator.allocate(waiting[0].sequence_id, reservation(waiting[0])) is None:
                    break
                seq = waiting.popleft()
                batch.append(seq)
                running.append(seq)
                budget -= seq.num_prompt_tokens
        trace.peak_num_seqs = max(trace.peak_num_seqs, len(batch))
        work = [(s.num_computed, s.num_tokens - s.num_computed) for s in running]
        appended = []
        for seq in running:  # the step computes each sequence's uncomputed tokens and samples one more
            seq.num_computed = seq.num_tokens
            seq.num_tokens += 1
            appended.append((seq.sequence_id, 0))
        number += 1
        duration = cost_model.seconds(step_features(tuple(_Scheduled(c, n) for c, n in work)))
        # Continuous: a finished sequence gives its range back at once. Static: the batch holds every range
        # through its last step (measured as `ContiguousEngine` measures it), then frees them all.
        if batching == "continuous":
            _free(allocator, batch, [s for s in batch if s.finished])
        usage = {s.sequence_id: (s.num_tokens, s.final_len) for s in batch}
        want = reservation(waiting[0]) if waiting else 0
        report = FragmentationReport.measure(allocator, usage, want)
        reservations = tuple((s.sequence_id, *allocator.reservations[s.sequence_id], s.num_tokens) for s in batch)
        if batching == "static" and all(s.finished for s in batch):
            _free(allocator, batch, list(batch))
        trace.steps.append(ContiguousStep(number, duration, report, len(waiting), len(running), reservations,
                                          tuple(appended)))
        trace.step_start_s.append(clock)
        clock += duration
    return trace


def _free(allocator: ContiguousAllocator, batch: list[_Sequence], done: list[_Sequence]) -> None:
    for seq in done:
        allocator.free(seq.sequence_id)
        batch.remove(seq)


@dataclass(frozen=True)
class _Scheduled:
    """What `step_features` reads of a scheduled sequence."""

    num_computed_tokens: int
    num_new_tokens: int
