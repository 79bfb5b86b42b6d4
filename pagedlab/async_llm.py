"""`AsyncLLM`: the engine behind a server, shared by every HTTP request (vLLM's name).

One background task owns the `LLMEngine`. Every engine call (add, abort, step, stats) runs on one worker
thread, in the order it was asked for, so the engine never sees two threads and the event loop never waits
on a step. The task steps while requests are pending and sleeps on an event when none are. Each request gets
a `RequestStream` of deltas (`RequestOutputKind.DELTA`); closing it early (a client that went away) aborts
the request, and its blocks are free before the next step.

# Explained in chapters/13_serving.ipynb
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from pagedlab.outputs import EngineStats, RequestOutput
from pagedlab.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("pagedlab.async_llm")
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine's step raised: every pending request fails with this, and so does every new one."""


@dataclass(frozen=True)
class FinishedRequest:
    """Timings of one finished request, in seconds (what the request histograms record)."""

    finish_reason: str | None  # of its first sample; "abort" when the client went away
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency: float  # arrival to the end of its last step
    # Its phases (vLLM's), None without a token: queued from arrival to the start of the step that gave its first
    # token, prefilling in that step, decoding from its end to its last token (they add up to e2e_latency).
    queue_time: float | None
    prefill_time: float | None = None
    decode_time: float | None = None


@dataclass
class IterationStats:
    """What one step did (or, `is_step` False, an abort between steps), as seen from outside the engine: pure data
    for the stat loggers."""

    step_start: float
    step_end: float
    is_step: bool = True
    num_prompt_tokens: int = 0  # prompts of the requests that got their first token in this step
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)


@dataclass
class _RequestState:
    request_id: str
    stream: RequestStream
    arrival: float
    first_token_step_start: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0
    finish_reason: str | None = None  # of its first sample (a delta carries only the samples that changed)

    def finished(self, finish_reason: str | None, now: float) -> FinishedRequest:
        queue = prefill = decode = None
        if self.first_token_time is not None:
            queue = self.first_token_step_start - self.arrival
            prefill = self.first_token_time - self.first_token_step_start
            decode = self.last_token_time - self.first_token_time
        return FinishedRequest(finish_reason, len(self.stream.prompt_token_ids or ()), self.num_generation_tokens,
                               now - self.arrival, queue, prefill, decode)


