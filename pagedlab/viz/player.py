"""One step as one picture (`render`), a strip of chosen steps (`static_strip`), and a widget player over
them (`animate`).

The player is thin wiring: a `Play` and an `IntSlider` linked in the browser (`jslink`), an `Image` that
shows `render(trace, index)` as PNG and an `HTML` with the step's events. The slider's callback only calls
`render` and `describe_step`, so everything it shows can be tested without a browser. For readers without a
live kernel (GitHub, HTML export, nbval) the player's display also carries a PNG strip of selected steps and
a text summary. DOM contract (the browser test relies on it): the outer box has CSS class `pagedlab-player`,
the picture `pagedlab-frame`, the events text `pagedlab-events`.

# Explained in chapters/02_paged_blocks.ipynb
"""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Sequence

from matplotlib.figure import Figure

from pagedlab.core.trace import Trace
from pagedlab.viz._common import PNGFigure, step, to_png
from pagedlab.viz.events import describe_step, step_events
from pagedlab.viz.pool import cpu_blocks_to_draw, draw_block_pool, grid_columns
from pagedlab.viz.queues import draw_queues
from pagedlab.viz.tables import MAX_ROWS, draw_block_tables


def render(trace: Trace, index: int) -> Figure:
    """Step `index` of `trace` in one figure: the block pool, the block tables and the queues."""
    record = step(trace, index)
    width, pool_width, gap = 11.0, 5.6, 0.25  # inches
    ncols = grid_columns(trace.num_blocks)
    pool_rows = math.ceil(trace.num_blocks / ncols) + _cpu_rows(trace, ncols)
    pool_height = pool_width / ncols * pool_rows + 0.9  # cells are square; room for title and legend
    queues_height = 1.3
    num_tables = min(len(record.block_tables) + len(record.cpu_block_tables), MAX_ROWS)
    height = max(pool_height + queues_height + gap, 0.32 * (max(num_tables, 8) + 2), 3.0)
    fig = PNGFigure(figsize=(width, height), dpi=80)  # fixed axes, no layout engine: a frame must draw fast

    def box(left, bottom, w, h):  # inches -> figure fractions
        return (left / width, bottom / height, w / width, h / height)

    draw_block_pool(trace, index, fig.add_axes(box(0.1, height - pool_height, pool_width, pool_height - 0.3)))
    draw_queues(trace, index, fig.add_axes(box(1.1, 0.05, pool_width - 1.0, queues_height - 0.3)))
    draw_block_tables(trace, index, fig.add_axes(box(7.0, 0.05, width - 7.1, height - 0.35)))
    return fig


def _cpu_rows(trace: Trace, ncols: int) -> int:
    num_cpu = cpu_blocks_to_draw(trace)
    return math.ceil(num_cpu / ncols) + 2 if num_cpu else 0


def is_eventful(trace: Trace, index: int) -> bool:
    """A step worth a frame of its own: a preemption, a copy-on-write, a fork, a swap or an eviction."""
    r = trace.steps[index]
    return bool(r.preempted or r.copied or r.forked or r.swapped_out or r.swapped_in or r.evicted)


def strip_indices(trace: Trace, num_even: int = 5, max_frames: int = 8) -> list[int]:
    """`num_even` evenly spaced steps (first and last included) plus eventful ones, at most `max_frames`."""
    n = len(trace.steps)
    even = {round(i * (n - 1) / max(num_even - 1, 1)) for i in range(min(num_even, n))}
    eventful = [i for i in range(n) if is_eventful(trace, i) and i not in even]
    return sorted(even | set(eventful[: max(max_frames - len(even), 0)]))


def static_strip(trace: Trace, indices: Sequence[int] | None = None) -> Figure:
    """The block pool at each of `indices` (default `strip_indices`), side by side, titled with its step."""
    indices = strip_indices(trace) if indices is None else list(indices)
    if not indices:
        raise ValueError("static_strip needs at least one step index")
    step(trace, indices[0])
    panel = min(2.6, 18 / len(indices))  # inches per panel
    ncols = grid_columns(trace.num_blocks)
    rows = math.ceil(trace.num_blocks / ncols) + _cpu_rows(trace, ncols)
    fig = PNGFigure(figsize=(panel * len(indices), panel / ncols * rows + 0.8), dpi=80, layout="constrained")
    for i, (index, ax) in enumerate(zip(indices, fig.subplots(1, len(indices), squeeze=False)[0])):
        draw_block_pool(trace, index, ax, legend=False)
        record = trace.steps[index]
        marks = [f"preempted {', '.join(record.preempted)}"] if record.preempted else []
        marks += [f"CoW {s}->{c}" for _, s, c in record.copied][:2]
        marks += [f"fork {c}" for _, c in record.forked][:2]
        used = trace.num_blocks - record.num_free_blocks
        ax.set_title(f"step {record.step}: {used}/{trace.num_blocks} used", fontsize=8)
        if marks:
            ax.text(0.5, -0.04, "\n".join(marks), transform=ax.transAxes, ha="center", va="top", fontsize=7)
    return fig


