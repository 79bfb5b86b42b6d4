"""KV memory over a whole trace: device blocks held by sequences, cached blocks kept free for reuse, and
CPU swap blocks in use, one point per step, against the pool's size; a cross marks each step that preempted.

# Explained in chapters/06_preemption.ipynb
"""

from __future__ import annotations

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from pagedlab.core.trace import Trace
from pagedlab.viz._common import new_axes, step

USED_COLOR, CACHED_COLOR, CPU_COLOR = "#0072B2", "#009E73", "#D55E00"


def kv_usage(trace: Trace) -> dict[str, list[int]]:
    """Per step: "used" device blocks, "cached_free" (free but still findable by hash) and "cpu_used"."""
    used, cached_free, cpu_used = [], [], []
    for record in trace.steps:
        held = {b for table in record.block_tables for b in table.block_ids}
        used.append(trace.num_blocks - record.num_free_blocks)
        cached_free.append(sum(1 for b in record.cached_blocks if b not in held))
        cpu_used.append(trace.num_cpu_blocks - record.num_free_cpu_blocks if trace.num_cpu_blocks else 0)
    return {"used": used, "cached_free": cached_free, "cpu_used": cpu_used}


def draw_kv_usage(trace: Trace, ax: Axes | None = None) -> Figure:
    """Blocks in use per step of `trace` (and cached free blocks, and CPU blocks, where there are any)."""
    step(trace, 0)  # refuses an empty trace
    usage = kv_usage(trace)
    steps = [r.step for r in trace.steps]
    ax = new_axes(ax, min(4.5 + 0.06 * len(steps), 10), 3.0)
    ax.step(steps, usage["used"], where="mid", color=USED_COLOR, label="device blocks in use", gid="usage-used")
    if any(usage["cached_free"]):
        top = [u + c for u, c in zip(usage["used"], usage["cached_free"])]
        ax.fill_between(steps, usage["used"], top, step="mid", color=CACHED_COLOR, alpha=0.35, linewidth=0,
                        label="free but cached (prefix cache)", gid="usage-cached")
    if any(usage["cpu_used"]):
        ax.step(steps, usage["cpu_used"], where="mid", color=CPU_COLOR, linestyle="--", label="CPU swap blocks in use",
                gid="usage-cpu")
    ax.axhline(trace.num_blocks, color="black", linewidth=0.8, label=f"device pool ({trace.num_blocks} blocks)")
    preempted = [(r.step, trace.num_blocks - r.num_free_blocks) for r in trace.steps if r.preempted]
    if preempted:
        ax.scatter(*zip(*preempted), marker="x", color="black", s=30, zorder=3, label="preemption",
                   gid="usage-preempted")
    ax.set(xlabel="step", ylabel="KV blocks", ylim=(0, 1.08 * max(trace.num_blocks, max(usage["cpu_used"]))))
    ax.set_title("KV blocks over steps", fontsize=9)
    ax.legend(fontsize=7, loc="lower right", framealpha=0.9)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return ax.figure
