"""One request's speculative decoding, step by step: its block table as the step wrote it (the slots computed
before, the newest token, the drafts accepted and rejected, each cell with its token id and each block with its
physical id) above the table after the rollback, where a block whose slots were all rejected is marked freed.

    draw_speculation(ax, trace, index, request_id)   one step into `ax`
    speculation_frame(trace, index, request_id)      one step as a figure
    animate_speculation(trace, request_id)           the widget player over the steps that scheduled it

The player is `pagedlab.viz.player.Player` with these frames (Play, slider, picture, `describe_step`'s events);
without a live kernel its stored picture is the first steps that rolled back.

# Explained in chapters/11_speculative_decoding.ipynb
"""

from __future__ import annotations

import base64

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from pagedlab.core.trace import Trace
from pagedlab.viz._common import STORED_DPI, PNGFigure, step, to_png
from pagedlab.viz.player import Player, events_html

STATE_COLORS = {"computed": "#d9e2ec", "prompt": "#56B4E9", "newest": "#0072B2", "accepted": "#009E73",
                "rejected": "#D55E00"}
LEGEND = (("computed", "computed before"), ("prompt", "prompt"), ("newest", "newest token"),
          ("accepted", "draft accepted"), ("rejected", "draft rejected"))
UNIT = 0.2  # inches per slot cell


def slot_tokens(trace: Trace, index: int, request_id: str) -> dict[int, int]:
    """The token id at each position the request had written up to and including step `index` (later writes win)."""
    tokens: dict[int, int] = {}
    for record in trace.steps[: index + 1]:
        for work in record.scheduled:
            if work.request_id == request_id:
                tokens.update(enumerate(work.token_ids, start=work.num_computed_tokens))
    return tokens


def widest(trace: Trace, request_id: str) -> int:
    """The most blocks the request's table held in any step (at least 8): the frames' common width."""
    return max([len(w.block_ids) for r in trace.steps for w in r.scheduled if w.request_id == request_id] + [8])


def draw_speculation(ax: Axes, trace: Trace, index: int, request_id: str, num_columns: int | None = None) -> None:
    """Step `index` of `request_id`: its table as the step wrote it (top row) and after the rollback (bottom)."""
    record, size = step(trace, index), trace.block_size
    work = next((w for w in record.scheduled if w.request_id == request_id), None)
    if work is None:
        raise ValueError(f"step {record.step} did not schedule {request_id!r}")
    accepted = {rid: a for rid, _, a in record.verified}.get(request_id, 0)
    start, spec = work.num_computed_tokens, work.num_spec_tokens
    new = work.num_new_tokens - spec
    states = (["computed"] * start + ["prompt" if new > 1 else "newest"] * new + ["accepted"] * accepted
              + ["rejected"] * (spec - accepted))
    after = next((t for t in record.block_tables if t.request_id == request_id), None)
    kept = after.block_ids if after is not None else ()
    tokens = slot_tokens(trace, index, request_id)
    emitted = [t for rid, t in record.appended if rid == request_id]
    rows = [(work.block_ids, len(states)), (kept, after.num_tokens if after is not None else 0)]
    for row, (blocks, num_slots) in enumerate(rows):
        y = 2.1 - 2.1 * row
        for b, block in enumerate(blocks):
            x0 = b * (size + 0.6)
            freed = row == 0 and block not in kept
            for s in range(size):
                position = b * size + s
                state = states[position] if position < num_slots else None
                cell = Rectangle((x0 + s, y), 0.92, 0.92, facecolor=STATE_COLORS.get(state, "white"),
                                 edgecolor="#888888", linewidth=0.5, hatch="///" if state == "rejected" else None)
                cell.set_gid(f"slot-{state or 'empty'}")
                ax.add_patch(cell)
                if state is not None:
                    ax.text(x0 + s + 0.46, y + 0.46, str(tokens[position]), ha="center", va="center", fontsize=6,
                            color="white" if state in ("newest", "accepted", "rejected") else "black")
            ax.text(x0 + size / 2, y + 1.05, f"block {block}" + (" freed" if freed else ""), ha="center",
                    fontsize=6.5, color="#D55E00" if freed else "#333333", fontweight="bold" if freed else None,
                    gid="block-freed" if freed else "block")
        ax.text(-0.4, y + 0.46, "written this step" if row == 0 else "after rollback", ha="right", va="center",
                fontsize=7.5)
    if after is None:
        ax.text(0, 0.46, "finished: all its blocks freed", va="center", fontsize=7.5)
    elif emitted:
        x = len(kept) * (size + 0.6) + 0.2
        ax.text(x, 0.46, f"+ token {emitted[-1]}, drawn from the last kept row (its KV is written next step)",
                va="center", fontsize=7, color="#333333")
    title = f"step {record.step}: seq {request_id} computes {work.num_new_tokens} token(s)"
    if spec:
        title += f", {spec} of them drafts: {accepted} accepted, {spec - accepted} rolled back"
    ax.text(-4.6, 4.65, title, fontsize=8.5, va="center")
    x = -4.6
    for state, name in LEGEND:
        ax.add_patch(Rectangle((x, 3.7), 0.7, 0.6, facecolor=STATE_COLORS[state], edgecolor="#888888",
                               linewidth=0.5, hatch="///" if state == "rejected" else None))
        ax.text(x + 0.9, 4.0, name, fontsize=6.5, va="center")
        x += 7
    ax.set_xlim(-4.6, (num_columns or widest(trace, request_id)) * (size + 0.6))
    ax.set_ylim(-0.2, 5.0)
    ax.axis("off")


