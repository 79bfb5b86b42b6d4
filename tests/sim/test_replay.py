"""pagedlab.replay: a model-free scheduler reproduces the engine's trace step for step, whatever the settings."""

from __future__ import annotations

import dataclasses

import pytest

from pagedlab import LLMEngine, SamplingParams
from pagedlab.beam_search import BeamSearchParams
from pagedlab.config import EngineConfig
from pagedlab.replay import Abort, Arrival, drive, first_difference, replay, replay_engine
from tests.helpers import random_prompts, tiny_model

SETTINGS = {
    "recompute": dict(preemption_mode="recompute"),
    "swap": dict(preemption_mode="swap", num_cpu_blocks=24),
    "auto, partial": dict(preemption_mode="auto", enable_partial_preemption=True),
    "chunked, prefix caching": dict(preemption_mode="recompute", enable_chunked_prefill=True,
                                    max_num_batched_tokens=24, enable_prefix_caching=True),
    "forced, swap, prefix": dict(preemption_mode="swap", force_preemption_rate=0.3, enable_prefix_caching=True),
}


def events() -> list:
    prompts = random_prompts([9, 21, 5, 17, 30, 12, 8, 25])
    prompts[5][:8] = prompts[1][:8]  # a shared prefix: two blocks of 4
    out = []
    for i, prompt in enumerate(prompts):
        n = 2 if i in (2, 6) else 1
        params = SamplingParams(n=n, temperature=1.0 if n > 1 else 0.0, seed=i, max_tokens=6 + 3 * i, ignore_eos=True)
        out.append(Arrival(1 + 2 * i, f"r{i}", tuple(prompt), params))
    return out + [Abort(8, "r3")]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.mark.parametrize("name", SETTINGS)
def test_replay_reproduces_the_engine_trace(model, name):
    config = EngineConfig(block_size=4, num_kv_blocks=24, max_model_len=96, **SETTINGS[name])
    engine = LLMEngine(model, None, config)
    outputs = drive(engine, events())
    assert all(outputs[f"r{i}"].finished for i in range(8) if i != 3)
    assert not outputs["r3"].finished  # aborted: abort_request returns no output
    assert engine.stats().num_preemptions > 0 or "chunked" in name  # the pool is tight: the replay must follow
    assert first_difference(engine.trace, replay_engine(engine, events())) is None


def test_first_difference_names_the_step_and_field(model):
    config = EngineConfig(block_size=4, num_kv_blocks=24, max_model_len=96, preemption_mode="recompute")
    engine = LLMEngine(model, None, config)
    drive(engine, events())
    trace = replay_engine(engine, events())
    assert first_difference(trace, replay_engine(engine, events()[:-1])) is not None  # without the abort
    trace.steps[3] = dataclasses.replace(trace.steps[3], num_free_blocks=-1)
    assert first_difference(engine.trace, trace).startswith("step 4, num_free_blocks: ")
    trace.steps.pop()
    assert first_difference(engine.trace, trace) == f"{len(engine.trace)} steps against {len(trace)}"


def test_replay_refuses_what_it_cannot_replay():
    with pytest.raises(ValueError, match="resolved max_model_len"):
        replay(EngineConfig(), [], num_blocks=4)
    config = EngineConfig(block_size=4, max_model_len=16, preemption_mode="recompute")
    with pytest.raises(ValueError, match="SamplingParams only"):
        replay(config, [Arrival(1, "b", (1, 2), BeamSearchParams(beam_width=2, max_tokens=4))], num_blocks=8)
    with pytest.raises(ValueError, match="numbered from 1"):
        replay(config, [Abort(0, "a")], num_blocks=8)
