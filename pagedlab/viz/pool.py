"""The physical block pool of one step as a grid: one cell per block, coloured by the sequence that holds it.

A held block is drawn in its owner's colour, with its empty slots paled on the right (the fill level); a
block held by several block tables (after a fork) says "x2"; a block whose content is cached by hash carries
a small black triangle; free blocks are grey; blocks allocated in this step have a black border. The legend
lists only the marks the picture shows. Once the trace has swapped, the CPU swap pool is drawn below in a
second grid (as far as its highest used block). Above 128 blocks the grid turns compact (no labels).

# Explained in chapters/02_paged_blocks.ipynb
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from matplotlib.axes import Axes
from matplotlib.collections import PatchCollection
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from pagedlab.core.trace import Trace
from pagedlab.viz._common import new_axes, owners_of, step
from pagedlab.viz.palette import FREE_COLOR, color_map, text_color

COMPACT_ABOVE = 128  # blocks; beyond this, cells carry no text (and a frame stays fast)
MARKS = ("free", "new", "empty", "shared", "cached")  # what a pool picture can show, in legend order


def grid_columns(num_blocks: int) -> int:
    """A power of two near sqrt(2 n): 64 blocks -> 16 x 4, 1000 -> 64 x 16."""
    return min(num_blocks, 2 ** math.ceil(math.log2(math.sqrt(2 * num_blocks)))) if num_blocks > 1 else 1


def _draw_grid(ax, gid, num_blocks, ncols, block_size, owners, colors, top, cached=(), new=(), labels=True, *,
               left=0.0, unit=1.0, fontsize=7.0):
    """Draw one pool of `num_blocks` cells of side `unit`, `ncols` a row, its top-left corner at (left, top);
    return the number of rows."""
    nrows = math.ceil(num_blocks / ncols)
    cells, faces, edges, widths, empties = [], [], [], [], []
    new = set(new)
    for block_id in range(num_blocks):
        row, col = divmod(block_id, ncols)
        x, y = left + col * unit, top - (row + 1) * unit
        holders, fill = owners.get(block_id, ((), 0))
        face = colors.get(holders[0], FREE_COLOR) if holders else FREE_COLOR
        cells.append(Rectangle((x + 0.05 * unit, y + 0.05 * unit), 0.9 * unit, 0.9 * unit))
        faces.append(face)
        edges.append("black" if block_id in new else "white")
        widths.append(1.8 if block_id in new and labels else 0.6 if labels else 0)
        if holders and fill < block_size:
            frac = fill / block_size
            empties.append(Rectangle((x + (0.05 + 0.9 * frac) * unit, y + 0.05 * unit), 0.9 * (1 - frac) * unit,
                                     0.9 * unit))
        if labels:
            ink = text_color(face)
            ax.text(x + 0.5 * unit, y + 0.5 * unit, str(block_id), ha="center", va="center", fontsize=fontsize,
                    color=ink, gid=f"{gid}-id")
            if len(holders) > 1:
                ax.text(x + 0.93 * unit, y + 0.08 * unit, f"x{len(holders)}", ha="right", va="bottom",
                        fontsize=fontsize - 1, color=ink, fontweight="bold", gid=f"{gid}-refcount")
    ax.add_collection(PatchCollection(cells, facecolors=faces, edgecolors=edges, linewidths=widths, gid=gid))
    ax.add_collection(PatchCollection(empties, facecolors="white", alpha=0.6, linewidths=0, gid=f"{gid}-empty"))
    if cached:
        xs = [left + (b % ncols + 0.8) * unit for b in cached]
        ys = [top - (b // ncols + 1 - 0.8) * unit for b in cached]
        ax.scatter(xs, ys, marker="v", s=(14 if labels else 4) * unit**2, color="black", linewidths=0,
                   gid=f"{gid}-cached")
    return nrows


def cpu_blocks_to_draw(trace: Trace) -> int:
    """How much of the CPU pool to draw: none if the trace never swapped, else the blocks up to the highest
    one ever used, rounded up to a full row (the pool itself may hold millions)."""
    highest = max((b for r in trace.steps for t in r.cpu_block_tables for b in t.block_ids), default=None)
    if highest is None or not trace.num_cpu_blocks:
        return 0
    ncols = grid_columns(trace.num_blocks)
    return min(trace.num_cpu_blocks, math.ceil((highest + 1) / ncols) * ncols)


def pool_rows(trace: Trace) -> float:
    """The height of `draw_pool_at`'s picture in cells: the GPU grid, and the CPU grid with its title."""
    ncols = grid_columns(trace.num_blocks)
    cpu_rows = math.ceil(cpu_blocks_to_draw(trace) / ncols)
    return math.ceil(trace.num_blocks / ncols) + (cpu_rows + 1.1 if cpu_rows else 0)


