"""The engine core's seams: one core under the real engine and the simulator, the executor contract, finished ids
on the next step, one error channel, ids, and prompt hashes computed once."""

from __future__ import annotations

import pytest

from pagedlab import LLMEngine, SamplingParams
from pagedlab.config import EngineConfig
from pagedlab.core.engine_core import EngineCore
from pagedlab.core.executor import WorkerInfo
from pagedlab.core.sched_output import ModelRunnerOutput
from pagedlab.sim import SimEngine, StepCostModel
from pagedlab.sim.fake_model import MadeUpExecutor, MadeUpTokens
from tests.helpers import tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def test_the_engine_and_the_simulator_share_one_core(model):
    config = EngineConfig(block_size=4, num_kv_blocks=32, max_model_len=64, preemption_mode="recompute")
    engine = LLMEngine(model, None, config)
    simulator = SimEngine(config, StepCostModel.constant(1.0))
    assert type(engine.engine_core) is type(simulator.engine_core) is EngineCore
    assert engine.scheduler is engine.engine_core.scheduler and simulator.scheduler is simulator.engine_core.scheduler
    assert type(engine.stats()) is type(simulator.stats())


def test_every_executor_describes_itself_with_one_info_record(model):
    engine = LLMEngine(model, None, EngineConfig(block_size=4, num_kv_blocks=32, preemption_mode="swap",
                                                 num_cpu_blocks=8))
    info = engine.worker.info
    assert isinstance(info, WorkerInfo)
    assert (info.num_blocks, info.num_cpu_blocks, info.max_model_len) == (32, 8, engine.config.max_model_len)
    assert engine.swap_space is not None and engine.swap_space.num_cpu_blocks == 8
    made_up = MadeUpExecutor(WorkerInfo(8, 0, 0, 32), MadeUpTokens())
    for executor in (engine.worker, made_up):
        assert callable(executor.execute_model) and callable(executor.shutdown)


class RecordingExecutor(MadeUpExecutor):
    def __init__(self, info):
        super().__init__(info, MadeUpTokens())
        self.seen = []

    def execute_model(self, scheduler_output):
        self.seen.append(scheduler_output)
        return super().execute_model(scheduler_output)


def test_finished_ids_ride_on_the_next_scheduler_output():
    """A sequence that finished (stopped, aborted) reaches the executor with the next step, as vLLM's
    `finished_req_ids`: there is no other path by which the worker learns of it."""
    config = EngineConfig(block_size=4, max_model_len=32, preemption_mode="recompute", max_num_seqs=4)
    executor = RecordingExecutor(WorkerInfo(16, 0, 0, 32))
    core = EngineCore(config, executor)
    core.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    core.add_request("b", [4, 5], SamplingParams(max_tokens=8, ignore_eos=True))
    core.finish_step(core.step())  # prefill: a's first token
    core.finish_step(core.step())  # a's second token: finished
    assert not core.scheduler.has_group("a")
    core.abort_requests(["b"])
    core.add_request("c", [6], SamplingParams(max_tokens=1, ignore_eos=True))
    core.finish_step(core.step())
    assert executor.seen[0].finished_req_ids == executor.seen[1].finished_req_ids == ()
    assert executor.seen[2].finished_req_ids == ("a", "b")


def test_one_error_channel_carries_scheduling_and_worker_failures():
    """A group that can never fit (found while scheduling) and a group whose processing raised (found by the
    worker) both arrive in `update.failed`, the one channel the output processor reads."""

    class FailingExecutor(MadeUpExecutor):
        def execute_model(self, scheduler_output):
            out = super().execute_model(scheduler_output)
            errors = {s.group_id: "boom" for s in scheduler_output.scheduled if s.group_id == "bad"}
            tokens = {r: t for r, t in out.sampled_token_ids.items() if not r.startswith("bad")}
            return ModelRunnerOutput(tokens, errors=errors)

    config = EngineConfig(block_size=4, max_model_len=64, preemption_mode="recompute", max_num_seqs=8)
    core = EngineCore(config, FailingExecutor(WorkerInfo(4, 0, 0, 64), MadeUpTokens()))
    core.add_request("big", list(range(5)), SamplingParams(n=4, temperature=1, max_tokens=30, ignore_eos=True))
    core.add_request("bad", [1, 2], SamplingParams(max_tokens=3, ignore_eos=True))
    failed = {}
    while core.has_unfinished_requests():
        output = core.step()
        failed.update(output.update.failed)
        core.finish_step(output)
        core.check_invariants()
    assert failed.keys() == {"big", "bad"} and failed["bad"] == "boom" and "even alone" in failed["big"]


def test_generated_ids_never_collide_with_given_ones(model):
    engine = LLMEngine(model, None, EngineConfig(block_size=4, num_kv_blocks=32))
    engine.add_request("1", [1, 2, 3], GREEDY)
    generated = engine.add_request(None, [4, 5], GREEDY)  # the arrival count, 1, is taken
    engine.add_request("0", [1, 2, 3], GREEDY)
    assert generated not in ("0", "1")
    with pytest.raises(TypeError, match="request_id must be a string"):
        engine.add_request(5, [1, 2], GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().num_finished == 3


def test_a_prompt_is_hashed_once_however_long_it_waits(monkeypatch):
    """Prefix caching: the waiting head's prompt blocks are hashed on arrival and kept, not again at every step it
    waits for room (vLLM keeps `block_hashes` per request)."""
    from pagedlab.core import block_hash, kv_cache_manager

    calls = []

    def counting(parent, tokens):
        calls.append(tuple(tokens))
        return block_hash.hash_block(parent, tokens)

    monkeypatch.setattr(kv_cache_manager, "hash_block", counting)
    config = EngineConfig(block_size=4, max_model_len=64, preemption_mode="recompute", enable_prefix_caching=True,
                          max_num_seqs=8)
    core = EngineCore(config, MadeUpExecutor(WorkerInfo(6, 0, 0, 64), MadeUpTokens()))
    core.add_request("long", list(range(16)), SamplingParams(max_tokens=6, ignore_eos=True))  # 4 + 2 blocks
    core.add_request("waits", list(range(100, 116)), SamplingParams(max_tokens=1, ignore_eos=True))
    prompt_blocks = [tuple(range(100 + 4 * i, 104 + 4 * i)) for i in range(4)]
    num_waiting_steps = 0
    while core.has_unfinished_requests():
        num_waiting_steps += "waits" in [r.request_id for r in core.scheduler.waiting]
        core.finish_step(core.step())
    assert num_waiting_steps > 3
    assert [calls.count(block) for block in prompt_blocks] == [1, 1, 1, 1]


def test_forced_preemption_never_stops_the_only_running_request():
    """`force_preemption_rate` preempts the newest group, but never the only one running: the oldest request
    always progresses (one 100-token prompt, budget 4, rate 0.3 made nothing in 3,000 steps before)."""
    config = EngineConfig(block_size=4, max_model_len=128, preemption_mode="recompute", enable_chunked_prefill=True,
                          max_num_batched_tokens=4, force_preemption_rate=0.3)
    core = EngineCore(config, MadeUpExecutor(WorkerInfo(64, 0, 0, 128), MadeUpTokens()))
    core.add_request("only", list(range(100)), SamplingParams(max_tokens=3, ignore_eos=True))
    for _ in range(200):
        if not core.has_unfinished_requests():
            break
        core.finish_step(core.step())
    assert not core.has_unfinished_requests()
