"""The engine without a model: `simulate(requests, **engine_config)` runs the engine's own core (scheduler, block
manager, trace) over a synthetic workload and returns the `Trace` the engine would record.

`SimEngine` is `LLMEngine` with the model replaced: the same `EngineCore`, stepping a `MadeUpExecutor` (made-up
tokens) and made-up beam steps, behind the same request interface and the same input checks. With EOS ignored
the schedule does not depend on token values, so the trace equals the engine's (tests/sim/test_sim_consistency.py
checks it step by step). Time is simulated: each step lasts what the cost model says, and `pagedlab.driver`
adds a request before the first step that starts at or after its arrival.

# Explained in chapters/14_playground.ipynb
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pagedlab.config import EngineConfig
from pagedlab.core.engine_core import EngineCore
from pagedlab.core.executor import WorkerInfo, check_max_model_len
from pagedlab.core.preemption import PreemptionCostModel, PreemptionMode
from pagedlab.core.trace import StepRecord, Trace
from pagedlab.driver import Arrival, drive
from pagedlab.inputs import InputProcessor, PromptType
from pagedlab.outputs import EngineStats, RequestOutput
from pagedlab.sampling_params import BeamSearchParams, SamplingParams
from pagedlab.sim.cost_model import Calibration, StepCostModel, load_calibration
from pagedlab.sim.fake_model import FIRST_MADE_UP_TOKEN, MadeUpBeams, MadeUpExecutor, MadeUpTokens
from pagedlab.sim.synthetic_workload import SimRequest

STEPS = StepCostModel.constant(1.0)  # a clock counted in steps: a step that computes something lasts one "second"


@dataclass
class SimTrace(Trace):
    """A `Trace` with the simulated clock: when each step started, when each request arrived, which request
    each sequence belongs to, and the engine's statistics at the end."""

    config: EngineConfig | None = None
    step_start_s: list[float] = field(default_factory=list)
    arrival_s: dict[str, float] = field(default_factory=dict)  # request (group) id -> arrival
    group_of: dict[str, str] = field(default_factory=dict)  # sequence id -> its request (group) id
    stats: EngineStats | None = None

    @property
    def step_end_s(self) -> list[float]:
        return [start + r.duration_s for start, r in zip(self.step_start_s, self.steps)]


def resolve_config(calibration: Calibration | None, **engine_config) -> EngineConfig:
    """The engine's settings for a simulation: the KV capacity from `num_kv_blocks` (or `kv_cache_memory`
    bytes at the calibrated model's KV bytes per token); max_model_len defaults to the whole cache, as the
    engine caps it; every step is kept in the trace."""
    config = EngineConfig(**{"max_trace_steps": None, **engine_config})
    num_blocks = config.num_kv_blocks
    if num_blocks is None and config.kv_cache_memory is not None and calibration and calibration.kv_bytes_per_token:
        num_blocks = config.kv_cache_memory // (calibration.kv_bytes_per_token * config.block_size)
    if num_blocks is None or num_blocks < 1:
        raise ValueError("simulate needs the KV capacity: num_kv_blocks=N (or kv_cache_memory=bytes), at least 1 block")
    check_max_model_len(config.max_model_len, num_blocks, config.block_size)
    max_model_len = config.max_model_len or num_blocks * config.block_size
    return dataclasses.replace(config, num_kv_blocks=num_blocks, max_model_len=max_model_len)


class SimEngine:
    """`LLMEngine` without a model: the same core and input checks, made-up tokens, and a cost model for each
    step's duration. Requests are token ids; `step()` returns no outputs (there is no text), the trace says all."""

    def __init__(self, config: EngineConfig, cost_model: StepCostModel,
                 preemption_cost_model: PreemptionCostModel | None = None, kv_bytes_per_token: int = 0,
                 beam_seed: int = 0) -> None:
        self.cost_model = cost_model
        num_blocks, num_cpu_blocks = config.num_kv_blocks, 0
        bytes_per_block = kv_bytes_per_token * config.block_size
        if PreemptionMode(config.preemption_mode) != PreemptionMode.RECOMPUTE:
            num_cpu_blocks = config.num_cpu_blocks
            if num_cpu_blocks is None:  # as the worker sizes it: swap_space GiB, at most the device pool
                by_budget = int(config.swap_space * 2**30) // bytes_per_block if bytes_per_block else num_blocks
                num_cpu_blocks = min(by_budget, num_blocks)
        info = WorkerInfo(num_blocks, num_cpu_blocks, bytes_per_block, config.max_model_len,
                          cost_model=preemption_cost_model)
        self.tokens = MadeUpTokens()
        self.beams = MadeUpBeams(self.tokens, beam_seed)
        self.trace = SimTrace(num_blocks, config.block_size, num_cpu_blocks, config.max_trace_steps, config=config)
        self.engine_core = EngineCore(config, MadeUpExecutor(info, self.tokens), self.beams, trace=self.trace)
        self.config = self.engine_core.config
        self.inputs = InputProcessor(None, FIRST_MADE_UP_TOKEN, self.config, num_blocks)

    scheduler = property(lambda self: self.engine_core.scheduler)
    kv_cache_manager = property(lambda self: self.engine_core.kv_cache_manager)
    swap_space = property(lambda self: self.engine_core.swap_space)
    num_steps = property(lambda self: self.engine_core.num_steps)

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams) -> str:
        """Queue a request as `LLMEngine.add_request` does, after the same checks (token-id prompts only)."""
        return self._add(request_id, prompt, params)

    def add_beam_request(self, request_id: str | None, prompt: PromptType, params: BeamSearchParams) -> str:
        """Queue a beam search: its beam steps are made up (`pagedlab.sim.fake_model.MadeUpBeams`)."""
        return self._add(request_id, prompt, params)

    def _add(self, request_id, prompt, params) -> str:
        if request_id is None:
            request_id = self.engine_core.new_request_id()
        processed = self.inputs.process(prompt, params)
        request = self.engine_core.add_request(request_id, processed.token_ids, params, cache_salt=processed.cache_salt)
        if isinstance(params, BeamSearchParams):
            self.beams.add(request_id, request.request_id, params.beam_width,
                           min(params.max_tokens, request.max_tokens))
        self.trace.group_of[request.request_id] = request_id
        return request_id

    def abort_request(self, request_id: str) -> None:
        self.beams.groups.pop(request_id, None)
        self.engine_core.abort_requests([request_id])

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One step of the core, then the beams' bookkeeping; recorded with its modelled duration."""
        output = self.engine_core.step()
        self.beams.commit(output.update)
        for parent, child in output.scheduler_output.forked + output.update.forked:
            self.trace.group_of[child] = self.trace.group_of[parent]
        scheduler_output = output.scheduler_output
        duration = self.cost_model.step_seconds(scheduler_output.scheduled, scheduler_output.num_swapped_blocks)
        self.engine_core.finish_step(output, duration_s=duration)
        return []

    def stats(self) -> EngineStats:
        return self.engine_core.stats()

    def check_invariants(self) -> None:
        self.engine_core.check_invariants()


