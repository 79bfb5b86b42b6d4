"""How long a step takes, without running it: a linear model of the step's work, fitted to the real engine.

    seconds = overhead_s                                  (per step: Python, weights streamed once)
            + prefill_token_s * prefill tokens            (sequences computing more than one token)
            + decode_token_s  * decode tokens             (sequences computing exactly one)
            + kv_read_s       * KV tokens read            (each sequence's attention reads its whole context)
            + swap_block_s    * blocks swapped out or in  (the batched copies before the forward pass)

`pagedlab bench --workload calibrate` times the real engine step by step on this machine and fits the
coefficients (`pagedlab.sim.cost_fit`); the fit ships as `calibration.json` beside this module, with the
machine, the model and the error it makes against the engine. `load_calibration()` reads it. Pure Python.

# Explained in chapters/14_playground.ipynb
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

from pagedlab.core.preemption import PreemptionCostModel
from pagedlab.core.sched_output import ScheduledRequest

FEATURES = ("overhead", "prefill_tokens", "decode_tokens", "kv_read_tokens", "swapped_blocks")


def step_features(scheduled: tuple[ScheduledRequest, ...], num_swapped_blocks: int = 0) -> tuple[float, ...]:
    """The step's work, in the order of `FEATURES`. KV tokens read: each scheduled sequence's attention reads
    its whole context, computed tokens and new ones (a step that computes nothing costs nothing but its swaps)."""
    prefill = decode = kv_read = 0
    for s in scheduled:
        if s.num_new_tokens == 1:
            decode += 1
        else:
            prefill += s.num_new_tokens
        kv_read += s.num_computed_tokens + s.num_new_tokens
    return (1.0 if scheduled else 0.0, prefill, decode, kv_read, num_swapped_blocks)


@dataclass(frozen=True)
class StepCostModel:
    """Seconds per step from its work (see the module docstring); every coefficient is >= 0."""

    overhead_s: float
    prefill_token_s: float
    decode_token_s: float
    kv_read_s: float
    swap_block_s: float = 0.0

    def __post_init__(self) -> None:
        bad = {k: v for k, v in asdict(self).items() if not v >= 0}
        if bad:
            raise ValueError(f"StepCostModel coefficients must be >= 0 seconds, got {bad}")

    @property
    def coefficients(self) -> tuple[float, ...]:
        return (self.overhead_s, self.prefill_token_s, self.decode_token_s, self.kv_read_s, self.swap_block_s)

    def seconds(self, features: tuple[float, ...]) -> float:
        return sum(c * x for c, x in zip(self.coefficients, features))

    def step_seconds(self, scheduled: tuple[ScheduledRequest, ...], num_swapped_blocks: int = 0) -> float:
        return self.seconds(step_features(scheduled, num_swapped_blocks))

    @classmethod
    def constant(cls, seconds: float = 1.0) -> StepCostModel:
        """Every step that computes something takes `seconds` (for tests: then time counts steps)."""
        return cls(seconds, 0.0, 0.0, 0.0)


@dataclass(frozen=True)
class Calibration:
    """A fitted `StepCostModel` and what it was fitted on: the machine and model, the preemption costs the
    engine measured (for "auto"), KV bytes per token, how noisy the timings were, and its measured error."""

    step_cost: StepCostModel
    preemption: PreemptionCostModel | None = None
    kv_bytes_per_token: int = 0
    machine: dict = field(default_factory=dict)
    noise: dict = field(default_factory=dict)
    error: dict = field(default_factory=dict)

    def preemption_cost_model(self, block_size: int) -> PreemptionCostModel | None:
        """The "auto" cost model at another block size (bytes per block scale with it; speeds do not)."""
        if self.preemption is None:
            return None
        p = self.preemption
        return PreemptionCostModel(self.kv_bytes_per_token * block_size, block_size, p.copy_bytes_per_s,
                                   p.prefill_tokens_per_s)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Calibration:
        preemption = data.get("preemption")
        return cls(
            StepCostModel(**data["step_cost"]), PreemptionCostModel(**preemption) if preemption else None,
            data.get("kv_bytes_per_token", 0), data.get("machine", {}), data.get("noise", {}), data.get("error", {}),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n")


def load_calibration(path: str | Path | None = None) -> Calibration:
    """The calibration at `path`, or the one shipped with pagedlab (`pagedlab/sim/calibration.json`)."""
    if path is None:
        text = resources.files("pagedlab.sim").joinpath("calibration.json").read_text()
    else:
        text = Path(path).read_text()
    return Calibration.from_dict(json.loads(text))
