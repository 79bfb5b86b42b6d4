"""The steps of a trace as a grid of frames in one PNG, for readers without a live kernel (GitHub, nbval).

Each frame is one step: its title (step, blocks in use), the block pool, every block table (logical ->
physical) and a few words on what happened (forks, copy-on-write, preemptions, finishes, prunes, frees).
Frames wrap onto rows so that the picture fits a notebook's width at the stored resolution (`STORED_DPI`),
with text sized to be read there; one legend at the bottom lists the pool marks that some frame shows.
Short traces show every step; long ones evenly spaced steps and the eventful ones.

# Explained in chapters/02_paged_blocks.ipynb
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence

from matplotlib.figure import Figure

from pagedlab.core.trace import Trace
from pagedlab.viz._common import PRUNED, STORED_DPI, PNGFigure, step
from pagedlab.viz.pool import COMPACT_ABOVE, draw_pool_at, grid_columns, legend_handles, marks_present, pool_rows
from pagedlab.viz.tables import draw_tables_at, shown_columns, table_rows

ALL_FRAMES_UP_TO = 16  # a trace this short is drawn step by step
MAX_FRAMES = 12  # a longer one: evenly spaced and eventful steps, at most this many
CELL = 0.32  # inches per block cell: 32 px at the stored 100 dpi
MAX_WIDTH = 9.0  # inches: 900 px, what a notebook shows without scaling it down
FONT = 8.5  # points: about 12 px at the stored resolution
MAX_TABLE_COLUMNS = 8  # logical blocks per table row; longer tables keep their head and tail
MAX_TABLE_ROWS = 8
MAX_NOTE_LINES = 5
GAP = 0.9  # cells between frames


def is_eventful(trace: Trace, index: int) -> bool:
    """A step worth a frame of its own: a preemption, a copy-on-write, a fork, a prune, a restart, a swap or an
    eviction."""
    r = trace.steps[index]
    pruned = any(reason == PRUNED for _, reason in r.finished)
    return bool(r.preempted or r.copied or r.forked or r.swapped_out or r.swapped_in or r.evicted or pruned
                or r.restarted)


def strip_indices(trace: Trace, num_even: int = 6, max_frames: int = MAX_FRAMES) -> list[int]:
    """Every step of a short trace (up to `ALL_FRAMES_UP_TO`); else `num_even` evenly spaced steps (first and
    last included) plus eventful ones, at most `max_frames`."""
    n = len(trace.steps)
    if n <= ALL_FRAMES_UP_TO:
        return list(range(n))
    even = {round(i * (n - 1) / max(num_even - 1, 1)) for i in range(min(num_even, n))}
    eventful = [i for i in range(n) if is_eventful(trace, i) and i not in even]
    return sorted(even | set(eventful[: max(max_frames - len(even), 0)]))


def frame_notes(trace: Trace, index: int) -> list[str]:
    """What happened at step `index`, in a few words per event (`describe_step` says it in full)."""
    record = step(trace, index)
    swapped_out = {rid for rid, _ in record.swapped_out}
    previous = set(trace.steps[index - 1].running) if index % len(trace.steps) else set()
    notes = [f"{rid} preempted ({'swap' if rid in swapped_out else 'recompute'})" for rid in record.preempted]
    notes += [f"{rid} swapped in" for rid, _ in record.swapped_in]
    notes += [f"{s.request_id} prefilled {s.num_new_tokens} tokens" for s in record.scheduled
              if s.request_id not in previous and s.num_new_tokens > 1]
    children: dict[str, list[str]] = {}
    for parent, child in record.forked:
        children.setdefault(parent, []).append(child)
    notes += [f"{', '.join(kids)} forked from {parent}" for parent, kids in children.items()]
    notes += [f"{rid} copy-on-write {source} → {copy}" for rid, source, copy in record.copied]
    ended: dict[str, list[str]] = {}
    for rid, reason in record.finished:
        ended.setdefault("pruned" if reason == PRUNED else f"finished ({reason})", []).append(rid)
    notes += [f"{', '.join(rids)} {how}" for how, rids in ended.items()]
    notes += [f"beam search {group} restarts as {root}" for group, root in record.restarted]
    if record.freed:
        notes.append("freed " + ", ".join(map(str, record.freed)))
    if record.evicted:
        notes.append("evicted " + ", ".join(map(str, record.evicted)))
    return notes


def _wrap(notes: list[str], width_chars: int) -> list[str]:
    lines = [line for note in notes for line in textwrap.wrap(note, width_chars, subsequent_indent="  ")]
    if len(lines) > MAX_NOTE_LINES:
        lines = lines[: MAX_NOTE_LINES - 1] + [f"(+{len(lines) - MAX_NOTE_LINES + 1} lines: see describe_step)"]
    return lines


def _text_cells(chars: int, fontsize: float) -> float:
    """About how many cells `chars` characters of text take at `fontsize` points."""
    return chars * 0.6 * fontsize / 72 / CELL


def static_strip(trace: Trace, indices: Sequence[int] | None = None) -> Figure:
    """Frames of the steps `indices` (default `strip_indices`): pool, block tables and events of each."""
    indices = strip_indices(trace) if indices is None else list(indices)
    if not indices:
        raise ValueError("static_strip needs at least one step index")
    records = [step(trace, i) for i in indices]
    ncols = grid_columns(trace.num_blocks)
    labels = trace.num_blocks <= COMPACT_ABOVE
    # A pool cell, in cells: full size up to 8 columns (32 blocks), smaller beyond, without labels above 128.
    unit = 1.0 if ncols <= 8 else max(0.7, 8 / ncols) if labels else min(1.0, 12 / ncols)
    pool_font = FONT if unit == 1.0 else 7.5
    tables = [table_rows(trace, i) for i in indices]
    longest = max((len(t.block_ids) for rows in tables for t, _ in rows[:MAX_TABLE_ROWS]), default=1)
    table_cols = len(shown_columns(longest, MAX_TABLE_COLUMNS))
    names = [f"{t.request_id}{where}" for rows in tables for t, where in rows[:MAX_TABLE_ROWS]] + ["logical"]
    label_w = _text_cells(max(map(len, names)), FONT + 1) + 0.3
    tokens_w = _text_cells(len(f"{max((t.num_tokens for r in tables for t, _ in r), default=0)} tok"), FONT) + 0.3
    width = max(ncols * unit, label_w + table_cols + tokens_w)  # one frame, in cells
    per_row = max(1, int((MAX_WIDTH / CELL + GAP) // (width + GAP)))
    per_row = min(per_row, len(indices))
    per_row = math.ceil(len(indices) / math.ceil(len(indices) / per_row))  # balance the rows
    notes = [_wrap(frame_notes(trace, i), max(12, int(width * CELL * 72 / (0.6 * FONT)))) for i in indices]
    num_rows = max((min(len(rows), MAX_TABLE_ROWS) + (len(rows) > MAX_TABLE_ROWS) for rows in tables), default=1)
    note_h = 0.55 * max(map(len, notes))
    height = 0.9 + pool_rows(trace) * unit + 0.35 + 0.6 + max(num_rows, 1) + 0.25 + note_h  # one frame
    marks = set().union(*(marks_present(trace, i) for i in indices))
    legend_h = 1.0 if marks else 0.0
    grid_rows = math.ceil(len(indices) / per_row)
    fig_w = per_row * width + (per_row - 1) * GAP + 0.4
    fig_h = grid_rows * height + (grid_rows - 1) * 0.5 + legend_h + 0.2
    fig = PNGFigure(figsize=(fig_w * CELL, fig_h * CELL), dpi=STORED_DPI)
    ax = fig.add_axes((0, 0, 1, 1))
    for k, (index, record) in enumerate(zip(indices, records)):
        row, col = divmod(k, per_row)
        left, top = 0.2 + col * (width + GAP), -0.1 - row * (height + 0.5)
        used = trace.num_blocks - record.num_free_blocks
        ax.text(left, top - 0.45, f"step {record.step}: {used}/{trace.num_blocks} blocks in use", fontsize=FONT + 1.5,
                fontweight="bold", va="center", gid="strip-title")
        y = top - 0.9
        y -= draw_pool_at(ax, trace, index, left=left, top=y, unit=unit, fontsize=pool_font, gid=f"strip-pool-{k}")
        y -= 0.35
        _, rows = draw_tables_at(ax, trace, index, left=left + label_w, top=y, max_columns=MAX_TABLE_COLUMNS,
                                 max_rows=MAX_TABLE_ROWS, fontsize=FONT, detail=False, header="logical",
                                 gid=f"strip-tables-{k}")
        y -= 0.6 + rows + 0.25
        for line_no, line in enumerate(notes[k]):
            ax.text(left, y - 0.55 * line_no - 0.27, line, fontsize=FONT, va="center", color="#222222",
                    gid="strip-note")
    handles = legend_handles(marks)
    if handles:
        ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0.2 / fig_w, 0.1 / fig_h), ncol=len(handles),
                  fontsize=FONT, frameon=False, borderaxespad=0, handlelength=1.5, columnspacing=1.2)
    ax.set_xlim(0, fig_w)
    ax.set_ylim(-fig_h, 0)
    ax.axis("off")
    return fig
