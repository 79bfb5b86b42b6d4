"""Fitting the step cost model to the real engine, and measuring how far the simulator's times are from it.

`measure_steps` runs workloads through the real `LLMEngine` several times. Requests join by the simulator's
clock counted in steps (`drive_requests`), so every repeat makes exactly the same steps and each step's duration
can be taken as the median over the repeats (this machine is shared: single timings are noisy). `fit` solves
non-negative least squares for the `StepCostModel` coefficients on those medians, weighting each step by
1 / its duration, so that short decode steps count as much as long prefills (relative error). Swapping
is not fitted: one block out or in costs what the engine's own copy measurement says.
`validate` compares the fitted model with the engine on workloads it was not fitted on.

# Explained in chapters/14_playground.ipynb
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pagedlab.sim.cost_model import StepCostModel, step_features
from pagedlab.sim.simulator import drive_requests
from pagedlab.sim.synthetic_workload import Lengths, SimRequest, make_workload


@dataclass(frozen=True)
class StepTimes:
    """One workload's steps: their features (`FEATURES`), and each step's duration in every repeat."""

    name: str
    features: tuple[tuple[float, ...], ...]
    durations: tuple[tuple[float, ...], ...]  # [repeat][step]

    @property
    def medians(self) -> list[float]:
        return [statistics.median(column) for column in zip(*self.durations)]

    @property
    def totals(self) -> list[float]:
        return [sum(run) for run in self.durations]


def measure_steps(model, tokenizer, name: str, requests: Sequence[SimRequest], repeats: int = 3,
                  **engine_config) -> tuple[StepTimes, object]:
    """Run `requests` through a fresh engine `repeats` times (after one untimed warm-up step); return the step
    times and the last engine (its `cost_model` is the "auto" preemption measurement)."""
    from pagedlab.config import EngineConfig
    from pagedlab.engine import LLMEngine

    config = EngineConfig(**{"max_trace_steps": None, **engine_config})
    features, durations, engine = None, [], None
    for _ in range(repeats):
        engine = LLMEngine(model, tokenizer, config)
        drive_requests(engine, requests)
        run_features = tuple(step_features(r.scheduled, r.num_swapped_blocks) for r in engine.trace)
        assert features is None or run_features == features, "a repeat made different steps"
        features = run_features
        durations.append(tuple(r.duration_s for r in engine.trace))
    return StepTimes(name, features, tuple(durations)), engine


def nnls(rows: Sequence[Sequence[float]], targets: Sequence[float], weights: Sequence[float]) -> list[float]:
    """Non-negative weighted least squares by active sets: drop the most negative coefficient and solve again."""
    import numpy as np

    a = np.asarray(rows, dtype=float) * np.asarray(weights, dtype=float)[:, None]
    b = np.asarray(targets, dtype=float) * np.asarray(weights, dtype=float)
    active = [j for j in range(a.shape[1]) if a[:, j].any()]
    while True:
        solution = np.zeros(a.shape[1])
        if active:
            solution[active] = np.linalg.lstsq(a[:, active], b, rcond=None)[0]
        negative = [j for j in active if solution[j] < 0]
        if not negative:
            return solution.tolist()
        active.remove(min(negative, key=lambda j: solution[j]))


def fit(measured: Sequence[StepTimes], swap_block_s: float = 0.0) -> StepCostModel:
    """The `StepCostModel` that best predicts the median step durations, in relative error (swap cost given)."""
    rows, targets = [], []
    for times in measured:
        for features, duration in zip(times.features, times.medians):
            if features[0]:  # a step that computed something
                rows.append(features[:4])
                targets.append(duration - swap_block_s * features[4])
    coefficients = nnls(rows, targets, [1 / max(t, 1e-6) for t in targets])
    return StepCostModel(*coefficients, swap_block_s=swap_block_s)


@dataclass(frozen=True)
class StepError:
    """How far a cost model's step times are from the engine's medians on one workload."""

    name: str
    num_steps: int
    total_measured_s: float  # sum of the median step durations
    total_predicted_s: float
    median_abs_step_error: float  # relative, per step
    p90_abs_step_error: float

    @property
    def total_error(self) -> float:
        return self.total_predicted_s / self.total_measured_s - 1


def step_error(model: StepCostModel, times: StepTimes) -> StepError:
    measured, predicted = times.medians, [model.seconds(f) for f in times.features]
    errors = sorted(abs(p / m - 1) for p, m, f in zip(predicted, measured, times.features) if f[0] and m > 0)
    p90 = errors[min(len(errors) - 1, math.floor(0.9 * len(errors)))] if errors else math.nan
    return StepError(times.name, len(measured), sum(measured), sum(predicted),
                     statistics.median(errors) if errors else math.nan, p90)


def noise(times: StepTimes) -> dict:
    """How much the repeats disagree: per step, the spread (max - min) over the median, and the totals."""
    columns = [c for c in zip(*times.durations) if statistics.median(c) > 0]
    spreads = sorted((max(c) - min(c)) / statistics.median(c) for c in columns)
    totals = times.totals
    return {
        "repeats": len(times.durations),
        "median_step_spread": statistics.median(spreads) if spreads else math.nan,
        "total_s": totals,
        "total_spread": (max(totals) - min(totals)) / statistics.median(totals),
    }


# -- the workloads -------------------------------------------------------------------------------------------


def fit_workloads(seed: int = 0, scale: float = 1.0) -> dict[str, tuple[tuple[SimRequest, ...], dict]]:
    """What the fit measures (name -> requests, engine settings): decode batches of every size and context,
    prefill steps of many sizes mixed with decodes (chunked), and long contexts. Arrival times are in steps.
    `scale` shrinks the request counts and the decode workload's output lengths."""
    n = lambda k: max(2, round(k * scale))  # noqa: E731
    return {
        "decode": (make_workload(n(48), request_rate=2.0, prompt_len=Lengths("uniform", low=16, high=160),
                                 output_len=Lengths("uniform", low=n(8), high=n(128)), seed=seed), {}),
        "prefill": (make_workload(n(24), request_rate=0.5, prompt_len=Lengths("uniform", low=64, high=1024),
                                  output_len=Lengths("uniform", low=2, high=24), seed=seed + 1),
                    dict(enable_chunked_prefill=True, max_num_batched_tokens=512)),
        "long-context": (make_workload(n(8), request_rate=1.0, prompt_len=Lengths("uniform", low=900, high=1500),
                                       output_len=Lengths("fixed", n(48)), seed=seed + 2), {}),
    }