def summary(trace: Trace, indices: Sequence[int], tokenizer=None) -> str:
    """A few lines of text about the trace (the player's text/plain form)."""
    peak = max(trace.num_blocks - r.num_free_blocks for r in trace.steps)
    num_preempted = sum(len(r.preempted) for r in trace.steps)
    num_copies = sum(len(r.copied) for r in trace.steps)
    first, last = trace.steps[indices[0]].step, trace.steps[indices[-1]].step
    lines = [
        f"pagedlab player: {len(indices)} frames (steps {first}-{last}) over {trace.num_blocks} blocks of "
        f"{trace.block_size} slots; peak {peak} blocks in use; {num_preempted} preemptions; "
        f"{num_copies} copy-on-write copies",
    ]
    lines += [describe_step(trace, i, tokenizer) for i in strip_indices(trace) if i in set(indices)]
    return "\n".join(lines)


def events_html(trace: Trace, index: int, tokenizer=None) -> str:
    head = f"<b>step {trace.steps[index].step}</b>"
    items = "".join(f"<li>{html.escape(event, quote=False)}</li>" for event in step_events(trace, index, tokenizer))
    return f"{head}<ul style='margin:0.3em 0; padding-left:1.2em'>{items}</ul>"


class Player:
    """The widget player of `animate`. `widget` is the outer box; `show(position)` draws frame `position`."""

    def __init__(self, trace: Trace, tokenizer=None, indices: Sequence[int] | None = None) -> None:
        import ipywidgets as widgets

        step(trace, 0)  # refuses an empty trace
        self.trace = trace
        self.tokenizer = tokenizer
        self.indices = list(range(len(trace.steps))) if indices is None else list(indices)
        if not self.indices:
            raise ValueError("the player needs at least one step: the trace is empty or indices is []")
        step(trace, self.indices[0])
        last = len(self.indices) - 1
        self.play = widgets.Play(value=0, min=0, max=last, step=1, interval=800, description="play")
        self.slider = widgets.IntSlider(value=0, min=0, max=last, step=1, description="frame",
                                        continuous_update=True)  # fmt: skip
        widgets.jslink((self.play, "value"), (self.slider, "value"))
        self.image = widgets.Image(format="png", layout=widgets.Layout(width="760px"))
        self.image.add_class("pagedlab-frame")
        self.events = widgets.HTML(layout=widgets.Layout(width="340px"))
        self.events.add_class("pagedlab-events")
        self.widget = widgets.VBox([widgets.HBox([self.play, self.slider]), widgets.HBox([self.image, self.events])])
        self.widget.add_class("pagedlab-player")
        self.slider.observe(lambda change: self.show(change["new"]), names="value")
        self.show(0)

    def show(self, position: int) -> None:
        """Draw frame `position` (an index into `indices`): only `render` and `describe_step`'s events."""
        index = self.indices[position]
        self.image.value = to_png(render(self.trace, index))
        self.events.value = events_html(self.trace, index, self.tokenizer)

    def _repr_mimebundle_(self, include=None, exclude=None, **kwargs) -> dict:
        bundle = dict(self.widget._repr_mimebundle_(**kwargs) or {})
        strip = static_strip(self.trace, [i for i in strip_indices(self.trace) if i in set(self.indices)] or None)
        bundle["image/png"] = base64.b64encode(to_png(strip)).decode("ascii")
        bundle["text/plain"] = summary(self.trace, self.indices, self.tokenizer)
        return bundle


def animate(trace: Trace, tokenizer=None, indices: Sequence[int] | None = None) -> Player:
    """A player over the steps `indices` of `trace` (default all): Play, slider, picture, events text."""
    return Player(trace, tokenizer, indices)
