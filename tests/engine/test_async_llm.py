"""`AsyncLLM` and the metrics logger over a fake engine: steps off the event loop and shared by requests,
no steps when idle, merged deltas for slow readers, aborts on early exit, bad input, a dead engine."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pagedlab.async_llm import AsyncLLM, EngineDeadError, merge_deltas
from pagedlab.outputs import CompletionOutput, RequestOutput
from pagedlab.prometheus import PrometheusStatLogger, parse_metrics
from pagedlab.sampling_params import SamplingParams
from tests.helpers import FakeEngine


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens)


async def _collect(async_llm, prompt, max_tokens, request_id=None, delay=0.0):
    texts = []
    async for output in async_llm.generate({"prompt_token_ids": prompt}, _params(max_tokens), request_id):
        texts.append(output.outputs[0].text)
        await asyncio.sleep(delay)
    return texts


def test_steps_run_on_one_worker_thread_shared_by_requests_and_the_loop_keeps_ticking():
    engine = FakeEngine(step_seconds=0.03)

    async def main():
        async_llm = AsyncLLM(engine)
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.005)

        tick_task = asyncio.ensure_future(ticker())
        results = await asyncio.gather(*(_collect(async_llm, [1, 2], 5) for _ in range(3)))
        tick_task.cancel()
        await async_llm.shutdown()
        return results, ticks, async_llm.num_steps

    results, ticks, num_steps = asyncio.run(main())
    assert results == [["t1 ", "t2 ", "t3 ", "t4 ", "t5 "]] * 3
    assert num_steps == 5  # three requests, one batch: every step served all three
    assert engine.step_threads and threading.get_ident() not in engine.step_threads and len(engine.step_threads) == 1
    assert ticks > 2 * num_steps  # the event loop ran while the steps slept


def test_the_loop_sleeps_when_idle_and_wakes_for_a_new_request():
    engine = FakeEngine()

    async def main():
        async_llm = AsyncLLM(engine)
        await _collect(async_llm, [1], 2)
        steps = async_llm.num_steps
        await asyncio.sleep(0.2)
        idle_steps = async_llm.num_steps - steps
        second = await _collect(async_llm, [1], 3)
        await async_llm.shutdown()
        return steps, idle_steps, second

    steps, idle_steps, second = asyncio.run(main())
    assert steps == 2 and idle_steps == 0 and second == ["t1 ", "t2 ", "t3 "]


def test_a_slow_reader_gets_fewer_merged_deltas_with_every_token():
    engine = FakeEngine(step_seconds=0.005)
    texts = asyncio.run(_collect(AsyncLLM(engine), [1], 12, delay=0.05))
    assert "".join(texts) == "".join(f"t{i} " for i in range(1, 13))
    assert len(texts) < 12


def test_merge_deltas_joins_text_tokens_and_logprobs_and_keeps_the_newer_finish():
    a = RequestOutput("r", None, [1], [CompletionOutput(0, "a", [1], None, logprobs=[{1: -1.0}])], False)
    b = RequestOutput("r", None, [1], [CompletionOutput(0, "b", [2], "stop", "x", logprobs=[{2: -2.0}]),
                                       CompletionOutput(1, "c", [3], None)], True)
    merged = merge_deltas(a, b)
    assert merged.finished and [c.index for c in merged.outputs] == [0, 1]
    first = merged.outputs[0]
    assert (first.text, first.token_ids, first.logprobs, first.finish_reason) == ("ab", [1, 2], [{1: -1.0}, {2: -2.0}],
                                                                                   "stop")


def test_leaving_early_aborts_the_request_before_the_next_step():
    engine = FakeEngine(step_seconds=0.01)

    async def main():
        async_llm = AsyncLLM(engine)
        async for _ in async_llm.generate({"prompt_token_ids": [1]}, _params(1000), "gone"):
            break
        for _ in range(100):  # the abort is queued on the engine thread
            if engine.aborted:
                break
            await asyncio.sleep(0.01)
        await async_llm.shutdown()
        return async_llm.num_unfinished_requests

    assert asyncio.run(main()) == 0
    assert engine.aborted == ["gone"] and not engine.requests


def test_bad_input_raises_the_engines_value_error_and_changes_nothing():
    engine = FakeEngine()

    async def main():
        async_llm = AsyncLLM(engine)
        with pytest.raises(ValueError, match="the prompt is empty"):
            await async_llm.add_request("bad", {"prompt_token_ids": []}, _params(4))
        pending = async_llm.num_unfinished_requests
        ok = await _collect(async_llm, [1], 1)
        await async_llm.shutdown()
        return pending, ok

    assert asyncio.run(main()) == (0, ["t1 "])
    assert not engine.requests


def test_a_step_that_raises_fails_every_pending_request_and_every_new_one():
    engine = FakeEngine(die_at_step=2)

    async def main():
        async_llm = AsyncLLM(engine)
        results = await asyncio.gather(*(_collect(async_llm, [1], 5) for _ in range(2)), return_exceptions=True)
        with pytest.raises(EngineDeadError):
            await async_llm.add_request("late", {"prompt_token_ids": [1]}, _params(1))
        running = async_llm.is_running
        await async_llm.shutdown()
        return results, running

    results, running = asyncio.run(main())
    assert not running
    assert all(isinstance(r, EngineDeadError) and "the model runner broke" in str(r) for r in results)


def test_shutdown_aborts_what_runs_and_its_readers_hear_of_it():
    engine = FakeEngine(step_seconds=0.01)

    async def main():
        async_llm = AsyncLLM(engine)
        reader = asyncio.ensure_future(_collect(async_llm, [1], 1000, "long"))
        while not async_llm.num_steps:
            await asyncio.sleep(0.01)
        await async_llm.shutdown()
        with pytest.raises(EngineDeadError, match="shut down"):
            await reader
        with pytest.raises(EngineDeadError):
            await async_llm.add_request("after", {"prompt_token_ids": [1]}, _params(1))

    asyncio.run(main())
    assert engine.aborted == ["long"] and not engine.requests


def test_prometheus_logger_takes_gauges_and_grows_counters_by_the_engines_growth():
    engine = FakeEngine()

    async def main():
        metrics = PrometheusStatLogger("fake")
        async_llm = AsyncLLM(engine, [metrics])
        await asyncio.gather(_collect(async_llm, [1, 2, 3], 3), _collect(async_llm, [4], 2))
        await async_llm.shutdown()
        return parse_metrics(metrics.render().decode())

    samples = asyncio.run(main())
    label = '{model_name="fake"}'
    assert samples[f"pagedlab:num_requests_running{label}"] == 0
    assert samples[f"pagedlab:kv_cache_usage_perc{label}"] == 0
    assert samples[f"pagedlab:prompt_tokens_total{label}"] == 4
    assert samples[f"pagedlab:generation_tokens_total{label}"] == 5
    assert samples[f"pagedlab:prefix_cache_queries_total{label}"] == 10 * engine.num_steps
    assert samples[f"pagedlab:time_to_first_token_seconds_count{label}"] == 2
    assert samples[f"pagedlab:inter_token_latency_seconds_count{label}"] == 3
    assert samples[f"pagedlab:e2e_request_latency_seconds_count{label}"] == 2
    assert samples[f"pagedlab:request_queue_time_seconds_count{label}"] == 2
    assert samples['pagedlab:request_success_total{finished_reason="length",model_name="fake"}'] == 2
    assert samples['pagedlab:num_preemptions_total{mode="swap",model_name="fake"}'] == 0
