"""An engine's schedule without its model: the simulator's engine (`SimEngine`), driven by step.

With `ignore_eos=True`, a fixed `max_tokens` and no stop strings, what the scheduler decides does not depend on
which tokens the model picks (prefix-cache hits look at token values, but only at the prompts'), so `replay`
must reproduce an engine's trace step for step: who ran and how many tokens, which blocks were allocated,
copied, swapped and freed, who was preempted, forked or finished. `drive` steps a real engine over the same
`Arrival`s and `Abort`s (`pagedlab.driver`); `first_difference` compares two traces on everything but token
values and times (`pagedlab.core.trace`). The chapters assert it wherever they show a schedule. Beam search is
left out: its forks follow the model's scores.

# Explained in chapters/05_continuous_batching.ipynb
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pagedlab.config import EngineConfig
from pagedlab.core.preemption import PreemptionCostModel
from pagedlab.core.trace import Trace, first_difference, schedule_of
from pagedlab.driver import Abort, Arrival, Event, drive
from pagedlab.sampling_params import SamplingParams
from pagedlab.sim.cost_model import StepCostModel
from pagedlab.sim.simulator import SimEngine

__all__ = ["Abort", "Arrival", "drive", "first_difference", "replay", "replay_engine", "schedule_of"]


def replay(
    config: EngineConfig, events: Sequence[Event], num_blocks: int, num_cpu_blocks: int = 0,
    cost_model: PreemptionCostModel | None = None, num_trace_steps: int | None = None,
) -> Trace:
    """The trace an engine with `config` (its `max_model_len` resolved), `num_blocks` device blocks and
    `num_cpu_blocks` CPU blocks would record over `events`: the `SimEngine` on a constant clock, checking its
    invariants after every step. Every sampled token is a new made-up id, so no two sequences ever generate the
    same block."""
    if config.max_model_len is None:
        raise ValueError("replay needs the engine's resolved max_model_len (engine.config)")
    for event in events:
        if isinstance(event, Arrival) and not isinstance(event.params, SamplingParams):
            raise ValueError(f"replay takes SamplingParams only (beam search follows the model), got {event!r}")
    config = dataclasses.replace(
        config, num_kv_blocks=num_blocks, num_cpu_blocks=num_cpu_blocks, max_trace_steps=num_trace_steps
    )
    engine = SimEngine(config, StepCostModel.constant(1.0), cost_model)
    drive(engine, events, on_step=lambda record, start_s: engine.check_invariants())
    return engine.trace


def replay_engine(engine, events: Sequence[Event]) -> Trace:
    """`replay` with the engine's own settings, pool sizes and measured cost model."""
    info = engine.worker.info
    return replay(engine.config, events, info.num_blocks, info.num_cpu_blocks, info.cost_model,
                  engine.trace.max_steps)
