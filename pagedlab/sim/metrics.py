"""What a simulated trace says: token times, latencies, throughput, queues, and where the KV slots went.

Everything here reads a `SimTrace` (the engine's `Trace` plus the simulated clock) and returns plain numbers;
the playground's plots and chapter 14's assertions are made from these.

# Explained in chapters/14_playground.ipynb
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from pagedlab.sim.simulator import SimTrace


def token_times(trace: SimTrace) -> dict[str, list[float]]:
    """request id -> the times its tokens came out (the end of the step that sampled each), every sample's
    or beam's together, in order."""
    times: dict[str, list[float]] = {request_id: [] for request_id in trace.arrival_s}
    for record, end in zip(trace.steps, trace.step_end_s):
        for sequence_id, _ in record.appended:
            times[trace.group_of[sequence_id]].append(end)
    return times


@dataclass(frozen=True)
class Latencies:
    ttft_s: tuple[float, ...]  # per request: arrival to its first token
    tpot_s: tuple[float, ...]  # per request with two tokens or more: time per output token after the first
    e2e_s: tuple[float, ...]  # per request: arrival to its last token


def latencies(trace: SimTrace) -> Latencies:
    ttft, tpot, e2e = [], [], []
    for request_id, times in token_times(trace).items():
        if not times:
            continue
        arrival = trace.arrival_s[request_id]
        ttft.append(times[0] - arrival)
        e2e.append(times[-1] - arrival)
        distinct = sorted(set(times))  # n samples or beams: one token time per step
        if len(distinct) > 1:
            tpot.append((distinct[-1] - distinct[0]) / (len(distinct) - 1))
    return Latencies(tuple(ttft), tuple(tpot), tuple(e2e))


def makespan(trace: SimTrace) -> float:
    """Seconds from the first arrival to the end of the last step."""
    return trace.step_end_s[-1] - min(trace.arrival_s.values()) if trace.steps else 0.0


def num_output_tokens(trace: SimTrace) -> int:
    return sum(len(record.appended) for record in trace.steps)


def output_throughput(trace: SimTrace) -> float:
    """Generated tokens per second over the whole run."""
    span = makespan(trace)
    return num_output_tokens(trace) / span if span > 0 else 0.0


def median(values) -> float:
    return statistics.median(values) if values else float("nan")


@dataclass(frozen=True)
class PagedUsage:
    """Token slots of the paged pool after one step: `live` hold tokens, `internal` are the empty slots of
    allocated blocks (only last blocks have any), `free` are in free blocks (cached ones included)."""

    live: int
    internal: int
    free: int

    @property
    def allocated(self) -> int:
        return self.live + self.internal


def paged_usage(trace: SimTrace) -> list[PagedUsage]:
    """One `PagedUsage` per step. A block shared by several tables counts once, as full as its fullest holder:
    only a table's last block can be partly empty, and a block that is not last in some table is full."""
    size = trace.block_size
    total = trace.num_blocks * size
    usage = []
    for record in trace.steps:
        held, middles, last_fill = set(), set(), {}
        for table in record.block_tables:
            ids = table.block_ids
            if ids:
                held.update(ids)
                middles.update(ids[:-1])
                fill = table.num_tokens - (len(ids) - 1) * size
                last_fill[ids[-1]] = max(last_fill.get(ids[-1], 0), fill)
        internal = sum(size - fill for block, fill in last_fill.items() if block not in middles)
        allocated = len(held) * size
        usage.append(PagedUsage(allocated - internal, internal, total - allocated))
    return usage


def queue_lengths(trace: SimTrace) -> dict[str, list[int]]:
    """Sequences waiting, running and swapped after each step."""
    return {
        "waiting": [len(r.waiting) for r in trace.steps],
        "running": [len(r.running) for r in trace.steps],
        "swapped": [len(r.swapped) for r in trace.steps],
    }


# Where the KV slots go, in the same words for paged and contiguous memory (chapter 01's, plus the slots a
# finished request keeps while its static batch runs on).
KV_CATEGORIES = ("used", "held after finish", "reservation", "internal", "external")


def kv_breakdown(trace) -> dict[str, list[int]]:
    """Token slots per category after each step of a `SimTrace` (paged: used and the empty slots of allocated
    blocks, which are internal fragmentation; nothing is reserved ahead and every free block fits anyone) or a
    `ContiguousTrace` (its `FragmentationReport`s)."""
    series: dict[str, list[int]] = {category: [] for category in KV_CATEGORIES}
    if hasattr(trace, "num_blocks"):
        for usage in paged_usage(trace):
            for category, value in zip(KV_CATEGORIES, (usage.live, 0, 0, usage.internal, 0)):
                series[category].append(value)
        return series
    for record in trace.steps:
        report = record.report
        values = (report.used, getattr(report, "held_after_finish", 0), report.reservation_waste,
                  report.internal_fragmentation, report.external_fragmentation)
        for category, value in zip(KV_CATEGORIES, values):
            series[category].append(value)
    return series


def kv_slots(trace) -> int:
    return trace.num_blocks * trace.block_size if hasattr(trace, "num_blocks") else trace.num_slots


def time_average(trace, values) -> float:
    """The mean of a per-step series weighted by each step's duration (equal weights if time stands still)."""
    weights = [r.duration_s for r in trace.steps]
    total = sum(weights)
    if total <= 0:
        return sum(values) / len(values) if values else 0.0
    return sum(v * w for v, w in zip(values, weights)) / total


def num_preemptions(trace) -> dict[str, int]:
    """Preemptions by kind (a contiguous trace has none: a reservation covers all a sequence will need)."""
    stats = getattr(trace, "stats", None)
    return {kind: getattr(stats, f"num_preemptions_{kind}", 0) for kind in ("recompute", "swap", "partial")}


def waiting_and_running(trace) -> tuple[list[int], list[int]]:
    """Sequences waiting after each step (arrived and not running; swapped ones included), and sequences
    computing in each step."""
    if hasattr(trace, "num_blocks"):
        running = [len({t.request_id for s in r.scheduled for t in s.sampling} | {s.request_id for s in r.scheduled})
                   for r in trace.steps]
        return [len(r.waiting) + len(r.swapped) for r in trace.steps], running
    return [r.num_waiting for r in trace.steps], [r.num_running for r in trace.steps]
