"""When each request got its tokens, in engine time, and latency distributions drawn as cumulative curves.

`request_times` reads a trace only: engine time is the sum of the recorded steps' `duration_s`, a request
arrives at the start of the first step that lists it, and gets a token at the end of each step that appends
one. So the times leave out whatever the caller did between steps. `draw_latency` draws any named lists of
seconds (time to first token, gaps between tokens, ...) as empirical CDFs with their median and p99 marked.

# Explained in chapters/08_chunked_prefill.ipynb
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

from pagedlab.core.trace import Trace
from pagedlab.viz._common import new_axes
from pagedlab.viz.palette import OKABE_ITO


@dataclass(frozen=True)
class RequestTimes:
    arrival_s: float
    token_s: tuple[float, ...]  # end of each step that gave the request a token

    @property
    def ttft_s(self) -> float | None:
        """Time to first token."""
        return self.token_s[0] - self.arrival_s if self.token_s else None

    @property
    def itl_s(self) -> list[float]:
        """Inter-token latencies: the gaps between consecutive tokens."""
        return [b - a for a, b in zip(self.token_s, self.token_s[1:])]


def request_times(trace: Trace) -> dict[str, RequestTimes]:
    """Every sequence of the trace: when it arrived and when each of its tokens came, in engine seconds."""
    arrival: dict[str, float] = {}
    tokens: dict[str, list[float]] = {}
    now = 0.0
    for record in trace.steps:
        ids = [s.request_id for s in record.scheduled] + [*record.waiting, *record.running, *record.swapped]
        for rid in ids:
            arrival.setdefault(rid, now)
        now += record.duration_s
        for rid, _ in record.appended:
            arrival.setdefault(rid, now)
            tokens.setdefault(rid, []).append(now)
    return {rid: RequestTimes(t, tuple(tokens.get(rid, ()))) for rid, t in arrival.items()}


def draw_latency(samples: Mapping[str, Sequence[float]], ax: Axes | None = None, title: str = "latency",
                 unit: str = "ms", log: bool = False) -> Figure:
    """Empirical CDFs of the named lists of seconds, with each median (dot) and p99 (triangle) marked."""
    scale = {"s": 1.0, "ms": 1e3, "us": 1e6}[unit]
    ax = new_axes(ax, 7.0, 3.5)
    for i, (label, values) in enumerate(samples.items()):
        if not len(values):
            continue
        color = OKABE_ITO[[4, 5, 2, 0, 6, 1][i % 6]]
        xs = np.sort(np.asarray(values, dtype=float)) * scale
        ys = np.arange(1, len(xs) + 1) / len(xs)
        p50, p99 = np.percentile(xs, 50), np.percentile(xs, 99)
        ax.step(xs, ys, where="post", color=color, label=f"{label}: p50 {p50:.3g}, p99 {p99:.3g} {unit}",
                gid=f"latency-{i}")
        ax.plot([p50], [0.5], "o", color=color, markersize=5)
        ax.plot([p99], [0.99], "^", color=color, markersize=6)
    if log:
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set(xlabel=f"{unit}", ylabel="share of samples at or below", ylim=(0, 1.03))
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="lower right", framealpha=0.9)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return ax.figure
