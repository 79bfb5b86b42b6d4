"""Each sequence's block table after one step: logical block i -> physical block id, one row per sequence.

A row shows the sequence's id and token count, then one cell per logical block holding the physical block's
id, in the sequence's colour, with the empty slots of its last block paled (the fill count). Swapped
sequences' tables point into the CPU pool and are marked "(CPU)". Tables longer than the columns shown keep
their first and last blocks, with "+n" in between (the header numbers the logical blocks shown); rows past
the last shown are summed up as "+n more".

# Explained in chapters/02_paged_blocks.ipynb
"""

from __future__ import annotations

from matplotlib.axes import Axes
from matplotlib.collections import PatchCollection
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from pagedlab.core.trace import BlockTableSnapshot, Trace
from pagedlab.viz._common import block_fill, new_axes, step
from pagedlab.viz.palette import FREE_COLOR, color_map, text_color

MAX_COLUMNS = 16
MAX_ROWS = 12


def table_rows(trace: Trace, index: int) -> list[tuple[BlockTableSnapshot, str]]:
    """Step `index`'s tables as (table, where): the device tables, then the swapped ones (" (CPU)")."""
    record = step(trace, index)
    return [(t, "") for t in record.block_tables] + [(t, " (CPU)") for t in record.cpu_block_tables]


def shown_columns(longest: int, max_columns: int) -> list[int | None]:
    """The logical blocks drawn as columns, None for the gap: all if they fit, else the first and the last.

        shown_columns(13, 8) == [0, 1, None, 8, 9, 10, 11, 12]
    """
    if longest <= max_columns:
        return list(range(longest))
    head = max(1, (max_columns - 1) // 3)
    tail = max_columns - 1 - head
    return [*range(head), None, *range(longest - tail, longest)]


def draw_tables_at(ax: Axes, trace: Trace, index: int, *, left: float = 0.0, top: float = 0.0,
                   max_columns: int = MAX_COLUMNS, max_rows: int = MAX_ROWS, fontsize: float = 7.0, detail: bool = True,
                   header: str = "logical block", gid: str = "tables") -> tuple[int, int]:
    """Draw step `index`'s block tables with logical block 0's cell at x = left, the header row (`header`,
    then the logical block numbers) just below y = top, one cell a row (the sequence ids hang left of
    `left`); return (columns, table rows) drawn, "+n more" included. detail: each row ends "9 tok, last 1/4"
    (else "9 tok")."""
    size = trace.block_size
    colors = color_map(trace)
    rows = table_rows(trace, index)
    shown, hidden = rows[:max_rows], len(rows) - max_rows
    columns = shown_columns(max((len(t.block_ids) for t, _ in shown), default=1), max_columns)
    grey = "#555555"
    if rows:
        for col, logical in enumerate(columns):
            ax.text(left + col + 0.5, top - 0.3, "…" if logical is None else str(logical), ha="center",
                    va="center", fontsize=fontsize, color=grey, gid=f"{gid}-logical")
        ax.text(left - 0.15, top - 0.3, header, ha="right", va="center", fontsize=fontsize, color=grey)
    cells, faces, empties = [], [], []
    for row, (table, where) in enumerate(shown):
        y = top - 0.6 - row - 1
        color = colors.get(table.request_id, FREE_COLOR)
        ax.text(left - 0.15, y + 0.5, f"{table.request_id}{where}", ha="right", va="center", fontsize=fontsize + 1,
                color="black", fontweight="bold", gid=f"{gid}-seq")
        blocks = table.block_ids
        for col, logical in enumerate(columns):
            x = left + col
            if logical is None:
                num_hidden = min(len(blocks), columns[col + 1]) - columns[col - 1] - 1
                if num_hidden > 0:
                    ax.text(x + 0.5, y + 0.5, f"+{num_hidden}", ha="center", va="center", fontsize=fontsize,
                            gid=f"{gid}-cut")
                continue
            if logical >= len(blocks):
                break
            cells.append(Rectangle((x + 0.05, y + 0.08), 0.9, 0.84))
            faces.append(color)
            fill = block_fill(table, logical, size)
            if fill < size:
                empties.append(Rectangle((x + 0.05 + 0.9 * fill / size, y + 0.08), 0.9 * (1 - fill / size), 0.84))
            ax.text(x + 0.5, y + 0.5, str(blocks[logical]), ha="center", va="center", fontsize=fontsize,
                    color=text_color(color), gid=f"{gid}-block")
        last = block_fill(table, len(blocks) - 1, size) if blocks else 0
        tokens = f"{table.num_tokens} tok, last {last}/{size}" if detail else f"{table.num_tokens} tok"
        ax.text(left + len(columns) + 0.1, y + 0.5, tokens, ha="left", va="center", fontsize=fontsize,
                color="#333333", gid=f"{gid}-tokens")
    if hidden > 0:
        ax.text(left - 0.15, top - 0.6 - len(shown) - 0.5, f"+{hidden} more", ha="right", va="center",
                fontsize=fontsize)
    if not rows:
        ax.text(left, top - 1.1, "no block tables", ha="left", va="center", fontsize=fontsize, color=grey)
    ax.add_collection(PatchCollection(cells, facecolors=faces, edgecolors="white", linewidths=0.6, gid=gid))
    ax.add_collection(PatchCollection(empties, facecolors="white", alpha=0.6, linewidths=0, gid=f"{gid}-empty"))
    return len(columns), max(len(shown), 1) + (hidden > 0)


def draw_block_tables(trace: Trace, index: int, ax: Axes | None = None) -> Figure:
    """Draw every block table after step `index` of `trace` (logical -> physical); return the figure."""
    rows = table_rows(trace, index)
    shown = min(len(rows), MAX_ROWS)
    ncols = len(shown_columns(max((len(t.block_ids) for t, _ in rows[:MAX_ROWS]), default=1), MAX_COLUMNS))
    floor = 8 if ax is not None else 1  # inside a larger figure, a floor on the extent keeps cells small
    ax = new_axes(ax, 1.6 + 0.45 * ncols + 0.9, 0.35 * (shown + 1 + (len(rows) > shown)) + 0.6)
    ncols, nrows = draw_tables_at(ax, trace, index, top=0.6)
    ax.set_xlim(-0.2, max(ncols, floor) + 2.6)
    ax.set_ylim(-max(nrows, floor), 0.6)
    ax.set_aspect("equal", anchor="NW")
    ax.axis("off")
    ax.set_title("block tables: logical -> physical", fontsize=9)
    return ax.figure
