"""The whole calibration, as `pagedlab bench --workload calibrate` runs it: measure the engine on the fit
workloads, fit the step cost model, then measure its error on held-out workloads, step by step (same steps,
median of the repeats) and in real time (requests arriving by the wall clock, compared by latency).

The result is a `Calibration` (what `simulate` uses; `pagedlab/sim/calibration.json` is the one shipped) that
carries its own noise and error figures, so that the README's statement is printed from the file.

# Explained in chapters/14_playground.ipynb
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from pagedlab.core.preemption import PreemptionCostModel
from pagedlab.sim import cost_fit as cal
from pagedlab.sim import metrics
from pagedlab.sim.cost_model import Calibration
from pagedlab.sim.simulator import simulate


def _max_len(requests) -> int:
    return max(r.num_prompt_tokens + r.output_len for r in requests)


def serving_error(model, tokenizer, cost_model, repeats: int = 2, scale: float = 1.0, seed: int = 200) -> dict:
    """Real-time arrivals through the engine against `simulate` on the same arrival times: median TTFT, median
    TPOT and makespan, per repeat (relative error of the simulation)."""
    requests = cal.serving_workload(seed, scale)
    runs, sim_values = [], None
    runs = []
    for _ in range(repeats):
        real = cal.serve(model, tokenizer, requests, max_model_len=_max_len(requests), preemption_mode="recompute")
        if sim_values is None:  # the same engine settings: its KV pool, its max_model_len
            simulated = simulate(requests, cost_model=cost_model, num_kv_blocks=real["trace"].num_blocks,
                                 max_model_len=_max_len(requests), preemption_mode="recompute")
            sim = metrics.latencies(simulated)
            sim_values = {"ttft_p50_s": metrics.median(sim.ttft_s), "tpot_p50_s": metrics.median(sim.tpot_s),
                          "makespan_s": metrics.makespan(simulated)}
        times: dict[str, list[float]] = {rid: [] for rid in real["arrival_s"]}
        for record, end in zip(real["trace"], real["step_end_s"]):
            for sequence_id, _ in record.appended:
                times[sequence_id].append(end)
        ttft = [t[0] - real["arrival_s"][rid] for rid, t in times.items()]
        tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in times.values() if len(t) > 1]
        runs.append({"ttft_p50_s": metrics.median(ttft), "tpot_p50_s": metrics.median(tpot),
                     "makespan_s": real["step_end_s"][-1] - min(real["arrival_s"].values())})
    return {"simulated": sim_values, "real": runs,
            "error": {k: [sim_values[k] / run[k] - 1 for run in runs] for k in sim_values}}


def run_calibration(model, tokenizer, repeats: int = 3, scale: float = 1.0, seed: int = 0,
                    progress: Callable[[str], None] | None = None) -> tuple[Calibration, dict]:
    """Measure, fit and validate (see the module docstring). Returns the calibration and the raw step times
    (name -> `StepTimes`) of every workload measured."""
    from pagedlab.bench.report import machine_info

    say = progress or (lambda _: None)
    measured, engine = {}, None
    groups = (("fit", cal.fit_workloads(seed, scale)), ("validate", cal.validation_workloads(seed + 100, scale)))
    for group, workloads in groups:
        for name, (requests, config) in workloads.items():
            say(f"calibrate: {group} {name}")
            measured[name], last = cal.measure_steps(model, tokenizer, name, requests, repeats,
                                                     **{"max_model_len": _max_len(requests), **config})
            engine = last if last.cost_model is not None else engine
    p, bytes_per_block = engine.cost_model, engine.worker.info.bytes_per_block
    block_size = engine.config.block_size
    preemption = PreemptionCostModel(bytes_per_block, block_size, p.copy_bytes_per_s, p.prefill_tokens_per_s)
    fit_names = list(cal.fit_workloads(seed, scale))
    step_cost = cal.fit([measured[n] for n in fit_names], swap_block_s=bytes_per_block / p.copy_bytes_per_s)
    say("calibrate: serving in real time")
    serving = serving_error(model, tokenizer, step_cost, repeats=max(1, repeats - 1), scale=scale, seed=seed + 200)
    errors = {name: dataclasses.asdict(cal.step_error(step_cost, times)) for name, times in measured.items()}
    for name in errors:
        errors[name]["fitted"] = name in fit_names
        errors[name]["total_error"] = cal.step_error(step_cost, measured[name]).total_error
    calibration = Calibration(
        step_cost, preemption, bytes_per_block // block_size, machine_info(model),
        {name: cal.noise(times) for name, times in measured.items()}, {"steps": errors, "serving": serving},
    )
    return calibration, measured


def error_summary(calibration: Calibration) -> str:
    """The calibration's coefficients and errors in Markdown: what chapter 14 shows and the README states
    (tests/sim/test_sim.py checks that the README's copy is this text for the shipped calibration)."""
    c, m = calibration.step_cost, calibration.machine
    steps, serving = calibration.error["steps"], calibration.error["serving"]
    spread = max(n["total_spread"] for n in calibration.noise.values())
    percents = lambda values: ", ".join(f"{e:+.0%}" for e in values)  # noqa: E731
    threads, model = m.get("threads"), Path(str(m.get("model"))).name
    lines = [
        f"Measured on {m.get('cpu', 'this CPU')} with {threads} torch thread{'' if threads == 1 else 's'}, {model} in "
        f"{m.get('dtype')}: a step costs {1e3 * c.overhead_s:.1f} ms, plus {1e3 * c.prefill_token_s:.2f} ms per "
        f"prefill token, {1e3 * c.decode_token_s:.2f} ms per decode token and {1e6 * c.kv_read_s:.2f} µs per KV "
        f"token read (swapping a block out or in: {1e3 * c.swap_block_s:.2f} ms).",
        "",
        "| workload | fitted on | steps | measured (s) | simulated (s) | total error | median step error |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ] + [f"| {name} | {'yes' if e['fitted'] else 'no (held out)'} | {e['num_steps']} | {e['total_measured_s']:.1f} | "
         f"{e['total_predicted_s']:.1f} | {e['total_error']:+.0%} | {e['median_abs_step_error']:.0%} |"
         for name, e in sorted(steps.items(), key=lambda item: not item[1]["fitted"])] + [
        "",
        f"In real time (held out: Poisson arrivals, {len(serving['real'])} runs of the engine), the simulated median "
        f"time to first token is off by {percents(serving['error']['ttft_p50_s'])}, the median time per output "
        f"token by {percents(serving['error']['tpot_p50_s'])}, and the time to serve everything by "
        f"{percents(serving['error']['makespan_s'])}. The repeats of one workload differed by up to {spread:.0%} "
        "in total time: that is the noise any comparison stands on.",
    ]
    return "\n".join(lines)
