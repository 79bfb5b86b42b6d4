"""Each step's tokens against the step budget: decode tokens and prefill tokens stacked, one bar per step.

A decode is a sequence that computes exactly one token (`ScheduledRequest.is_decode`); everything else
(prompts, prompt chunks, recomputation) counts as prefill. The dashed line is `max_num_batched_tokens`, when
given. With `show_duration`, each step's wall-clock time is drawn over the bars on a second axis.

# Explained in chapters/08_chunked_prefill.ipynb
"""

from __future__ import annotations

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from pagedlab.core.trace import Trace
from pagedlab.viz._common import new_axes, step

DECODE_COLOR, PREFILL_COLOR, DURATION_COLOR = "#0072B2", "#E69F00", "#000000"


def draw_step_tokens(trace: Trace, budget: int | None = None, ax: Axes | None = None,
                     show_duration: bool = False) -> Figure:
    """Bars of decode and prefill tokens per step of `trace`, the budget line, and optionally step times."""
    step(trace, 0)  # refuses an empty trace
    steps = [r.step for r in trace.steps]
    decode = [r.num_decode_tokens for r in trace.steps]
    prefill = [r.num_prefill_tokens for r in trace.steps]
    ax = new_axes(ax, min(4.5 + 0.08 * len(steps), 10), 3.2)
    width = 0.9 if len(steps) < 200 else 1.0
    ax.bar(steps, decode, width=width, color=DECODE_COLOR, label="decode tokens", gid="tokens-decode")
    ax.bar(steps, prefill, width=width, bottom=decode, color=PREFILL_COLOR, label="prefill tokens",
           gid="tokens-prefill")
    if budget is not None:
        ax.axhline(budget, color="black", linestyle="--", linewidth=1, label=f"budget ({budget} tokens)",
                   gid="tokens-budget")
    ax.set(xlabel="step", ylabel="tokens in the step", xlim=(steps[0] - 0.6, steps[-1] + 0.6))
    ax.set_title("tokens per step: decodes and prefills", fontsize=9)
    handles, labels = ax.get_legend_handles_labels()
    if show_duration:
        right = ax.twinx()
        right.plot(steps, [1e3 * r.duration_s for r in trace.steps], color=DURATION_COLOR, marker=".",
                   markersize=3, linewidth=0.8, label="step time (ms)", gid="tokens-duration")
        right.set_ylabel("step time (ms)")
        right.set_ylim(bottom=0)
        more_handles, more_labels = right.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    ax.legend(handles, labels, fontsize=7, loc="upper right", framealpha=0.9)
    for side in ("top",):
        ax.spines[side].set_visible(False)
    return ax.figure
