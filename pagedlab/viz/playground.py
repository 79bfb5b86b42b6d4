"""The playground: sliders and toggles for a workload and an engine, a "run" button, and the paged engine
against contiguous memory on the same settings, drawn side by side.

    from pagedlab.viz import playground
    playground()                                  # in JupyterLab: move a slider, press run

Thin wiring over pure parts: the widgets make a `pagedlab.sim.experiment.Settings`, `experiment.run` simulates
both systems (the engine's own scheduler and block manager, no model), `render_comparison` draws the figure,
and `render_step` draws any step's block pool (and the contiguous arena at the same moment). For readers
without a live kernel the display also carries the figure of the first run as PNG. DOM contract (the browser
test relies on it): the outer box has CSS class `pagedlab-playground`, the run button `pagedlab-run`, the figure
`pagedlab-playground-plots`, each control `pagedlab-control-<setting name>`.

# Explained in chapters/14_playground.ipynb
"""

from __future__ import annotations

import base64
import html

from matplotlib.figure import Figure

from pagedlab.sim import experiment, metrics
from pagedlab.sim.experiment import Comparison, Settings
from pagedlab.sim.synthetic_workload import LENGTH_KINDS
from pagedlab.viz._common import PNGFigure, to_png
from pagedlab.viz.compare import draw_arena, render_comparison
from pagedlab.viz.player import render

POWERS_OF_TWO = tuple(2**k for k in range(9))  # 1 .. 256


def nearest_step(comparison: Comparison, index: int) -> int:
    """The contiguous step running at the moment paged step `index` ends."""
    moment = comparison.paged.step_end_s[index]
    ends = comparison.contiguous.step_end_s
    return next((i for i, end in enumerate(ends) if end >= moment), len(ends) - 1)


def render_step(comparison: Comparison, index: int) -> Figure:
    """Paged step `index`: its block pool, block tables and queues (`pagedlab.viz.render`)."""
    return render(comparison.paged, index)


def render_arena(comparison: Comparison, index: int) -> Figure:
    """The contiguous arena at the moment paged step `index` ends."""
    fig = PNGFigure(figsize=(11, 1.6), dpi=80)
    draw_arena(comparison.contiguous, nearest_step(comparison, index), fig.add_axes((0.01, 0.02, 0.98, 0.8)))
    return fig


def summary(comparison: Comparison) -> str:
    """The run in a few sentences: throughput, median latencies, KV use, preemptions."""
    lines = []
    for name, trace in (("paged", comparison.paged), ("contiguous", comparison.contiguous)):
        latencies = metrics.latencies(trace)
        used = metrics.time_average(trace, metrics.kv_breakdown(trace)["used"]) / metrics.kv_slots(trace)
        preempted = sum(metrics.num_preemptions(trace).values())
        lines.append(
            f"{name}: {len(trace.steps)} steps, {metrics.makespan(trace):.1f} s simulated, "
            f"{metrics.output_throughput(trace):.0f} output tok/s, "
            f"median TTFT {metrics.median(latencies.ttft_s):.2f} s, "
            f"median TPOT {metrics.median(latencies.tpot_s):.3f} s, {used:.0%} of the KV slots in use, "
            f"{preempted} preemptions"
        )
    return "\n".join(lines)


