"""The engine without a model: `simulate(requests, **engine_config)` runs the engine's own scheduler and
block manager over a synthetic workload and returns the `Trace` the engine would record.

A step is `LLMEngine.step` minus the worker: `Scheduler.schedule()`, then made-up tokens for every sequence
that samples (and made-up beam steps), then `Scheduler.update_from_output` and a `StepRecord` built as the
engine builds it. With EOS ignored the schedule does not depend on token values, so the trace equals the
engine's (tests/test_sim_consistency.py checks it step by step). Time is simulated: each step lasts what the
cost model says, and a request joins before the first step that starts at or after its arrival.

# Explained in chapters/14_playground.ipynb
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedlab.config import EngineConfig
from pagedlab.core.block_table import cdiv
from pagedlab.core.kv_cache_manager import KVCacheManager
from pagedlab.core.preemption import PreemptionCostModel, PreemptionMode
from pagedlab.core.request import Request
from pagedlab.core.scheduler import Scheduler
from pagedlab.core.swap_space import SwapSpace
from pagedlab.core.trace import StepRecord, Trace
from pagedlab.sampling_params import SamplingParams
from pagedlab.sim.cost_model import Calibration, StepCostModel, load_calibration
from pagedlab.sim.fake_model import MadeUpBeams, MadeUpTokens
from pagedlab.sim.workload import SimRequest

BEAM_SAMPLING = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)  # as the engine's beams


@dataclass
class SimTrace(Trace):
    """A `Trace` with the simulated clock: when each step started, when each request arrived, which request
    each sequence belongs to, and the scheduler's counters at the end."""

    config: EngineConfig | None = None
    step_start_s: list[float] = field(default_factory=list)
    arrival_s: dict[str, float] = field(default_factory=dict)  # request (group) id -> arrival
    group_of: dict[str, str] = field(default_factory=dict)  # sequence id -> its request (group) id
    stats: dict = field(default_factory=dict)

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
    capacity = num_blocks * config.block_size
    if config.max_model_len is not None and config.max_model_len > capacity:
        raise ValueError(
            f"max_model_len={config.max_model_len} can never fit: the KV cache holds {num_blocks} blocks "
            f"x {config.block_size} = {capacity} tokens; raise the KV budget or lower max_model_len"
        )
    return dataclasses.replace(config, num_kv_blocks=num_blocks, max_model_len=config.max_model_len or capacity)


class SimEngine:
    """`LLMEngine`'s request and step interface over the real core, with no worker and no output processor."""

    def __init__(self, config: EngineConfig, cost_model: StepCostModel,
                 preemption_cost_model: PreemptionCostModel | None = None, kv_bytes_per_token: int = 0,
                 beam_seed: int = 0) -> None:
        self.config = config
        self.cost_model = cost_model
        num_blocks = config.num_kv_blocks
        self.kv_cache_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.num_cpu_blocks, self.swap_space = 0, None
        if PreemptionMode(config.preemption_mode) != PreemptionMode.RECOMPUTE:
            self.num_cpu_blocks = config.num_cpu_blocks
            if self.num_cpu_blocks is None:  # as the worker sizes it: swap_space GiB, at most the device pool
                bytes_per_block = kv_bytes_per_token * config.block_size
                by_budget = int(config.swap_space * 2**30) // bytes_per_block if bytes_per_block else num_blocks
                self.num_cpu_blocks = min(by_budget, num_blocks)
            self.swap_space = SwapSpace(self.kv_cache_manager, self.num_cpu_blocks)
        self.scheduler = Scheduler(config, self.kv_cache_manager, self.swap_space, preemption_cost_model)
        self.tokens = MadeUpTokens()
        self.beams = MadeUpBeams(self.tokens, beam_seed)
        self.trace = SimTrace(num_blocks, config.block_size, self.num_cpu_blocks, None, config=config)
        self.num_arrivals = 0

    def add_request(self, request_id: str | None, spec: SimRequest) -> str:
        """Queue one request as `LLMEngine.add_request` (or `add_beam_request`) would, after the same checks.
        Greedy with EOS ignored; n > 1 samples draw at temperature 1 (their tokens are made up anyway)."""
        request_id = str(self.num_arrivals if request_id is None else request_id)
        if request_id in self.scheduler.groups:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        check_request(spec, self.config)
        token_ids = list(spec.prompt_token_ids)
        room = self.config.max_model_len - len(token_ids)
        max_tokens = min(spec.output_len, room)
        if spec.beam_width:
            sampling = BEAM_SAMPLING
        else:
            sampling = SamplingParams(n=spec.n, temperature=1.0 if spec.n > 1 else 0.0, seed=self.num_arrivals,
                                      max_tokens=spec.output_len, ignore_eos=True)
        request = Request(self.scheduler.unique_id(request_id), token_ids, sampling, self.num_arrivals,
                          room if spec.beam_width else max_tokens, group_id=request_id,
                          beam_width=spec.beam_width)
        self.scheduler.add_request(request)
        if spec.beam_width:
            self.beams.add(request_id, request.request_id, spec.beam_width, max_tokens)
        self.trace.group_of[request.request_id] = request_id
        self.num_arrivals += 1
        return request_id

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> StepRecord:
        """One step: schedule, make up the tokens and beam steps, update, and record it (with its modelled
        duration) in the trace."""
        scheduled = self.scheduler.schedule()
        sampled = {t.request_id: self.tokens() for s in scheduled.scheduled for t in s.sampling if not t.is_beam}
        decisions = self.beams.step(scheduled)
        update = self.scheduler.update_from_output(scheduled, sampled, decisions)
        self.beams.commit(update)
        for parent, child in scheduled.forked + update.forked:
            self.trace.group_of[child] = self.trace.group_of[parent]
        moves = scheduled.swapped_out + scheduled.swapped_in
        duration = self.cost_model.step_seconds(scheduled.scheduled, sum(len(pairs) for _, pairs in moves))
        record = StepRecord.build(scheduled, update, self.scheduler.snapshot(), duration_s=duration)
        self.trace.append(record)
        return record

    def stats(self) -> dict:
        kv, swap, counters = self.kv_cache_manager, self.swap_space, self.scheduler.stats
        return {
            **dataclasses.asdict(counters),
            "prefix_cache_queries": kv.num_query_tokens,
            "prefix_cache_hits": kv.num_hit_tokens,
            "num_evicted_blocks": kv.pool.num_evicted_blocks,
            "num_swapped_out_blocks": swap.num_swapped_out_blocks if swap else 0,
            "num_swapped_in_blocks": swap.num_swapped_in_blocks if swap else 0,
        }


