"""One colour per sequence, the same in every picture of a trace, readable by colour-blind readers.

Root requests take the Okabe-Ito colours in the order they first appear in the trace (a later lap round the
seven colours is darker); a forked sequence (a sample or a beam, recorded in the trace's `forked` pairs) takes a
shade of its root's colour, so a family reads as one hue. Free blocks are grey.

# Explained in chapters/02_paged_blocks.ipynb
"""

from __future__ import annotations

from matplotlib.colors import to_hex, to_rgb

from pagedlab.core.trace import StepRecord, Trace

# Okabe & Ito (2008), "Color Universal Design", without black (block labels are drawn in black).
OKABE_ITO = ("#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7")
FREE_COLOR = "#DDDDDD"
WAITING_COLOR = "#BBBBBB"
_CHILD_SHADES = (("#FFFFFF", 0.45), ("#000000", 0.30), ("#FFFFFF", 0.70), ("#000000", 0.50))


def mix(color: str, other: str, amount: float) -> str:
    """`color` moved `amount` (0..1) of the way towards `other`."""
    a, b = to_rgb(color), to_rgb(other)
    return to_hex(tuple(x + (y - x) * amount for x, y in zip(a, b)))


def text_color(background: str) -> str:
    """Black or white, whichever reads better on `background` (relative luminance)."""
    r, g, b = to_rgb(background)
    return "black" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.45 else "white"


def _ids_in(record: StepRecord):
    yield from (s.request_id for s in record.scheduled)
    yield from record.running
    yield from (t.request_id for t in record.block_tables)
    yield from (child for _, child in record.forked)
    yield from record.swapped
    yield from record.waiting
    yield from record.preempted
    yield from (rid for rid, _ in record.finished)


def appearance_order(trace: Trace) -> list[str]:
    """Every request id of the trace, in the order it first appears (running before waiting in a step)."""
    seen: dict[str, None] = {}
    for record in trace.steps:
        for rid in _ids_in(record):
            seen.setdefault(rid, None)
    return list(seen)


def roots(trace: Trace) -> dict[str, str]:
    """Forked sequence -> the root it descends from, following the trace's (parent, child) forks."""
    parent_of = {child: parent for record in trace.steps for parent, child in record.forked}

    def root(sequence: str) -> str:
        while sequence in parent_of:
            sequence = parent_of[sequence]
        return sequence

    return {child: root(child) for child in parent_of}


def color_map(trace: Trace) -> dict[str, str]:
    """request_id -> hex colour for every sequence of the trace."""
    order = appearance_order(trace)
    root_of = roots(trace)
    colors: dict[str, str] = {}
    num_children: dict[str, int] = {}
    num_roots = 0
    for rid in order:
        root = root_of.get(rid)
        if root is not None and root in colors:  # a forked sequence: a shade of its root's colour
            k = num_children.get(root, 0)
            num_children[root] = k + 1
            towards, amount = _CHILD_SHADES[k % len(_CHILD_SHADES)]
            colors[rid] = mix(colors[root], towards, amount)
        else:
            lap, slot = divmod(num_roots, len(OKABE_ITO))
            colors[rid] = mix(OKABE_ITO[slot], "#000000", min(0.25 * lap, 0.6))
            num_roots += 1
    return colors


def seq_color(trace: Trace, request_id: str) -> str:
    """The colour of `request_id` in every picture of `trace` (grey if it never appears)."""
    return color_map(trace).get(request_id, WAITING_COLOR)
