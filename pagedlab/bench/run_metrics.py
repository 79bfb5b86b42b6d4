"""Numbers computed from what a run left behind: the engine's trace, token timestamps, step counts.

Everything here is pure Python over recorded values; nothing reaches into a live engine.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation, as numpy's default; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


@dataclass(frozen=True)
class Summary:
    mean: float
    p50: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Summary:
        return cls(statistics.fmean(values) if values else math.nan, percentile(values, 50), percentile(values, 99))


@dataclass(frozen=True)
class KVSample:
    """KV slots at one step: `allocated` in distinct blocks (x block_size), `live` holding real tokens;
    `unshared` is what every sequence holding its own copy of each block would allocate."""

    allocated: int
    live: int
    unshared: int
    num_running: int


def kv_samples(trace) -> list[KVSample]:
    """One `KVSample` per recorded step of a pagedlab trace (block tables as they are after the step)."""
    size = trace.block_size
    samples = []
    for record in trace.steps:
        filled: dict[int, int] = {}
        unshared = 0
        for table in record.block_tables:
            unshared += len(table.block_ids) * size
            for i, block in enumerate(table.block_ids):
                filled[block] = max(filled.get(block, 0), min(size, table.num_tokens - i * size))
        samples.append(KVSample(len(filled) * size, sum(filled.values()), unshared, len(record.running)))
    return samples


def utilization(samples: Sequence[KVSample]) -> float | None:
    """Live token slots over allocated ones, summed over the steps (slot-steps)."""
    allocated = sum(s.allocated for s in samples)
    return sum(s.live for s in samples) / allocated if allocated else None


def static_batch_kv(prompt_lens: Sequence[int], output_lens: Sequence[int]) -> list[KVSample]:
    """A Hugging Face static batch, step by step: left-padded to the longest prompt, every row grows by one
    slot per step until the longest output is done; a row holds live tokens only up to its own length."""
    width, steps = max(prompt_lens), max(output_lens)
    samples = []
    for t in range(1, steps + 1):
        live = sum(p + min(t, o) for p, o in zip(prompt_lens, output_lens))
        allocated = len(prompt_lens) * (width + t)
        samples.append(KVSample(allocated, live, allocated, sum(1 for o in output_lens if o >= t)))
    return samples


def token_latencies(arrival: float, token_times: Sequence[float]) -> tuple[float, float | None, list[float]]:
    """(time to first token, time per output token after the first, inter-token gaps) of one request."""
    ttft = token_times[0] - arrival
    gaps = [b - a for a, b in zip(token_times, token_times[1:])]
    tpot = (token_times[-1] - token_times[0]) / (len(token_times) - 1) if len(token_times) > 1 else None
    return ttft, tpot, gaps