def merge_deltas(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """Two consecutive DELTA outputs of one request as one: texts, token ids and logprobs concatenated per
    sample; the newer finish state wins; the prompt's logprobs (sent once) are kept. Used when the consumer is
    slower than the steps."""
    by_index = {c.index: c for c in old.outputs}
    merged = []
    for c in new.outputs:
        before = by_index.pop(c.index, None)
        if before is None:
            merged.append(c)
            continue
        logprobs = None if c.logprobs is None else (before.logprobs or []) + c.logprobs
        merged.append(dataclasses.replace(c, text=before.text + c.text, token_ids=before.token_ids + c.token_ids,
                                          logprobs=logprobs))
    merged.extend(by_index.values())
    merged.sort(key=lambda c: c.index)
    return dataclasses.replace(new, outputs=merged, prompt_logprobs=old.prompt_logprobs or new.prompt_logprobs)


class RequestStream:
    """The deltas of one request, as an async iterator (vLLM's `RequestOutputCollector`).

    Holds at most one undelivered output: a new delta is merged into it, so a slow reader gets fewer, larger
    deltas and memory does not grow. `close()` aborts the request unless it finished."""

    def __init__(self, request_id: str, owner: AsyncLLM) -> None:
        self.request_id = request_id
        self.prompt_token_ids: list[int] | None = None  # known from the first output on
        self.num_cached_tokens = 0  # its prompt tokens found in the prefix cache, known from the first output on
        self._owner = owner
        self._pending: RequestOutput | Exception | None = None
        self._ready = asyncio.Event()
        self.finished = False  # the engine finished it (or failed it); nothing more will come
        self._closed = False

    def put(self, item: RequestOutput | Exception) -> None:
        if isinstance(self._pending, RequestOutput) and isinstance(item, RequestOutput):
            self._pending = merge_deltas(self._pending, item)
        elif not isinstance(self._pending, Exception):
            self._pending = item
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished and self._pending is None:
            raise StopAsyncIteration
        await self._ready.wait()
        item, self._pending = self._pending, None
        self._ready.clear()
        if isinstance(item, Exception):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        """Stop listening; abort the request if the engine has not finished it. Safe to call twice."""
        if not self._closed:
            self._closed = True
            if not self.finished:
                self._owner.abort_nowait(self.request_id)


def engine_thread() -> ThreadPoolExecutor:
    """The one thread an `AsyncLLM` makes every engine call on. Build the engine on it too:

        engine, executor = build_on_engine_thread(LLMEngine.from_pretrained, "smollm2")
        async_llm = AsyncLLM(engine, executor=executor)

    OpenMP keeps a team of threads for each thread that has run a parallel region. A model loaded (and its KV
    cache profiled) on one thread and stepped on another makes two teams: more OpenMP threads than the cores of a
    small machine, and libgomp then stops spinning at its barriers, so each of the step's hundreds of parallel
    regions waits for threads to wake (a decode step about 15% slower on 2 cores)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedlab-engine")


def build_on_engine_thread(build: Callable[..., T], *args, **kwargs) -> tuple[T, ThreadPoolExecutor]:
    """`build(*args, **kwargs)` (an engine: `LLMEngine.from_pretrained`, `LLMEngine`) run on a new
    `engine_thread()`; returns it and that thread, for `AsyncLLM(engine, executor=...)` or `build_app`."""
    executor = engine_thread()
    try:
        return executor.submit(build, *args, **kwargs).result(), executor
    except BaseException:
        executor.shutdown(wait=False)
        raise


class AsyncLLM:
    """An `LLMEngine` stepped by a background task, for many concurrent requests.

    It binds to the event loop of its first request. `stat_loggers` get `record(EngineStats, IterationStats
    | None)` after every step and every abort (see `pagedlab.prometheus`). `executor`, the one-thread pool every
    engine call runs on (default a new `engine_thread()`), is best the one the engine was built on; it is shut
    down with the AsyncLLM."""

    def __init__(self, engine, stat_loggers=(), executor: ThreadPoolExecutor | None = None) -> None:
        self.engine = engine
        self.stat_loggers = list(stat_loggers)
        self._executor = executor if executor is not None else engine_thread()
        self._requests: dict[str, _RequestState] = {}
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._num_requests = 0
        self.dead_error: BaseException | None = None
        self.num_steps = 0  # steps this object ran (the idle loop runs none)
        self.stats: EngineStats = engine.stats()  # the engine's counters after the last engine call

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int | None:
        return getattr(self.engine, "max_model_len", None)

    @property
    def is_running(self) -> bool:
        return self.dead_error is None

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    # -- requests -------------------------------------------------------------------------------------------

    async def add_request(self, request_id: str | None, prompt, params: SamplingParams) -> RequestStream:
        """Queue a request and return its stream. The engine's ValueError (bad input) propagates, and then
        nothing has changed."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self.dead_error}")
        self._start()
        if request_id is None:
            request_id = f"req-{self._num_requests}"
        self._num_requests += 1
        params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        arrival = time.monotonic()
        await self._call(self._add, request_id, prompt, params)
        stream = RequestStream(request_id, self)
        self._requests[request_id] = _RequestState(request_id, stream, arrival)
        self._wake.set()
        return stream

    async def generate(
        self, prompt, params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """The deltas of one request; leaving the loop early aborts it."""
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def abort_nowait(self, request_id: str) -> None:
        """Abort a request without waiting: the abort runs on the engine thread before the next step."""
        state = self._requests.pop(request_id, None)
        if state is None or self.dead_error is not None:
            return
        state.stream.finished = True
        future = asyncio.get_running_loop().run_in_executor(self._executor, self._abort, request_id)
        now = time.monotonic()
        finished = state.finished("abort", now)
        future.add_done_callback(lambda f: self._log(IterationStats(now, now, False, finished=[finished])))

    async def abort(self, request_id: str) -> None:
        self.abort_nowait(request_id)
        await self._call(lambda: None)  # returns once the abort has run

    async def shutdown(self) -> None:
        """Abort every request (its reader gets `EngineDeadError`), stop the loop and the engine thread."""
        for request_id, state in list(self._requests.items()):
            state.stream.put(EngineDeadError("the engine was shut down"))
            self.abort_nowait(request_id)
        self.dead_error = self.dead_error or EngineDeadError("the engine was shut down")
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
        await self._call(lambda: None)
        self._executor.shutdown(wait=True)

    # -- the engine thread (everything that touches the engine runs here) --------------------------------------

    def _add(self, request_id: str, prompt, params: SamplingParams) -> None:
        self.engine.add_request(request_id, prompt, params)
        self.stats = self.engine.stats()

    def _abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        self.stats = self.engine.stats()

    def _step(self) -> tuple[float, float, list[RequestOutput]]:
        start = time.monotonic()
        outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
        end = time.monotonic()
        self.stats = self.engine.stats()
        return start, end, outputs

    # -- the event loop side -------------------------------------------------------------------------------

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _start(self) -> None:
        if self._loop_task is None:
            self._wake = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run(), name="pagedlab-engine-loop")

    async def _run(self) -> None:
        """Step while requests are pending; sleep when there are none."""
        try:
            while True:
                if not self._requests:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                start, end, outputs = await self._call(self._step)
                self.num_steps += 1
                self._log(self._dispatch(start, end, outputs))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            logger.exception("the engine loop stopped")
            self.dead_error = exc
            error = EngineDeadError(f"the engine stopped after an error: {type(exc).__name__}: {exc}")
            for state in self._requests.values():
                state.stream.put(error)
            self._requests.clear()

    def _dispatch(self, start: float, end: float, outputs: list[RequestOutput]) -> IterationStats:
        """Hand each output to its stream and measure the step's latencies."""
        iteration = IterationStats(start, end)
        for output in outputs:
            state = self._requests.get(output.request_id)
            if state is None:
                continue  # aborted while the step ran
            num_new = sum(len(c.token_ids) for c in output.outputs)
            if state.stream.prompt_token_ids is None:
                state.stream.prompt_token_ids = list(output.prompt_token_ids)
            state.stream.num_cached_tokens = output.num_cached_tokens or state.stream.num_cached_tokens
            if num_new:
                if state.first_token_step_start is None:
                    state.first_token_step_start, state.first_token_time = start, end
                    iteration.time_to_first_tokens.append(end - state.arrival)
                    iteration.num_prompt_tokens += len(state.stream.prompt_token_ids or ())
                else:
                    iteration.inter_token_latencies.append(end - state.last_token_time)
                state.last_token_time = end
                state.num_generation_tokens += num_new
                iteration.num_generation_tokens += num_new
            state.finish_reason = next((c.finish_reason for c in output.outputs if c.index == 0), state.finish_reason)
            if output.finished:
                del self._requests[output.request_id]
                iteration.finished.append(state.finished(state.finish_reason, end))
            state.stream.put(output)
        return iteration

    def _log(self, iteration: IterationStats | None) -> None:
        for stat_logger in self.stat_loggers:
            stat_logger.record(self.stats, iteration)


__all__ = ["AsyncLLM", "EngineDeadError", "FinishedRequest", "IterationStats", "RequestStream", "engine_thread",
           "merge_deltas"]