class Playground:
    """The widget panel of `playground()`. `widget` is the outer box; `run()` simulates the controls' settings."""

    def __init__(self, settings: Settings | None = None, calibration=None) -> None:
        import ipywidgets as widgets

        self.calibration = calibration
        self.comparison: Comparison | None = None
        self.num_runs = 0  # runs that drew; the status line names the latest
        s = settings or Settings()
        w, wide = widgets, {"description_width": "initial"}
        self.controls = {
            "block_size": w.SelectionSlider(options=POWERS_OF_TWO, value=s.block_size, description="block size"),
            "kv_slots": w.SelectionSlider(options=tuple(2**k for k in range(10, 18)), value=s.kv_slots,
                                          description="KV budget (slots)"),
            "max_num_seqs": w.SelectionSlider(options=POWERS_OF_TWO, value=s.max_num_seqs, description="max_num_seqs"),
            "max_num_batched_tokens": w.SelectionSlider(options=tuple(2**k for k in range(8, 14)),
                                                        value=s.max_num_batched_tokens,
                                                        description="max_num_batched_tokens"),
            "request_rate": w.FloatLogSlider(value=s.request_rate, base=10, min=-1, max=2, step=0.1,
                                             description="arrivals (req/s)"),
            "burstiness": w.FloatLogSlider(value=s.burstiness, base=10, min=-1, max=0.5, step=0.1,
                                           description="burstiness (1: Poisson)"),
            "num_requests": w.IntSlider(value=s.num_requests, min=10, max=500, step=10, description="requests"),
            "prompt_kind": w.Dropdown(options=LENGTH_KINDS, value=s.prompt_kind, description="prompt lengths"),
            "prompt_mean": w.IntSlider(value=s.prompt_mean, min=8, max=1024, step=8, description="prompt mean"),
            "output_kind": w.Dropdown(options=LENGTH_KINDS, value=s.output_kind, description="output lengths"),
            "output_mean": w.IntSlider(value=s.output_mean, min=8, max=1024, step=8, description="output mean"),
            "shared_prefix_fraction": w.FloatSlider(value=s.shared_prefix_fraction, min=0, max=1, step=0.05,
                                                    description="shared prefix (share)"),
            "prefix_len": w.IntSlider(value=s.prefix_len, min=0, max=1024, step=16, description="prefix length"),
            "n": w.IntSlider(value=s.n, min=1, max=8, description="samples n"),
            "preemption_mode": w.ToggleButtons(options=("recompute", "swap", "auto"), value=s.preemption_mode,
                                               description="preemption"),
            "enable_partial_preemption": w.Checkbox(value=s.enable_partial_preemption,
                                                    description="partial preemption"),
            "enable_chunked_prefill": w.Checkbox(value=s.enable_chunked_prefill, description="chunked prefill"),
            "enable_prefix_caching": w.Checkbox(value=s.enable_prefix_caching, description="prefix caching"),
            "contiguous_batching": w.ToggleButtons(options=("continuous", "static"), value=s.contiguous_batching,
                                                   description="contiguous batching"),
        }
        for name, control in self.controls.items():
            control.style = wide
            control.layout = w.Layout(width="330px")
            control.add_class(f"pagedlab-control-{name}")
        self.base = s
        self.run_button = w.Button(description="run", button_style="primary", icon="play")
        self.run_button.add_class("pagedlab-run")
        self.status = w.HTML()
        self.status.add_class("pagedlab-playground-status")
        self.plots = w.Image(format="png", layout=w.Layout(width="1040px"))
        self.plots.add_class("pagedlab-playground-plots")
        self.step = w.IntSlider(value=0, min=0, max=0, description="step", continuous_update=False,
                                layout=w.Layout(width="700px"))
        self.pool = w.Image(format="png", layout=w.Layout(width="880px"))
        self.pool.add_class("pagedlab-playground-pool")
        self.arena = w.Image(format="png", layout=w.Layout(width="880px"))
        controls = w.GridBox(list(self.controls.values()), layout=w.Layout(grid_template_columns="repeat(3, 340px)"))
        self.widget = w.VBox([controls, w.HBox([self.run_button, self.status]), self.plots, self.step, self.pool,
                              self.arena])
        self.widget.add_class("pagedlab-playground")
        self.run_button.on_click(lambda _: self.run())
        self.step.observe(lambda change: self.show_step(change["new"]), names="value")
        self.run()

    def settings(self) -> Settings:
        """The settings the controls show now."""
        return self.base.replace(**{name: control.value for name, control in self.controls.items()})

    def run(self) -> None:
        """Simulate the controls' settings and redraw; a setting that cannot run says why in the status line."""
        self.status.value = "running…"
        try:
            comparison = experiment.run(self.settings(), self.calibration)
        except ValueError as error:
            self.status.value = f"<span style='color:#B00'>{html.escape(str(error))}</span>"
            return
        self.comparison = comparison
        self.num_runs += 1
        self.plots.value = to_png(render_comparison(comparison))
        lines = [f"run {self.num_runs}:", *summary(comparison).splitlines()]
        self.status.value = "<br>".join(html.escape(line) for line in lines)
        last = len(comparison.paged.steps) - 1
        self.step.max, self.step.value = last, min(self.step.value, last)
        self.show_step(self.step.value)

    def show_step(self, index: int) -> None:
        """Draw paged step `index` and the contiguous arena at that moment."""
        if self.comparison is None:
            return
        self.pool.value = to_png(render_step(self.comparison, index))
        self.arena.value = to_png(render_arena(self.comparison, index))

    def _repr_mimebundle_(self, include=None, exclude=None, **kwargs) -> dict:
        bundle = dict(self.widget._repr_mimebundle_(**kwargs) or {})
        if self.comparison is not None:  # None only if the first run's settings could not run
            bundle["image/png"] = base64.b64encode(to_png(render_comparison(self.comparison))).decode("ascii")
            bundle["text/plain"] = summary(self.comparison)
        return bundle


def playground(settings: Settings | None = None, calibration=None, **changes) -> Playground:
    """The playground panel, starting from `settings` (default `Settings()`) with `changes` applied."""
    return Playground((settings or Settings()).replace(**changes), calibration)


__all__ = ["Playground", "nearest_step", "playground", "render_arena", "render_step", "summary"]
