"""The playground panel without a browser: its controls make the settings, "run" redraws, a bad setting says
why, the pool and arena follow the step slider, and readers without a kernel get the figure as PNG.
(tests/browser moves a slider and presses run in JupyterLab.)"""

from __future__ import annotations

from pagedlab.sim.experiment import Settings
from pagedlab.viz.playground import nearest_step, playground, render_arena, render_step, summary

SMALL = dict(num_requests=16, request_rate=4.0, kv_slots=4096, output_mean=24, prompt_mean=64)


def test_run_redraws_from_the_controls():
    panel = playground(**SMALL)
    assert panel.settings() == Settings(**SMALL)
    first = bytes(panel.plots.value)
    assert first.startswith(b"\x89PNG") and "paged:" in panel.status.value and "contiguous:" in panel.status.value
    panel.controls["kv_slots"].value = 2048
    panel.controls["preemption_mode"].value = "swap"
    panel.run_button.click()
    assert panel.settings().kv_slots == 2048 and panel.comparison.settings.preemption_mode == "swap"
    assert bytes(panel.plots.value) != first
    assert sorted(panel.widget._dom_classes) == ["pagedlab-playground"]
    assert "pagedlab-run" in panel.run_button._dom_classes


def test_a_setting_that_cannot_run_says_why_and_keeps_the_last_run():
    panel = playground(**SMALL, max_len=2048)
    plots, comparison = bytes(panel.plots.value), panel.comparison
    panel.controls["kv_slots"].value = 1024
    panel.controls["prompt_kind"].value = "fixed"
    panel.controls["prompt_mean"].value = 1024
    panel.run()
    assert "KV budget" in panel.status.value and bytes(panel.plots.value) == plots and panel.comparison is comparison


def test_the_step_slider_draws_the_pool_and_the_arena_at_that_moment():
    panel = playground(**SMALL)
    before = bytes(panel.pool.value)
    panel.step.value = panel.step.max
    assert bytes(panel.pool.value) != before and bytes(panel.arena.value).startswith(b"\x89PNG")
    comparison = panel.comparison
    moments = [nearest_step(comparison, i) for i in range(len(comparison.paged.steps))]
    assert moments == sorted(moments)
    assert render_step(comparison, 0).axes and render_arena(comparison, 0).axes


def test_readers_without_a_kernel_get_the_figure_and_a_summary():
    panel = playground(**SMALL)
    bundle = panel._repr_mimebundle_()
    assert "image/png" in bundle and "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["text/plain"] == summary(panel.comparison) and "output tok/s" in bundle["text/plain"]