def _frame_size(trace: Trace, request_id: str) -> tuple[float, float]:
    """(width, height) in inches of one step's drawing, cells square."""
    return UNIT * (4.6 + widest(trace, request_id) * (trace.block_size + 0.6)), UNIT * 5.2


def speculation_frame(trace: Trace, index: int, request_id: str) -> Figure:
    width, height = _frame_size(trace, request_id)
    fig = PNGFigure(figsize=(width, height), dpi=80)
    draw_speculation(fig.add_axes((0, 0, 1, 1)), trace, index, request_id)
    return fig


def speculation_strip(trace: Trace, indices: list[int], request_id: str) -> Figure:
    """Several steps of the request, one above the other (the player's stored picture)."""
    width, height = _frame_size(trace, request_id)
    fig = PNGFigure(figsize=(width, (height + 0.15) * len(indices)), dpi=80)
    for i, index in enumerate(indices):
        bottom = 1 - (i + 1) / len(indices)
        draw_speculation(fig.add_axes((0, bottom, 1, height / (height + 0.15) / len(indices))), trace, index,
                         request_id)
    return fig


class SpeculationPlayer(Player):
    """`Player` (Play, slider, picture, events) over the steps that scheduled `request_id`, drawn by
    `speculation_frame`."""

    def __init__(self, trace: Trace, request_id: str) -> None:
        self.request_id = request_id
        steps = [i for i, r in enumerate(trace.steps) if any(w.request_id == request_id for w in r.scheduled)]
        if not steps:
            raise ValueError(f"no step of the trace scheduled {request_id!r}")
        super().__init__(trace, None, steps)

    def show(self, position: int) -> None:
        index = self.indices[position]
        self.image.value = to_png(speculation_frame(self.trace, index, self.request_id))
        self.events.value = events_html(self.trace, index)

    def rollback_indices(self) -> list[int]:
        """The steps at which this request's rejected drafts gave slots back (the stored picture shows three)."""
        return [i for i in self.indices if dict(self.trace.steps[i].rolled_back).get(self.request_id)]

    def _repr_mimebundle_(self, include=None, exclude=None, **kwargs) -> dict:
        bundle = dict(self.widget._repr_mimebundle_(**kwargs) or {})
        strip = speculation_strip(self.trace, self.rollback_indices()[:3] or self.indices[:3], self.request_id)
        bundle["image/png"] = base64.b64encode(to_png(strip, dpi=STORED_DPI)).decode("ascii")
        bundle["text/plain"] = f"speculation player: {len(self.indices)} steps of seq {self.request_id}"
        return bundle


def animate_speculation(trace: Trace, request_id: str) -> SpeculationPlayer:
    """A player over the steps of `trace` that scheduled `request_id`, drawing its speculation at each."""
    return SpeculationPlayer(trace, request_id)
