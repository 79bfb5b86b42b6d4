"""Paged against contiguous memory on one workload, in pictures: where the KV slots go over time, the queues,
throughput, latency distributions and preemptions (`render_comparison`), and the contiguous arena at one step
(`draw_arena`). Pure functions of the traces (`pagedlab.sim`), as the rest of `pagedlab.viz`.

# Explained in chapters/14_playground.ipynb
"""

from __future__ import annotations

from matplotlib.axes import Axes
from matplotlib.collections import PatchCollection
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from pagedlab.sim import metrics
from pagedlab.viz._common import PNGFigure, new_axes
from pagedlab.viz.palette import FREE_COLOR, OKABE_ITO, mix

SYSTEM_COLORS = {"paged": "#0072B2", "contiguous": "#D55E00"}
KV_COLORS = dict(zip(metrics.KV_CATEGORIES, ("#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#F0E442")))


def draw_kv_breakdown(trace, ax: Axes | None = None, title: str = "", series: dict | None = None) -> Figure:
    """The share of the KV slots in each category (`metrics.KV_CATEGORIES`) over simulated time, stacked
    (`series`: `metrics.kv_breakdown(trace)`, if already computed)."""
    ax = new_axes(ax, 5, 3)
    series = series or metrics.kv_breakdown(trace)
    total = metrics.kv_slots(trace)
    times = trace.step_end_s
    shown = [c for c in metrics.KV_CATEGORIES if any(series[c])] or ["used"]
    ax.stackplot(times, [[v / total for v in series[c]] for c in shown], labels=shown,
                 colors=[KV_COLORS[c] for c in shown], step="post", linewidth=0)
    used = metrics.time_average(trace, series["used"]) / total
    ax.set_title(f"{title}: {used:.0%} of the KV slots hold live tokens (time-averaged)", fontsize=9)
    ax.set_ylim(0, 1)
    ax.set_xlim(0, times[-1] if times else 1)
    ax.set_xlabel("simulated time (s)", fontsize=8)
    ax.set_ylabel("share of KV slots", fontsize=8)
    ax.legend(loc="upper right", fontsize=8, frameon=True, framealpha=0.8)
    return ax.figure


def draw_kv_summary(traces: dict, ax: Axes | None = None, breakdowns: dict | None = None) -> Figure:
    """One horizontal bar per system: the time-averaged share of the slots in each category, and free."""
    ax = new_axes(ax, 5, 2)
    names = list(traces)
    breakdowns = breakdowns or {name: metrics.kv_breakdown(trace) for name, trace in traces.items()}
    for row, name in enumerate(names):
        trace, left = traces[name], 0.0
        series = breakdowns[name]
        total = metrics.kv_slots(trace)
        for category in metrics.KV_CATEGORIES:
            share = metrics.time_average(trace, series[category]) / total
            ax.barh(row, share, left=left, color=KV_COLORS[category], height=0.6)
            if share >= 0.06:
                ax.text(left + share / 2, row, f"{share:.0%}", ha="center", va="center", fontsize=7)
            left += share
        ax.barh(row, 1 - left, left=left, color=FREE_COLOR, height=0.6)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_xlim(0, 1)
    ax.invert_yaxis()
    ax.set_xlabel("share of KV slots, time-averaged (grey: free)", fontsize=8)
    ax.set_title("where the KV memory went (colours as on the left)", fontsize=9)
    return ax.figure


def _lines(ax, traces: dict, values: dict, ylabel: str, title: str) -> None:
    for name, trace in traces.items():
        ax.step(trace.step_end_s, values[name], where="post", color=SYSTEM_COLORS[name], label=name, linewidth=1.2)
    ax.set_xlabel("simulated time (s)", fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)


def draw_cdf(traces: dict, field: str, ax: Axes | None = None) -> Figure:
    """The distribution of a per-request latency (`metrics.Latencies` field: ttft_s, tpot_s, e2e_s) per system."""
    ax = new_axes(ax, 4, 3)
    label = {"ttft_s": "time to first token", "tpot_s": "time per output token", "e2e_s": "request latency"}[field]
    for name, trace in traces.items():
        values = sorted(getattr(metrics.latencies(trace), field))
        if values:
            ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post",
                    color=SYSTEM_COLORS[name], label=f"{name}: median {metrics.median(values):.3g} s")
    ax.set_xlabel(f"{label} (s)", fontsize=8)
    ax.set_ylabel("share of requests", fontsize=8)
    ax.set_ylim(0, 1.02)
    ax.set_title(label, fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    return ax.figure


def draw_preemptions(traces: dict, ax: Axes | None = None) -> Figure:
    ax = new_axes(ax, 4, 3)
    kinds = ("recompute", "swap", "partial")
    for i, (name, trace) in enumerate(traces.items()):
        counts = metrics.num_preemptions(trace)
        for j, kind in enumerate(kinds):
            ax.bar(j + 0.38 * i - 0.19, counts[kind], width=0.36, color=SYSTEM_COLORS[name],
                   label=name if j == 0 else None)
            ax.text(j + 0.38 * i - 0.19, counts[kind], str(counts[kind]), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(kinds)), kinds, fontsize=8)
    ax.set_ylabel("preempted sequences", fontsize=8)
    ax.set_title("preemptions (contiguous reservations never preempt)", fontsize=9)
    ax.legend(fontsize=8)
    return ax.figure


