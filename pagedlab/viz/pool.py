"""The physical block pool of one step as a grid: one cell per block, coloured by the sequence that holds it.

A held block is drawn in its owner's colour, with its empty slots paled on the right (the fill level); a
block held by several block tables (after a fork) says "x2"; a block whose content is cached by hash carries
a small black triangle; free blocks are grey; blocks allocated in this step have a black border. Once the
trace has swapped, the CPU swap pool is drawn below in a second grid (as far as its highest used block).
Above 128 blocks the grid turns compact (no labels).

# Explained in chapters/02_paged_blocks.ipynb
"""

from __future__ import annotations

import math

from matplotlib.axes import Axes
from matplotlib.collections import PatchCollection
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from pagedlab.core.trace import Trace
from pagedlab.viz._common import new_axes, owners_of, step
from pagedlab.viz.palette import FREE_COLOR, color_map, text_color

COMPACT_ABOVE = 128  # blocks; beyond this, cells carry no text (and a frame stays fast)


def grid_columns(num_blocks: int) -> int:
    """A power of two near sqrt(2 n): 64 blocks -> 16 x 4, 1000 -> 64 x 16."""
    return min(num_blocks, 2 ** math.ceil(math.log2(math.sqrt(2 * num_blocks)))) if num_blocks > 1 else 1


def _draw_grid(ax, gid, num_blocks, ncols, block_size, owners, colors, top, cached=(), new=(), labels=True):
    """Draw one pool of `num_blocks` cells, `ncols` a row, with row 0 at y = top; return the number of rows."""
    nrows = math.ceil(num_blocks / ncols)
    cells, faces, edges, widths, empties = [], [], [], [], []
    new = set(new)
    for block_id in range(num_blocks):
        row, col = divmod(block_id, ncols)
        x, y = col, top - row - 1
        holders, fill = owners.get(block_id, ((), 0))
        face = colors.get(holders[0], FREE_COLOR) if holders else FREE_COLOR
        cells.append(Rectangle((x + 0.05, y + 0.05), 0.9, 0.9))
        faces.append(face)
        edges.append("black" if block_id in new else "white")
        widths.append(1.8 if block_id in new and labels else 0.6 if labels else 0)
        if holders and fill < block_size:
            frac = fill / block_size
            empties.append(Rectangle((x + 0.05 + 0.9 * frac, y + 0.05), 0.9 * (1 - frac), 0.9))
        if labels:
            ink = text_color(face)
            ax.text(x + 0.5, y + 0.5, str(block_id), ha="center", va="center", fontsize=7, color=ink, gid=f"{gid}-id")
            if len(holders) > 1:
                ax.text(x + 0.93, y + 0.08, f"x{len(holders)}", ha="right", va="bottom", fontsize=6,
                        color=ink, fontweight="bold", gid=f"{gid}-refcount")  # fmt: skip
    ax.add_collection(PatchCollection(cells, facecolors=faces, edgecolors=edges, linewidths=widths, gid=gid))
    ax.add_collection(PatchCollection(empties, facecolors="white", alpha=0.6, linewidths=0, gid=f"{gid}-empty"))
    if cached:
        xs = [b % ncols + 0.8 for b in cached]
        ys = [top - b // ncols - 1 + 0.8 for b in cached]
        ax.scatter(xs, ys, marker="v", s=14 if labels else 4, color="black", linewidths=0, gid=f"{gid}-cached")
    return nrows


def cpu_blocks_to_draw(trace: Trace) -> int:
    """How much of the CPU pool to draw: none if the trace never swapped, else the blocks up to the highest
    one ever used, rounded up to a full row (the pool itself may hold millions)."""
    highest = max((b for r in trace.steps for t in r.cpu_block_tables for b in t.block_ids), default=None)
    if highest is None or not trace.num_cpu_blocks:
        return 0
    ncols = grid_columns(trace.num_blocks)
    return min(trace.num_cpu_blocks, math.ceil((highest + 1) / ncols) * ncols)


def draw_block_pool(trace: Trace, index: int, ax: Axes | None = None, *, legend: bool = True) -> Figure:
    """Draw the physical block pool after step `index` of `trace`; return the figure."""
    record = step(trace, index)
    size = trace.block_size
    colors = color_map(trace)
    labels = trace.num_blocks <= COMPACT_ABOVE
    ncols = grid_columns(trace.num_blocks)
    nrows = math.ceil(trace.num_blocks / ncols)
    num_cpu = cpu_blocks_to_draw(trace)
    cpu_rows = math.ceil(num_cpu / ncols)
    ax = new_axes(ax, min(0.42 * ncols + 0.6, 9), 0.42 * (nrows + cpu_rows + 1.5 * bool(cpu_rows)) + 0.9)
    new = {b for _, blocks in record.allocated for b in blocks} | {copy for _, _, copy in record.copied}
    owners = owners_of(record.block_tables, size)
    _draw_grid(ax, "pool", trace.num_blocks, ncols, size, owners, colors, 0, record.cached_blocks, new, labels)
    height = nrows
    if num_cpu:
        shown = "" if num_cpu == trace.num_cpu_blocks else f", first {num_cpu} of {trace.num_cpu_blocks}"
        ax.text(0, -nrows - 0.75, f"CPU swap pool{shown}", fontsize=8, va="center", gid="cpu-pool-title")
        cpu_owners = owners_of(record.cpu_block_tables, size)
        cpu_new = {cpu for _, pairs in record.swapped_out for _, cpu in pairs}
        top = -nrows - 1.1
        height = nrows + 1.1 + _draw_grid(ax, "cpu-pool", num_cpu, ncols, size, cpu_owners, colors, top,
                                          new=cpu_new, labels=num_cpu <= COMPACT_ABOVE)  # fmt: skip
    ax.set_xlim(0, ncols)
    ax.set_ylim(-height, 0)
    ax.set_aspect("equal", anchor="N")
    ax.axis("off")
    used = trace.num_blocks - record.num_free_blocks
    ax.set_title(f"step {record.step}: {used}/{trace.num_blocks} blocks in use, {size} slots each", fontsize=9)
    if legend:
        handles = [
            Patch(facecolor=FREE_COLOR, label="free"),
            Patch(facecolor="#999999", edgecolor="black", label="new this step"),
            Line2D([], [], marker="v", color="black", linestyle="", markersize=4, label="cached (hashed)"),
            Patch(facecolor="white", edgecolor="#999999", label="pale: empty slots"),
            Line2D([], [], marker="$x2$", color="black", linestyle="", markersize=8, label="shared by 2 tables"),
        ]
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0), ncol=3, fontsize=7, frameon=False)
    return ax.figure