def arrival(index: int, spec: SimRequest, vocab_size: int = FIRST_MADE_UP_TOKEN) -> Arrival:
    """Request `index` of a workload as the driver takes it: greedy with EOS ignored, n > 1 samples at
    temperature 1 seeded by the index (their tokens are made up anyway), or a beam search."""
    if spec.beam_width:
        params = BeamSearchParams(spec.beam_width, spec.output_len, ignore_eos=True)
    else:
        params = SamplingParams(n=spec.n, temperature=1.0 if spec.n > 1 else 0.0, seed=index,
                                max_tokens=spec.output_len, ignore_eos=True)
    prompt = tuple(t % vocab_size for t in spec.prompt_token_ids)
    return Arrival(0, str(index), prompt, params, arrival_s=spec.arrival_s)


def simulate(
    requests: Sequence[SimRequest], *, cost_model: StepCostModel | None = None,
    calibration: Calibration | None = None, preemption_cost_model: PreemptionCostModel | None = None,
    beam_seed: int = 0, max_steps: int | None = None, **engine_config,
) -> SimTrace:
    """Run `requests` through the engine's core with made-up tokens; return the trace.

    engine_config: `EngineConfig` fields (num_kv_blocks is required, or kv_cache_memory). Step durations come
    from `cost_model`, by default the shipped calibration's (`load_calibration()`); "auto" preemption asks
    `preemption_cost_model`, by default the one the calibration measured. Requests get ids "0", "1", ... in
    arrival order (ties keep the given order). A request that could never run raises a ValueError first."""
    auto = PreemptionMode(engine_config.get("preemption_mode", "auto")) == PreemptionMode.AUTO
    if calibration is None and (cost_model is None or (auto and preemption_cost_model is None)):
        calibration = load_calibration()
    config = resolve_config(calibration, **engine_config)
    cost_model = cost_model or calibration.step_cost
    if preemption_cost_model is None and PreemptionMode(config.preemption_mode) == PreemptionMode.AUTO:
        preemption_cost_model = calibration.preemption_cost_model(config.block_size)
    engine = SimEngine(config, cost_model, preemption_cost_model,
                       calibration.kv_bytes_per_token if calibration else 0, beam_seed)
    trace = engine.trace
    # Liveness: requests finish one after another, each within a few steps per token (the state machine's bound).
    work = sum((r.num_prompt_tokens + r.output_len + 2) * max(r.n, r.beam_width) for r in requests)
    limit = max_steps or 10 + 4 * work

    def on_step(record: StepRecord, start_s: float) -> None:
        trace.step_start_s.append(start_s)
        if len(trace.steps) >= limit and engine.has_unfinished_requests():
            raise RuntimeError(f"the simulation did not finish within {limit} steps")

    drive_requests(engine, requests, cost_model, on_step)
    trace.stats = engine.stats()
    return trace


def drive_requests(engine, requests: Sequence[SimRequest], cost_model: StepCostModel = STEPS,
                   on_step: Callable[[StepRecord, float], None] | None = None) -> None:
    """Drive an engine (`SimEngine`, or the real `LLMEngine`) as `simulate` drives its own: request i (in arrival
    order) joins as "i" before the first step that starts at or after its arrival on a clock that advances by
    `cost_model`'s durations of the steps recorded so far; an idle engine jumps to the next arrival. Prompt
    token ids are taken modulo the engine's vocabulary (lengths are what matter here). Every request is
    checked before the first step."""
    vocab_size = engine.inputs.vocab_size
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    arrivals = [arrival(index, requests[i], vocab_size) for index, i in enumerate(order)]
    _check_all(engine, arrivals)
    if isinstance(engine.trace, SimTrace):
        engine.trace.arrival_s.update((a.request_id, a.arrival_s) for a in arrivals)

    def clock(record: StepRecord) -> float:
        return cost_model.step_seconds(record.scheduled, record.num_swapped_blocks)

    drive(engine, arrivals, clock, on_step)


def _check_all(engine: SimEngine, arrivals: Sequence[Arrival]) -> None:
    """Every request is checked before the first step (a ValueError naming it), with the engine's own checks."""
    for arrival in arrivals:
        if not arrival.arrival_s < float("inf"):
            raise ValueError("arrival times must be finite")
        try:
            engine.inputs.process(arrival.prompt, arrival.params)
        except ValueError as error:
            raise ValueError(f"request {arrival.request_id} (arriving at {arrival.arrival_s:g} s): {error}") from None