def draw_pool_at(ax: Axes, trace: Trace, index: int, *, left: float = 0.0, top: float = 0.0, unit: float = 1.0,
                 fontsize: float = 7.0, gid: str = "pool") -> float:
    """Draw the GPU pool (and the CPU pool once the trace swapped) after step `index` with its top-left corner
    at (left, top) in cells of side `unit`; return the height drawn (`pool_rows(trace) * unit`)."""
    record = step(trace, index)
    size = trace.block_size
    colors = color_map(trace)
    labels = trace.num_blocks <= COMPACT_ABOVE
    ncols = grid_columns(trace.num_blocks)
    new = {b for _, blocks in record.allocated for b in blocks} | {copy for _, _, copy in record.copied}
    owners = owners_of(record.block_tables, size)
    nrows = _draw_grid(ax, gid, trace.num_blocks, ncols, size, owners, colors, top, record.cached_blocks, new,
                       labels, left=left, unit=unit, fontsize=fontsize)
    num_cpu = cpu_blocks_to_draw(trace)
    if num_cpu:
        shown = "" if num_cpu == trace.num_cpu_blocks else f", first {num_cpu} of {trace.num_cpu_blocks}"
        ax.text(left, top - (nrows + 0.75) * unit, f"CPU swap pool{shown}", fontsize=fontsize + 1, va="center",
                gid=f"cpu-{gid}-title")
        cpu_owners = owners_of(record.cpu_block_tables, size)
        cpu_new = {cpu for _, pairs in record.swapped_out for _, cpu in pairs}
        _draw_grid(ax, f"cpu-{gid}", num_cpu, ncols, size, cpu_owners, colors, top - (nrows + 1.1) * unit,
                   new=cpu_new, labels=num_cpu <= COMPACT_ABOVE, left=left, unit=unit, fontsize=fontsize)
    return pool_rows(trace) * unit


def marks_present(trace: Trace, index: int) -> set[str]:
    """Which of `MARKS` the pool picture of step `index` shows (the legend lists these and no others)."""
    record = step(trace, index)
    owners = owners_of((*record.block_tables, *record.cpu_block_tables), trace.block_size)
    marks = set()
    if record.num_free_blocks:
        marks.add("free")
    if record.allocated or record.copied or record.swapped_out:
        marks.add("new")
    if any(fill < trace.block_size for _, fill in owners.values()):
        marks.add("empty")
    if any(len(holders) > 1 for holders, _ in owners.values()):
        marks.add("shared")
    if record.cached_blocks:
        marks.add("cached")
    return marks


def legend_handles(marks: Iterable[str]) -> list:
    """One legend entry per mark in `marks`, in the order of `MARKS`."""
    entries = {
        "free": Patch(facecolor=FREE_COLOR, label="free"),
        "new": Patch(facecolor="#999999", edgecolor="black", linewidth=1.5, label="new this step"),
        "empty": Patch(facecolor="white", edgecolor="#999999", label="pale: empty slots"),
        "shared": Line2D(
            [], [], marker="$xN$", color="black", linestyle="", markersize=11, label="shared by N block tables"
        ),
        "cached": Line2D([], [], marker="v", color="black", linestyle="", markersize=4, label="cached (hashed)"),
    }
    marks = set(marks)
    return [entries[mark] for mark in MARKS if mark in marks]


def draw_block_pool(trace: Trace, index: int, ax: Axes | None = None, *, legend: bool = True) -> Figure:
    """Draw the physical block pool after step `index` of `trace`; return the figure."""
    record = step(trace, index)
    ncols = grid_columns(trace.num_blocks)
    height = pool_rows(trace)
    ax = new_axes(ax, min(0.42 * ncols + 0.6, 9), 0.42 * (height + 0.4 * bool(cpu_blocks_to_draw(trace))) + 0.9)
    draw_pool_at(ax, trace, index)
    ax.set_xlim(0, ncols)
    ax.set_ylim(-height, 0)
    ax.set_aspect("equal", anchor="N")
    ax.axis("off")
    used = trace.num_blocks - record.num_free_blocks
    ax.set_title(f"step {record.step}: {used}/{trace.num_blocks} blocks in use, {trace.block_size} slots each",
                 fontsize=9)
    handles = legend_handles(marks_present(trace, index)) if legend else []
    if handles:
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0), ncol=3, fontsize=7, frameon=False)
    return ax.figure