def render_comparison(comparison) -> Figure:
    """Everything the playground shows about one `pagedlab.sim.experiment.Comparison`, in one 3 x 3 figure."""
    traces = {"paged": comparison.paged, "contiguous": comparison.contiguous}
    breakdowns = {name: metrics.kv_breakdown(trace) for name, trace in traces.items()}
    fig = PNGFigure(figsize=(13, 10), dpi=80)  # a fixed grid, no layout engine: a run must redraw fast
    axes = fig.subplots(3, 3, gridspec_kw=dict(left=0.06, right=0.98, bottom=0.06, top=0.93, wspace=0.28, hspace=0.45))
    draw_kv_breakdown(comparison.paged, axes[0][0], "paged", breakdowns["paged"])
    draw_kv_breakdown(comparison.contiguous, axes[0][1], "contiguous", breakdowns["contiguous"])
    draw_kv_summary(traces, axes[0][2], breakdowns)
    queues = {name: metrics.waiting_and_running(trace) for name, trace in traces.items()}
    _lines(axes[1][0], traces, {n: q[0] for n, q in queues.items()}, "sequences", "waiting (and swapped)")
    _lines(axes[1][1], traces, {n: q[1] for n, q in queues.items()}, "sequences", "running: computing in the step")
    cumulative = {}
    for name, trace in traces.items():
        total, cumulative[name] = 0, []
        for record in trace.steps:
            total += len(record.appended)
            cumulative[name].append(total)
    _lines(axes[1][2], traces, cumulative, "output tokens", "throughput: " + ", ".join(
        f"{name} {metrics.output_throughput(trace):.0f} tok/s" for name, trace in traces.items()))
    draw_cdf(traces, "ttft_s", axes[2][0])
    draw_cdf(traces, "tpot_s", axes[2][1])
    draw_preemptions(traces, axes[2][2])
    s = comparison.settings
    fig.suptitle(
        f"{len(comparison.requests)} requests at {s.request_rate:.3g}/s; KV budget {s.kv_slots} slots, block size "
        f"{s.block_size}; max_num_seqs {s.max_num_seqs}, max_num_batched_tokens {s.max_num_batched_tokens}; "
        f"preemption {s.preemption_mode}", fontsize=10,
    )
    return fig


def draw_sweep(xs, series: dict, xlabel: str, ylabel: str, title: str, ax: Axes | None = None, *,
               logx: bool = False, percent: bool = False) -> Figure:
    """A measure against a setting, one line per label of `series` (label -> values at `xs`). A label's first
    word picks the colour (paged, contiguous: their systems'); several lines of one system differ in style."""
    ax = new_axes(ax, 5.5, 3.2)
    seen: dict[str, int] = {}
    for i, (label, ys) in enumerate(series.items()):
        system = label.split()[0]
        color = SYSTEM_COLORS.get(system, OKABE_ITO[(i + 2) % len(OKABE_ITO)])
        k = seen[system] = seen.get(system, -1) + 1  # a second line of one system: dashed, other markers
        ax.plot(xs, ys, ("-", "--", ":")[k % 3], marker="osD"[k % 3], markersize=4, color=color, label=label)
    if logx:
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(xs), [str(x) for x in xs])
    if percent:
        ax.yaxis.set_major_formatter(lambda v, _: f"{v:.0%}")
    ax.set_xlabel(xlabel, fontsize=9)
    ax.set_ylabel(ylabel, fontsize=9)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return ax.figure


def draw_arena(trace, index: int, ax: Axes | None = None) -> Figure:
    """The contiguous arena after step `index`: each reservation a bar (solid: tokens held; pale: reserved,
    empty), holes in grey, wrapped onto rows of at most 1024 slots."""
    ax = new_axes(ax, 10, 2.5)
    record = trace.steps[index]
    width = min(trace.num_slots, 1024)
    rows = -(-trace.num_slots // width)

    def boxes(start, length):  # a range of slots as rectangles, one per row it crosses
        while length > 0:
            row, col = divmod(start, width)
            run = min(length, width - col)
            yield Rectangle((col, -row - 0.9), run, 0.8)
            start, length = start + run, length - run

    holes = [r for start, length in _holes(trace.num_slots, record.reservations) for r in boxes(start, length)]
    ax.add_collection(PatchCollection(holes, facecolors=FREE_COLOR, linewidths=0))
    for i, (_, start, length, used) in enumerate(record.reservations):
        color = OKABE_ITO[i % len(OKABE_ITO)]
        ax.add_collection(PatchCollection(list(boxes(start, length)), facecolors=mix(color, "#FFFFFF", 0.65),
                                          edgecolors="white", linewidths=0.5))
        ax.add_collection(PatchCollection(list(boxes(start, used)), facecolors=color, linewidths=0))
    ax.set_xlim(0, width)
    ax.set_ylim(-rows, 0)
    ax.axis("off")
    ax.set_title(f"contiguous arena after step {record.step}: {len(record.reservations)} reservations, "
                 f"{record.report.used} slots hold running tokens of {trace.num_slots}", fontsize=9)
    return ax.figure


def _holes(num_slots: int, reservations) -> list[tuple[int, int]]:
    holes, cursor = [], 0
    for _, start, length, _ in sorted(reservations, key=lambda r: r[1]):
        if start > cursor:
            holes.append((cursor, start - cursor))
        cursor = start + length
    if cursor < num_slots:
        holes.append((cursor, num_slots - cursor))
    return holes
