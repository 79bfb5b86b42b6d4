"""One step as one picture (`render`), and a widget player over the steps (`animate`).

The player is thin wiring: a `Play` and an `IntSlider` linked in the browser (`jslink`), an `Image` that
shows `render(trace, index)` as PNG and an `HTML` with the step's events. The slider's callback only calls
`render` and `describe_step`, so everything it shows can be tested without a browser. For readers without a
live kernel (GitHub, HTML export, nbval) the player's display also carries `static_strip`'s PNG of the
steps (pagedlab/viz/strip.py) and a text summary. DOM contract (the browser test relies on it): the outer box
has CSS class `pagedlab-player`, the picture `pagedlab-frame`, the events text `pagedlab-events`.

# Explained in chapters/02_paged_blocks.ipynb
"""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence

from matplotlib.figure import Figure

from pagedlab.core.trace import Trace
from pagedlab.viz._common import STORED_DPI, PNGFigure, step, to_png
from pagedlab.viz.events import describe_step, step_events
from pagedlab.viz.pool import cpu_blocks_to_draw, draw_block_pool, grid_columns, pool_rows
from pagedlab.viz.queues import draw_queues
from pagedlab.viz.strip import static_strip, strip_indices
from pagedlab.viz.tables import MAX_ROWS, draw_block_tables


def render(trace: Trace, index: int) -> Figure:
    """Step `index` of `trace` in one figure: the block pool, the block tables and the queues."""
    record = step(trace, index)
    width, pool_width, gap = 11.0, 5.6, 0.25  # inches
    ncols = grid_columns(trace.num_blocks)
    cpu_title = 0.9 if cpu_blocks_to_draw(trace) else 0.0  # the CPU pool's title needs a little more room
    pool_height = pool_width / ncols * (pool_rows(trace) + cpu_title) + 0.9  # cells are square; title, legend
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
                                        continuous_update=True)
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
        bundle["image/png"] = base64.b64encode(to_png(strip, dpi=STORED_DPI)).decode("ascii")
        bundle["text/plain"] = summary(self.trace, self.indices, self.tokenizer)
        return bundle


def animate(trace: Trace, tokenizer=None, indices: Sequence[int] | None = None) -> Player:
    """A player over the steps `indices` of `trace` (default all): Play, slider, picture, events text."""
    return Player(trace, tokenizer, indices)
