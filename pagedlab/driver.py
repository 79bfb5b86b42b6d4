"""One driver for every engine, real or simulated: requests join and leave by step number, or by a clock.

`drive(engine, events)` adds each `Arrival` just before the engine step it names (steps count from 1, as the
trace's do), does each `Abort` there, steps the engine until everything has finished, and returns each request's
last output. With `clock` (the seconds a recorded step lasts), events happen at their `arrival_s` instead: a
request joins before the first step that starts at or after its arrival, and an idle engine jumps to the next
one. `simulate` drives the `SimEngine` this way on its modelled durations; the calibration drives the real
`LLMEngine` the same way on a clock counted in steps, so that both see the same arrivals. The engine is either:
they share `add_request`, `add_beam_request`, `abort_request`, `has_unfinished_requests`, `step` and `trace`.

# Explained in chapters/05_continuous_batching.ipynb
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagedlab.core.trace import StepRecord
from pagedlab.sampling_params import BeamSearchParams, SamplingParams


@dataclass(frozen=True)
class Arrival:
    """A request added just before engine step `step` or, when the driver runs on a clock, once the clock
    reaches `arrival_s`."""

    step: int
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams | BeamSearchParams
    cache_salt: str | None = None
    arrival_s: float = 0.0

    @property
    def prompt(self) -> dict:
        """The prompt as `LLMEngine.add_request` takes it."""
        prompt = {"prompt_token_ids": list(self.prompt_token_ids)}
        return prompt if self.cache_salt is None else {**prompt, "cache_salt": self.cache_salt}


@dataclass(frozen=True)
class Abort:
    """`abort_request(request_id)` just before engine step `step` (or at `arrival_s` on a clock)."""

    step: int
    request_id: str
    arrival_s: float = 0.0


Event = Arrival | Abort
Clock = Callable[[StepRecord], float]  # the seconds a recorded step lasts


def in_order(events: Sequence[Event], clock: Clock | None = None) -> list[Event]:
    """The events in the order they happen (events at the same step or time keep their order)."""
    for event in events:
        if clock is None and event.step < 1:
            raise ValueError(f"events happen before a step numbered from 1, got {event!r}")
        if clock is not None and not event.arrival_s >= 0:
            raise ValueError(f"arrival times must be finite and >= 0, got {event!r}")
    return sorted(events, key=(lambda e: e.step) if clock is None else (lambda e: e.arrival_s))


def drive(
    engine, events: Sequence[Event], clock: Clock | None = None,
    on_step: Callable[[StepRecord | None, float], None] | None = None,
) -> dict:
    """Add and abort requests as `events` say and step `engine` until everything has finished. Returns each
    request's last output (`RequestOutput`), by request id. `on_step(record, start_s)` is called after every
    step with its trace record and the clock's time when it started (0 without a clock)."""
    pending = in_order(events, clock)
    outputs, now = {}, 0.0
    while True:
        next_step = engine.num_steps + 1
        if clock is not None and pending and not engine.has_unfinished_requests():
            now = max(now, pending[0].arrival_s)  # idle until the next arrival
        while pending and (pending[0].step <= next_step if clock is None else pending[0].arrival_s <= now):
            event = pending.pop(0)
            if isinstance(event, Abort):
                engine.abort_request(event.request_id)
            elif isinstance(event.params, BeamSearchParams):
                engine.add_beam_request(event.request_id, event.prompt, event.params)
            else:
                engine.add_request(event.request_id, event.prompt, event.params)
        if not pending and not engine.has_unfinished_requests():
            return outputs
        num_recorded = len(engine.trace) + engine.trace.num_dropped
        for output in engine.step():
            outputs[output.request_id] = output
        record = engine.trace[-1] if len(engine.trace) + engine.trace.num_dropped > num_recorded else None
        start = now
        if clock is not None:
            if record is None:
                raise ValueError("driving an engine on a clock needs its trace (record_trace=True)")
            now += clock(record)
        if on_step is not None:
            on_step(record, start)