def simulate(
    requests: Sequence[SimRequest], *, cost_model: StepCostModel | None = None,
    calibration: Calibration | None = None, preemption_cost_model: PreemptionCostModel | None = None,
    beam_seed: int = 0, max_steps: int | None = None, **engine_config,
) -> SimTrace:
    """Run `requests` through the engine's scheduler and block manager with made-up tokens; return the trace.

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
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    _check_all(engine, [requests[i] for i in order])
    trace, clock, next_arrival = engine.trace, 0.0, 0
    # Liveness: requests finish one after another, each within a few steps per token (the state machine's bound).
    work = sum((r.num_prompt_tokens + r.output_len + 2) * max(r.n, r.beam_width) for r in requests)
    limit = max_steps or 10 + 4 * work
    while next_arrival < len(order) or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests():
            clock = max(clock, requests[order[next_arrival]].arrival_s)  # idle until the next arrival
        while next_arrival < len(order) and requests[order[next_arrival]].arrival_s <= clock:
            spec = requests[order[next_arrival]]
            request_id = engine.add_request(str(next_arrival), spec)
            trace.arrival_s[request_id] = spec.arrival_s
            next_arrival += 1
        trace.step_start_s.append(clock)
        clock += engine.step().duration_s
        if len(trace.steps) >= limit:
            raise RuntimeError(f"the simulation did not finish within {limit} steps")
    trace.stats = engine.stats()
    return trace


def check_request(spec: SimRequest, config: EngineConfig) -> None:
    """The engine's checks of a token-id prompt and its samples or beams (`pagedlab.inputs.InputProcessor`, which
    the simulator does not import: it would bring torch), with its messages; tests/test_sim.py keeps them equal."""
    num_tokens = spec.num_prompt_tokens
    if num_tokens + 1 > config.max_model_len:
        raise ValueError(f"the prompt has {num_tokens} tokens; with one generated token that exceeds "
                         f"max_model_len={config.max_model_len}")
    num_blocks = cdiv(num_tokens + 1, config.block_size)
    if num_blocks > config.num_kv_blocks:
        raise ValueError(f"the prompt needs {num_blocks} KV blocks but the whole cache has {config.num_kv_blocks}")
    if num_tokens > config.max_num_batched_tokens and not config.enable_chunked_prefill:
        raise ValueError(f"the prompt has {num_tokens} tokens, more than max_num_batched_tokens="
                         f"{config.max_num_batched_tokens}; raise it or enable chunked prefill")
    if spec.beam_width > config.max_num_seqs:
        raise ValueError(f"beam_width={spec.beam_width} is more than max_num_seqs={config.max_num_seqs}: its beams "
                         "could never run at once; lower beam_width or raise max_num_seqs")
    if spec.n > config.max_num_seqs:
        raise ValueError(f"SamplingParams n={spec.n} is more than max_num_seqs={config.max_num_seqs}: its samples "
                         "could never run at once; lower n or raise max_num_seqs")


def _check_all(engine: SimEngine, requests: Sequence[SimRequest]) -> None:
    """Every request is checked before the first step (a ValueError naming it)."""
    for i, spec in enumerate(requests):
        try:
            check_request(spec, engine.config)
        except ValueError as error:
            raise ValueError(f"request {i} (arriving at {spec.arrival_s:g} s): {error}") from None
    if not math.isfinite(sum(r.arrival_s for r in requests)):
        raise ValueError("arrival times must be finite")
