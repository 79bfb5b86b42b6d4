"""Each sequence's block table after one step: logical block i -> physical block id, one row per sequence.

A row shows the sequence's id and token count, then one cell per logical block holding the physical block's
id, in the sequence's colour, with the empty slots of its last block paled (the fill count). Swapped
sequences' tables point into the CPU pool and are marked "(CPU)". Long tables and many rows are cut with
"+n more".

# Explained in chapters/02_paged_blocks.ipynb
"""

from __future__ import annotations

from matplotlib.axes import Axes
from matplotlib.collections import PatchCollection
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from pagedlab.core.trace import Trace
from pagedlab.viz._common import block_fill, new_axes, step
from pagedlab.viz.palette import FREE_COLOR, color_map, text_color

MAX_COLUMNS = 16
MAX_ROWS = 12


def draw_block_tables(trace: Trace, index: int, ax: Axes | None = None) -> Figure:
    """Draw every block table after step `index` of `trace` (logical -> physical); return the figure."""
    record = step(trace, index)
    size = trace.block_size
    colors = color_map(trace)
    rows = [(t, "") for t in record.block_tables] + [(t, " (CPU)") for t in record.cpu_block_tables]
    shown, hidden = rows[:MAX_ROWS], len(rows) - MAX_ROWS
    ncols = min(MAX_COLUMNS, max((len(t.block_ids) for t, _ in shown), default=1))
    floor = 8 if ax is not None else 1  # inside a larger figure, a floor on the extent keeps cells small
    ax = new_axes(ax, 1.6 + 0.45 * ncols + 0.9, 0.35 * (len(shown) + 1 + (hidden > 0)) + 0.6)
    for col in range(ncols):
        ax.text(col + 0.5, 0.3, str(col), ha="center", va="center", fontsize=7, color="#555555", gid="tables-logical")
    ax.text(-0.15, 0.3, "logical block", ha="right", va="center", fontsize=7, color="#555555")
    cells, faces, empties = [], [], []
    for row, (table, where) in enumerate(shown):
        y = -row - 1
        color = colors.get(table.request_id, FREE_COLOR)
        ax.text(-0.15, y + 0.5, f"{table.request_id}{where}", ha="right", va="center", fontsize=8,
                color="black", fontweight="bold", gid="tables-seq")  # fmt: skip
        blocks = table.block_ids
        cut = len(blocks) > ncols
        visible = blocks[: ncols - 1] if cut else blocks
        for col, block_id in enumerate(visible):
            cells.append(Rectangle((col + 0.05, y + 0.08), 0.9, 0.84))
            faces.append(color)
            fill = block_fill(table, col, size)
            if fill < size:
                empties.append(Rectangle((col + 0.05 + 0.9 * fill / size, y + 0.08), 0.9 * (1 - fill / size), 0.84))
            ax.text(col + 0.5, y + 0.5, str(block_id), ha="center", va="center", fontsize=7,
                    color=text_color(color), gid="tables-block")  # fmt: skip
        if cut:
            ax.text(ncols - 0.5, y + 0.5, f"+{len(blocks) - len(visible)}", ha="center", va="center", fontsize=7)
        last = block_fill(table, len(blocks) - 1, size) if blocks else 0
        ax.text(ncols + 0.1, y + 0.5, f"{table.num_tokens} tok, last {last}/{size}", ha="left", va="center",
                fontsize=7, color="#333333", gid="tables-tokens")  # fmt: skip
    if hidden > 0:
        ax.text(-0.15, -len(shown) - 0.5, f"+{hidden} more", ha="right", va="center", fontsize=7)
    if not rows:
        ax.text(ncols / 2, -0.5, "no block tables", ha="center", va="center", fontsize=8, color="#555555")
    ax.add_collection(PatchCollection(cells, facecolors=faces, edgecolors="white", linewidths=0.6, gid="tables"))
    ax.add_collection(PatchCollection(empties, facecolors="white", alpha=0.6, linewidths=0, gid="tables-empty"))
    ax.set_xlim(-0.2, max(ncols, floor) + 2.6)
    ax.set_ylim(-max(len(shown), floor) - (hidden > 0), 0.6)
    ax.set_aspect("equal", anchor="NW")
    ax.axis("off")
    ax.set_title("block tables: logical -> physical", fontsize=9)
    return ax.figure
