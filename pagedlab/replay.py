"""An engine's schedule without its model: a `Scheduler` over a `KVCacheManager`, fed made-up tokens.

With `ignore_eos=True`, a fixed `max_tokens` and no stop strings, what the scheduler decides does not depend on
which tokens the model picks (prefix-cache hits look at token values, but only at the prompts'), so `replay`
must reproduce an engine's trace step for step: who ran and how many tokens, which blocks were allocated,
copied, swapped and freed, who was preempted, forked or finished. `drive` steps a real engine over the same
`Arrival`s and `Abort`s; `first_difference` compares two traces on everything but token values and times. The
chapters assert it wherever they show a schedule. Beam search is left out: its forks follow the model's scores.

# Explained in chapters/05_continuous_batching.ipynb
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from pagedlab.config import EngineConfig
from pagedlab.core.kv_cache_manager import KVCacheManager
from pagedlab.core.preemption import PreemptionCostModel, PreemptionMode
from pagedlab.core.request import Request, RequestStatus
from pagedlab.core.scheduler import Scheduler
from pagedlab.core.swap_space import SwapSpace
from pagedlab.core.trace import StepRecord, Trace
from pagedlab.sampling_params import SamplingParams


@dataclass(frozen=True)
class Arrival:
    """A request added just before engine step `step` (steps count from 1, as the trace's do)."""

    step: int
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    cache_salt: str | None = None

    @property
    def prompt(self) -> dict:
        """The prompt as `LLMEngine.add_request` takes it."""
        prompt = {"prompt_token_ids": list(self.prompt_token_ids)}
        return prompt if self.cache_salt is None else {**prompt, "cache_salt": self.cache_salt}


@dataclass(frozen=True)
class Abort:
    """`abort_request(request_id)` just before engine step `step`."""

    step: int
    request_id: str


Event = Arrival | Abort


def _by_step(events: Sequence[Event]) -> list[Event]:
    for event in events:
        if event.step < 1:
            raise ValueError(f"events happen before a step numbered from 1, got {event!r}")
        if isinstance(event, Arrival) and not isinstance(event.params, SamplingParams):
            raise ValueError(f"replay takes SamplingParams only (beam search follows the model), got {event!r}")
    return sorted(events, key=lambda e: e.step)  # stable: events of one step keep their order


def drive(engine, events: Sequence[Event]) -> dict:
    """Add and abort requests just before their steps and step `engine` until everything has finished.
    Returns each request's last output (`RequestOutput`), by request id."""
    pending = _by_step(events)
    outputs = {}
    while True:
        next_step = engine.scheduler.stats.num_steps + 1
        while pending and pending[0].step <= next_step:
            event = pending.pop(0)
            if isinstance(event, Arrival):
                engine.add_request(event.request_id, event.prompt, event.params)
            else:
                engine.abort_request(event.request_id)
        if not pending and not engine.has_unfinished_requests():
            return outputs
        for output in engine.step():
            outputs[output.request_id] = output


def replay(
    config: EngineConfig, events: Sequence[Event], num_blocks: int, num_cpu_blocks: int = 0,
    cost_model: PreemptionCostModel | None = None, num_trace_steps: int | None = None,
) -> Trace:
    """The trace an engine with `config` (its `max_model_len` resolved), `num_blocks` device blocks and
    `num_cpu_blocks` CPU blocks would record over `events`, computed by the scheduler alone. Every sampled
    token is a new made-up id, so no two sequences ever generate the same block."""
    if config.max_model_len is None:
        raise ValueError("replay needs the engine's resolved max_model_len (engine.config)")
    kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
    swaps = PreemptionMode(config.preemption_mode) != PreemptionMode.RECOMPUTE
    swap_space = SwapSpace(kv, num_cpu_blocks) if swaps else None
    scheduler = Scheduler(config, kv, swap_space, cost_model)
    trace = Trace(num_blocks, config.block_size, num_cpu_blocks, num_trace_steps)
    made_up = itertools.count(1_000_000)
    pending = _by_step(events)
    num_arrivals = 0
    while True:
        next_step = scheduler.stats.num_steps + 1
        while pending and pending[0].step <= next_step:
            event = pending.pop(0)
            if isinstance(event, Abort):
                scheduler.finish_groups([event.request_id], RequestStatus.FINISHED_ABORTED)
                continue
            room = config.max_model_len - len(event.prompt_token_ids)
            max_tokens = room if event.params.max_tokens is None else min(event.params.max_tokens, room)
            scheduler.add_request(Request(
                scheduler.unique_id(event.request_id), list(event.prompt_token_ids), event.params, num_arrivals,
                max_tokens, cache_salt=event.cache_salt, group_id=event.request_id,
            ))
            num_arrivals += 1
        if not pending and not scheduler.has_unfinished_requests():
            return trace
        output = scheduler.schedule()
        sampled = {t.request_id: next(made_up) for s in output.scheduled for t in s.sampling}
        update = scheduler.update_from_output(output, sampled)
        scheduler.check_invariants()
        trace.append(StepRecord.build(output, update, scheduler.snapshot()))


def replay_engine(engine, events: Sequence[Event]) -> Trace:
    """`replay` with the engine's own settings, pool sizes and measured cost model."""
    worker = engine.worker
    return replay(engine.config, events, worker.num_blocks, worker.num_cpu_blocks, worker.cost_model,
                  engine.trace.max_steps)


def schedule_of(record: StepRecord) -> StepRecord:
    """The record without what depends on the model: token values (kept: who got one) and the step's time."""
    scheduled = tuple(
        dataclasses.replace(s, token_ids=(), sampling=tuple(dataclasses.replace(t, params=None) for t in s.sampling))
        for s in record.scheduled
    )
    appended = tuple((rid, 0) for rid, _ in record.appended)
    return dataclasses.replace(record, scheduled=scheduled, appended=appended, duration_s=0.0)


def first_difference(trace: Trace, other: Trace) -> str | None:
    """None if the two traces made the same decisions at every step; else the first step and field that differ."""
    if len(trace) != len(other):
        return f"{len(trace)} steps against {len(other)}"
    for a, b in zip(trace, other):
        a, b = schedule_of(a), schedule_of(b)
        for field in dataclasses.fields(StepRecord):
            x, y = getattr(a, field.name), getattr(b, field.name)
            if x != y:
                return f"step {a.step}, {field.name}: {x!r} against {y!r}"
    return None
