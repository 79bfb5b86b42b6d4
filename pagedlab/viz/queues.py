"""The scheduler's queues after one step: waiting, running and swapped, as lanes of boxes in queue order.

Each box is a sequence in its colour. A sequence preempted in this step carries a dashed black border; one
that finished in this step closes the running lane as a white box marked "done" (or "pruned", a beam that
beam search dropped).

# Explained in chapters/02_paged_blocks.ipynb
"""

from __future__ import annotations

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch

from pagedlab.core.trace import Trace
from pagedlab.viz._common import PRUNED, new_axes, step
from pagedlab.viz.palette import FREE_COLOR, color_map, text_color

MAX_PER_LANE = 10
LANES = ("waiting", "running", "swapped")


def draw_queues(trace: Trace, index: int, ax: Axes | None = None) -> Figure:
    """Draw the waiting, running and swapped queues after step `index` of `trace`; return the figure."""
    record = step(trace, index)
    colors = color_map(trace)
    preempted = set(record.preempted)
    finished = {rid: "pruned" if reason == PRUNED else "done" for rid, reason in record.finished}
    lanes = {"waiting": record.waiting, "running": record.running, "swapped": record.swapped}
    ax = new_axes(ax, 1.2 + 0.75 * MAX_PER_LANE, 1.5)
    for row, name in enumerate(LANES):
        y = -row - 1
        ids = list(lanes[name])
        ax.text(-0.2, y + 0.5, f"{name} ({len(ids)})", ha="right", va="center", fontsize=8, gid="queues-lane")
        extra = [(rid, True) for rid in finished] if name == "running" else []
        items = [(rid, False) for rid in ids] + extra
        for col, (rid, done) in enumerate(items[:MAX_PER_LANE]):
            color = colors.get(rid, FREE_COLOR)
            dashed = rid in preempted and not done
            box = FancyBboxPatch((col + 0.08, y + 0.12), 0.84, 0.76, boxstyle="round,pad=0,rounding_size=0.12",
                                 facecolor="white" if done else color, edgecolor="black" if dashed else color,
                                 linestyle="--" if dashed else "-", linewidth=1.2, gid=f"queue-{name}")
            ax.add_patch(box)
            label = f"{rid}\n{finished[rid]}" if done else rid
            size = 6 if done else 7 if len(label) < 6 else 5.5
            ax.text(col + 0.5, y + 0.5, label, ha="center", va="center", fontsize=size, linespacing=0.9,
                    color="#555555" if done else text_color(color), gid=f"queue-{name}-label")
        if len(items) > MAX_PER_LANE:
            ax.text(MAX_PER_LANE + 0.1, y + 0.5, f"+{len(items) - MAX_PER_LANE}", va="center", fontsize=7)
    ax.set_xlim(-0.1, MAX_PER_LANE + 0.6)
    ax.set_ylim(-len(LANES), 0)
    ax.axis("off")
    note = f"; preempted: {', '.join(record.preempted)}" if record.preempted else ""
    ax.set_title(f"queues after step {record.step}{note}", fontsize=9)
    return ax.figure
