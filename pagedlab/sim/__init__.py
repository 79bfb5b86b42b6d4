"""The playground's simulator: the engine's own scheduler and block manager over synthetic workloads, with
made-up tokens and no model, and step times from a cost model fitted to the real engine.

    from pagedlab.sim import make_workload, simulate, Lengths
    requests = make_workload(300, request_rate=4.0, output_len=Lengths("exponential", 128, low=8, high=512))
    trace = simulate(requests, num_kv_blocks=512, block_size=16, preemption_mode="swap")

Modules: `synthetic_workload` (seeded requests), `simulator` (`simulate`, `SimEngine`, `SimTrace`,
`drive_requests`), `fake_model` (made-up tokens and beam steps), `cost_model` (seconds per step, the shipped
calibration), `cost_fit` (fitting it to the real engine; `pagedlab.bench.calibration_run` runs the whole
calibration), `contiguous_schedule` (the same workload over contiguous reservations), `metrics` (what a trace says).

# Explained in chapters/14_playground.ipynb
"""

from pagedlab.sim.cost_model import Calibration, StepCostModel, load_calibration
from pagedlab.sim.simulator import SimEngine, SimTrace, drive_requests, simulate
from pagedlab.sim.synthetic_workload import Lengths, SimRequest, arrival_times, make_workload

__all__ = [
    "Calibration",
    "Lengths",
    "SimEngine",
    "SimRequest",
    "SimTrace",
    "StepCostModel",
    "arrival_times",
    "drive_requests",
    "load_calibration",
    "make_workload",
    "simulate",
]
