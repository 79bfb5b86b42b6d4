"""A Gantt chart of a whole trace: one row per sequence, one column per step, coloured by state.

running (scheduled in the step, or in the running queue after it): the sequence's colour; waiting: grey;
swapped (KV parked in CPU blocks): the sequence's colour, hatched and pale. A black cross marks a preemption,
a black bar the step a sequence finished, a grey one the step beam search pruned it. Rows follow the order in
which requests first appear, each request's samples or beams right under it; with more than 40 rows only the
requests are named, each group between thin lines. The legend lists only what the chart shows. `arrivals`
({request_id: step}) marks when requests arrived, with a line to their first step in the trace where a client
held them back (static batching waits outside the engine, where the trace cannot see it).

# Explained in chapters/05_continuous_batching.ipynb
"""

from __future__ import annotations

from collections.abc import Mapping

from matplotlib.axes import Axes
from matplotlib.collections import LineCollection, PolyCollection
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from pagedlab.core.trace import Trace
from pagedlab.viz._common import PRUNED, new_axes, step
from pagedlab.viz.palette import WAITING_COLOR, appearance_order, color_map, mix, roots

STATES = ("waiting", "running", "swapped")


def row_order(trace: Trace) -> list[str]:
    """Every sequence of the trace: requests in the order they first appear, each followed by its forks."""
    root_of = roots(trace)
    groups: dict[str, list[str]] = {}
    for rid in appearance_order(trace):
        groups.setdefault(root_of.get(rid, rid), []).append(rid)
    return [rid for members in groups.values() for rid in members]


def states(trace: Trace) -> dict[str, list[str | None]]:
    """request_id -> its state at each step of the trace ("waiting", "running", "swapped" or None), in row order."""
    table: dict[str, list[str | None]] = {rid: [None] * len(trace.steps) for rid in row_order(trace)}
    for i, record in enumerate(trace.steps):
        for rid in record.waiting:
            table[rid][i] = "waiting"
        for rid in record.swapped:
            table[rid][i] = "swapped"
        for rid in (*record.running, *(s.request_id for s in record.scheduled)):
            table[rid][i] = "running"
    return table


def _runs(row: list[str | None]):
    """(state, first index, length) for each run of equal, non-empty states."""
    start = 0
    for i in range(1, len(row) + 1):
        if i == len(row) or row[i] != row[start]:
            if row[start] is not None:
                yield row[start], start, i - start
            start = i


def draw_timeline(trace: Trace, ax: Axes | None = None, arrivals: Mapping[str, int] | None = None) -> Figure:
    """Draw every sequence's state over every step of `trace` (and when requests arrived); return the figure."""
    step(trace, 0)  # refuses an empty trace
    colors = color_map(trace)
    table = states(trace)
    arrivals = dict(arrivals or {})
    for rid in arrivals:
        if rid not in table:
            raise ValueError(f"arrivals: request {rid!r} is not in the trace")
    ax = new_axes(ax, min(4.5 + 0.12 * len(trace.steps), 12), min(1.2 + 0.28 * len(table), 8))
    x0 = trace.steps[0].step
    polys = {state: ([], []) for state in STATES}
    for row, (rid, row_states) in enumerate(table.items()):
        for state, start, length in _runs(row_states):
            x, y = x0 + start - 0.5, row - 0.38
            polys[state][0].append([(x, y), (x + length, y), (x + length, y + 0.76), (x, y + 0.76)])
            face = {"waiting": WAITING_COLOR, "running": colors[rid], "swapped": mix(colors[rid], "#FFFFFF", 0.55)}
            polys[state][1].append(face[state])
    for state, (verts, faces) in polys.items():
        hatch = "////" if state == "swapped" else None
        polygons = PolyCollection(verts, facecolors=faces, edgecolors="white", linewidths=0.4, hatch=hatch)
        polygons.set_gid(f"timeline-{state}")
        ax.add_collection(polygons)
    rows = {rid: row for row, rid in enumerate(table)}
    preempted = [(r.step, rows[rid]) for r in trace.steps for rid in r.preempted]
    finished = [(r.step, rows[rid]) for r in trace.steps for rid, reason in r.finished if reason != PRUNED]
    pruned = [(r.step, rows[rid]) for r in trace.steps for rid, reason in r.finished if reason == PRUNED]
    if preempted:
        ax.scatter(*zip(*preempted), marker="x", color="black", s=30, zorder=3, gid="timeline-preempted")
    if finished:
        ax.scatter(*zip(*finished), marker="|", color="black", s=60, zorder=3, gid="timeline-finished")
    if pruned:
        ax.scatter(*zip(*pruned), marker="|", color="#888888", s=60, zorder=3, gid="timeline-pruned")
    if arrivals:
        first = {rid: x0 + next(i for i, state in enumerate(row) if state) for rid, row in table.items()}
        held = [[(at, rows[rid]), (first[rid] - 0.5, rows[rid])] for rid, at in arrivals.items() if at < first[rid]]
        lines = LineCollection(held, colors=WAITING_COLOR, linewidths=1.2, linestyles="dotted", zorder=2)
        lines.set_gid("timeline-held-back")
        ax.add_collection(lines)
        ax.scatter(list(arrivals.values()), [rows[rid] for rid in arrivals], marker="|", color="#555555", s=30,
                   zorder=3, gid="timeline-arrived")
    ax.set_xlim(min([x0, *arrivals.values()]) - 0.5, trace.steps[-1].step + 0.5)
    ax.set_ylim(len(table) - 0.5, -0.5)
    if len(table) <= 40:
        ax.set_yticks(range(len(table)), list(table), fontsize=7)
    else:  # too many rows to name: name each request, its forks under it, a line between requests
        root_of = roots(trace)
        firsts = {row: rid for row, rid in enumerate(table) if rid not in root_of}  # the requests' own rows
        ax.set_yticks(list(firsts), list(firsts.values()), fontsize=max(4, min(7, 320 / len(firsts))))
        ax.hlines([row - 0.5 for row in list(firsts)[1:]], *ax.get_xlim(), colors="#DDDDDD", linewidths=0.4,
                  zorder=0, gid="timeline-groups")
    ax.set_xlabel("step")
    ax.set_ylabel("sequence")
    ax.set_title("requests over steps", fontsize=9)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    drawn = {state for state, (verts, _) in polys.items() if verts}
    handles = [handle for shown, handle in [
        ("waiting" in drawn, Patch(facecolor=WAITING_COLOR, label="waiting")),
        ("running" in drawn, Patch(facecolor="#777777", label="running (own colour)")),
        ("swapped" in drawn, Patch(facecolor="#DDDDDD", hatch="////", label="swapped")),
        (preempted, Line2D([], [], marker="x", color="black", linestyle="", label="preempted")),
        (finished, Line2D([], [], marker="|", color="black", linestyle="", markersize=9, label="finished")),
        (pruned, Line2D([], [], marker="|", color="#888888", linestyle="", markersize=9, label="pruned (beam)")),
        (arrivals, Line2D([], [], marker="|", color="#555555", linestyle="dotted", markersize=6,
                          label="arrived (held back until the line ends)")),
    ] if shown]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7, frameon=False)
    return ax.figure
