"""Helpers shared by the pictures: a figure without pyplot, PNG bytes, and what a step's tables hold.

Figures are made as `PNGFigure`s (a `matplotlib.figure.Figure`), not with pyplot, so that drawing never touches
global state, never opens a window and works under any backend (PNG output goes through Agg). A notebook shows
one returned as the last value of a cell, once, whether or not the inline backend is set up.

# Explained in chapters/02_paged_blocks.ipynb
"""

from __future__ import annotations

import io

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from pagedlab.core.trace import BlockTableSnapshot, StepRecord, Trace

PRUNED = "pruned"  # the finish reason of a beam that beam search dropped (`StepRecord.finished`)
STORED_DPI = 100  # the resolution of every PNG a notebook stores: figures are sized for it


def to_png(fig: Figure, dpi: int = 80) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


class PNGFigure(Figure):
    """A figure that IPython displays as PNG without pyplot."""

    def _repr_png_(self) -> bytes:
        return to_png(self, dpi=STORED_DPI)


def new_axes(ax: Axes | None, width: float, height: float) -> Axes:
    """`ax` itself, or the single axes of a new figure of that size in inches."""
    if ax is not None:
        return ax
    fig = PNGFigure(figsize=(width, height), dpi=80, layout="constrained")
    return fig.add_subplot()


def step(trace: Trace, index: int) -> StepRecord:
    if not trace.steps:
        raise ValueError("the trace has no steps: run the engine with record_trace=True first")
    return trace.steps[index]


def block_fill(table: BlockTableSnapshot, position: int, block_size: int) -> int:
    """Token slots in use in logical block `position` of the table."""
    if position < len(table.block_ids) - 1:
        return block_size
    return max(0, min(block_size, table.num_tokens - (len(table.block_ids) - 1) * block_size))


def owners_of(tables, block_size: int) -> dict[int, tuple[list[str], int]]:
    """physical block -> (its holders in table order, slots in use), from a step's block table snapshots."""
    owners: dict[int, tuple[list[str], int]] = {}
    for table in tables:
        for position, block_id in enumerate(table.block_ids):
            holders, fill = owners.get(block_id, ([], 0))
            holders.append(table.request_id)
            owners[block_id] = (holders, max(fill, block_fill(table, position, block_size)))
    return owners
