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

from pagedlab.core.preemption import PreemptionCostModel
from pagedlab.sim import calibrate as cal
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
                                 max_model_len=_max_len(requests), preemption_mode="recompute")  # fmt: skip
            sim = metrics.latencies(simulated)
            sim_values = {"ttft_p50_s": metrics.median(sim.ttft_s), "tpot_p50_s": metrics.median(sim.tpot_s),
                          "makespan_s": metrics.makespan(simulated)}  # fmt: skip
        times: dict[str, list[float]] = {rid: [] for rid in real["arrival_s"]}
        for record, end in zip(real["trace"], real["step_end_s"]):
            for sequence_id, _ in record.appended:
                times[sequence_id].append(end)
        ttft = [t[0] - real["arrival_s"][rid] for rid, t in times.items()]
        tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in times.values() if len(t) > 1]
        runs.append({"ttft_p50_s": metrics.median(ttft), "tpot_p50_s": metrics.median(tpot),
                     "makespan_s": real["step_end_s"][-1] - min(real["arrival_s"].values())})  # fmt: skip
    return {"simulated": sim_values, "real": runs,
            "error": {k: [sim_values[k] / run[k] - 1 for run in runs] for k in sim_values}}  # fmt: skip


def run_calibration(model, tokenizer, repeats: int = 3, scale: float = 1.0, seed: int = 0,
                    progress: Callable[[str], None] | None = None) -> tuple[Calibration, dict]:  # fmt: skip
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
                                                     **{"max_model_len": _max_len(requests), **config})  # fmt: skip
            engine = last if last.cost_model is not None else engine
    p, bytes_per_block = engine.cost_model, engine.worker.bytes_per_block
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
    )  # fmt: skip
    return calibration, measured