def validation_workloads(seed: int = 100, scale: float = 1.0) -> dict[str, tuple[tuple[SimRequest, ...], dict]]:
    """Held out from the fit: chat-like requests all at once, and a tight pool that preempts by swapping or by
    recomputing (prompts as the chat benchmark's, outputs exponential with mean 128 clipped to [16, 256]).
    The tight pool preempts at scale 1; a smaller `scale` may leave it room enough not to."""
    n = lambda k: max(2, round(k * scale))  # noqa: E731
    chat, out = Lengths("chat"), Lengths("exponential", n(128), low=n(16), high=n(256))
    return {
        "chat": (make_workload(n(16), prompt_len=chat, output_len=out, seed=seed), {}),
        "pressure-swap": (make_workload(n(12), prompt_len=chat, output_len=out, seed=seed + 1),
                          dict(num_kv_blocks=80, preemption_mode="swap")),
        "pressure-recompute": (make_workload(n(12), prompt_len=chat, output_len=out, seed=seed + 1),
                               dict(num_kv_blocks=80, preemption_mode="recompute")),
    }


def serving_workload(seed: int = 200, scale: float = 1.0) -> tuple[SimRequest, ...]:
    """Held out from the fit, in real time: Poisson arrivals at 0.25 requests/s (seconds, not steps)."""
    n = lambda k: max(2, round(k * scale))  # noqa: E731
    chat, out = Lengths("chat"), Lengths("exponential", n(128), low=n(16), high=n(256))
    return make_workload(n(16), request_rate=0.25, prompt_len=chat, output_len=out, seed=seed)


def elapsed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def serve(model, tokenizer, requests: Sequence[SimRequest], **engine_config) -> dict:
    """Run `requests` through a real engine in real time (each added once the wall clock passes its arrival,
    as `pagedlab bench --workload serving` does); return the arrivals, every step's start and end time, and
    the trace, in seconds from the start."""
    from pagedlab.config import EngineConfig
    from pagedlab.engine import LLMEngine
    from pagedlab.sampling_params import SamplingParams

    engine = LLMEngine(model, tokenizer, EngineConfig(**{"max_trace_steps": None, **engine_config}))
    vocab_size = model.get_input_embeddings().num_embeddings
    pending = sorted(enumerate(requests), key=lambda item: item[1].arrival_s)
    arrivals, starts, ends, next_index = {}, [], [], 0
    begin = time.perf_counter()
    while next_index < len(pending) or engine.has_unfinished_requests():
        now = time.perf_counter() - begin
        if not engine.has_unfinished_requests() and pending[next_index][1].arrival_s > now:
            time.sleep(pending[next_index][1].arrival_s - now)
            now = time.perf_counter() - begin
        while next_index < len(pending) and pending[next_index][1].arrival_s <= now:
            spec = pending[next_index][1]
            params = SamplingParams(temperature=0.0, max_tokens=spec.output_len, ignore_eos=True)
            prompt = [t % vocab_size for t in spec.prompt_token_ids]
            engine.add_request(str(next_index), {"prompt_token_ids": prompt}, params)
            arrivals[str(next_index)] = spec.arrival_s
            next_index += 1
        starts.append(time.perf_counter() - begin)
        engine.step()
        ends.append(time.perf_counter() - begin)
    return {"arrival_s": arrivals, "step_start_s": starts, "step_end_s": ends, "trace": engine.trace}
