"""The calibrate workload: the simulator's step cost model fitted to this engine on this machine.

Runs `pagedlab.bench.calibration_run.run_calibration` (fit workloads, held-out workloads step by step, real-time
Poisson arrivals) and writes three tables, `calibration.json` (copy it to `pagedlab/sim/calibration.json` to ship
it) and the raw step times (`calibration_steps.json`).

# Explained in chapters/14_playground.ipynb
"""

from __future__ import annotations

import dataclasses

from pagedlab.bench import report
from pagedlab.bench.report import Table

COLUMNS = ("coefficient", "value")
ERROR_COLUMNS = ("workload", "fitted", "steps", "measured_s", "predicted_s", "total_error", "median_step_error",
                 "p90_step_error", "repeats_spread")
SERVING_COLUMNS = ("metric", "simulated", "real", "error")


def run(bench) -> None:
    from pagedlab.bench.calibration_run import run_calibration

    o = bench.options
    repeats = max(3, o.repeats)
    bench.describe(None, f"the simulator's step cost model fitted to the engine's step times (median of {repeats} "
                         "repeats), and its error on held-out workloads")
    bar = bench.bar("calibrate")
    calibration, measured = run_calibration(bench.model, bench.tokenizer, repeats, o.scale, o.seed,
                                            progress=bar.set_description if bar is not None else None)
    table = Table("calibrate: seconds per step = sum of coefficient x feature", COLUMNS)
    for name, value in dataclasses.asdict(calibration.step_cost).items():
        table.add(coefficient=name, value=value)
    table.notes.append("written to calibration.json; copy it to pagedlab/sim/calibration.json to ship it")
    bench.add_table("calibrate", table)
    errors = Table("calibrate: predicted against measured step times (sum of per-step medians)", ERROR_COLUMNS)
    for name, e in calibration.error["steps"].items():
        errors.add(workload=name, fitted=e["fitted"], steps=e["num_steps"], measured_s=e["total_measured_s"],
                   predicted_s=e["total_predicted_s"], total_error=e["total_error"],
                   median_step_error=e["median_abs_step_error"], p90_step_error=e["p90_abs_step_error"],
                   repeats_spread=calibration.noise[name]["total_spread"])
    errors.notes.append("errors are relative; repeats_spread: (slowest - fastest) / median of the repeats' totals")
    bench.add_table("calibrate_error", errors)
    serving = calibration.error["serving"]
    table = Table("calibrate: real-time Poisson arrivals, engine against simulator", SERVING_COLUMNS)
    for metric, value in serving["simulated"].items():
        table.add(metric=metric, simulated=value, real=", ".join(f"{run[metric]:.3g}" for run in serving["real"]),
                  error=", ".join(f"{e:+.1%}" for e in serving["error"][metric]))
    bench.add_table("calibrate_serving", table)
    bench.add_plot("calibration.json", calibration.save)  # not a plot: add_plot writes any file
    steps = {name: dataclasses.asdict(times) for name, times in measured.items()}
    bench.add_plot("calibration_steps.json", lambda path: report.write_json(path, steps))
