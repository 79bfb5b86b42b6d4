"""The simulator is the engine: for ignore-EOS workloads on a tiny model, `simulate(...)` records the same trace
as `LLMEngine`, step by step (scheduled tokens and block tables, allocations, frees, preemptions, swaps,
copies, forks, prefix-cache contents and hits), across block sizes, preemption modes, partial preemption,
chunked prefill and prefix caching, with requests arriving while others run.

Time is counted in steps here (every step that computes something lasts one second), so that both sides
see the same arrivals; the engine's own measured "auto" cost model is handed to the simulator. Token values
differ (the simulator makes them up) and are left out of the comparison; everything else must be equal.
Beam search is not compared: its beam steps depend on the model's log-probabilities.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedlab import LLMEngine
from pagedlab.config import EngineConfig
from pagedlab.core.block_table import cdiv
from pagedlab.core.trace import first_difference
from pagedlab.sim import SimRequest, StepCostModel, drive_requests, simulate
from tests.helpers import random_prompts, tiny_model

STEP = StepCostModel.constant(1.0)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def workload(seed: int, num: int = 7, shared_prefix: int = 0, n: int = 1, late: bool = False) -> list[SimRequest]:
    """`num` requests arriving over the first steps, some together; prompts of 1-40 tokens (after an optional
    shared prefix), outputs of 1-24 tokens; every other request draws `n` samples. `late`: the last one
    arrives long after the others have finished (the engine idles until then)."""
    import random

    rng = random.Random(seed)
    lengths = [rng.randint(1, 40) for _ in range(num)]
    prompts = random_prompts(lengths, seed=seed)
    prefix = random_prompts([shared_prefix], seed=seed + 100)[0] if shared_prefix else []
    arrivals = sorted(rng.choice([0, 0, 1, 2, 3, 5, 8, 13]) for _ in range(num))
    if late:
        arrivals[-1] = 500
    return [SimRequest(tuple(prefix + p), rng.randint(1, 24), float(a), n if i % 2 else 1)
            for i, (p, a) in enumerate(zip(prompts, arrivals))]


def run_engine(model, requests: list[SimRequest], config: EngineConfig) -> LLMEngine:
    """Drive the engine with the simulator's clock (a step that computes something lasts one second), checking
    its invariants after every step."""
    engine = LLMEngine(model, None, config)
    drive_requests(engine, requests, STEP, on_step=lambda record, start_s: engine.check_invariants())
    return engine


def assert_same_trace(engine: LLMEngine, trace) -> None:
    """The same schedule (`pagedlab.core.trace.schedule_of`: every field but durations and token values) at every
    step, and the same counters."""
    difference = first_difference(engine.trace, trace)
    assert difference is None, f"engine != simulator: {difference}"
    stats = engine.stats()
    assert trace.stats.num_preemptions == stats.num_preemptions
    assert trace.stats.prefix_cache_hits == stats.prefix_cache_hits
    assert trace.stats.num_swapped_out_blocks == stats.num_swapped_out_blocks


CASES = {
    # name: (engine config, workload options, what must happen in it)
    "bs1-recompute": (dict(block_size=1, num_kv_blocks=90), dict(seed=1), {"recompute"}),
    "bs4-recompute-tight": (dict(block_size=4, num_kv_blocks=18), dict(seed=2), {"recompute"}),
    "bs16-recompute": (dict(block_size=16, num_kv_blocks=6), dict(seed=3), {"recompute"}),
    "bs4-swap": (dict(block_size=4, num_kv_blocks=18, preemption_mode="swap", num_cpu_blocks=12), dict(seed=4),
                 {"swap"}),
    "bs2-swap-cpu-full": (dict(block_size=2, num_kv_blocks=36, preemption_mode="swap", num_cpu_blocks=6),
                          dict(seed=5), {"recompute"}),
    "bs4-auto": (dict(block_size=4, num_kv_blocks=18, preemption_mode="auto", num_cpu_blocks=18), dict(seed=6),
                 {"swap"}),
    "bs4-partial-idle": (dict(block_size=4, num_kv_blocks=16, enable_partial_preemption=True),
                         dict(seed=6, late=True), {"partial", "recompute", "idle"}),
    "bs8-chunked": (dict(block_size=8, num_kv_blocks=10, enable_chunked_prefill=True, max_num_batched_tokens=16),
                    dict(seed=8), {"recompute", "chunk"}),
    "bs4-chunked-swap-partial": (dict(block_size=4, num_kv_blocks=18, enable_chunked_prefill=True,
                                      max_num_batched_tokens=8, preemption_mode="swap", num_cpu_blocks=18,
                                      enable_partial_preemption=True), dict(seed=9), {"swap", "partial", "chunk"}),
    "bs4-prefix": (dict(block_size=4, num_kv_blocks=24, enable_prefix_caching=True), dict(seed=10, shared_prefix=9),
                   {"hit", "evict"}),
    "bs2-prefix-chunked-recompute": (dict(block_size=2, num_kv_blocks=40, enable_prefix_caching=True,
                                          enable_chunked_prefill=True, max_num_batched_tokens=6),
                                     dict(seed=11, shared_prefix=7), {"hit", "recompute", "chunk"}),
    "bs4-prefix-swap": (dict(block_size=4, num_kv_blocks=20, enable_prefix_caching=True, preemption_mode="swap",
                             num_cpu_blocks=10), dict(seed=12, shared_prefix=12), {"hit", "swap"}),
    "bs4-samples-cow": (dict(block_size=4, num_kv_blocks=30, max_num_seqs=6), dict(seed=13, n=3),
                        {"fork", "copy", "recompute"}),
    "bs4-samples-swap": (dict(block_size=4, num_kv_blocks=24, preemption_mode="swap", num_cpu_blocks=24),
                         dict(seed=14, n=2), {"fork", "copy", "swap"}),
    "forced-preemption": (dict(block_size=4, num_kv_blocks=40, preemption_mode="swap", num_cpu_blocks=8,
                               force_preemption_rate=0.3), dict(seed=15), {"swap"}),
}


def simulate_as(engine, requests, config: EngineConfig):
    """`simulate` with the engine's configuration (as given) and its preemption cost model."""
    fields = {k: getattr(config, k) for k in config.__dataclass_fields__}
    return simulate(requests, cost_model=STEP, preemption_cost_model=engine.cost_model, **fields)


@pytest.mark.parametrize("case", list(CASES))
def test_simulator_records_the_engines_trace(model, case):
    options, workload_options, expected = CASES[case]
    requests = workload(**workload_options)
    config = EngineConfig(**{"max_model_len": 64, "max_num_batched_tokens": 64, "preemption_mode": "recompute",
                             "max_trace_steps": None, **options})
    engine = run_engine(model, requests, config)
    trace = simulate_as(engine, requests, config)
    assert_same_trace(engine, trace)
    assert events(trace) >= expected, f"the case does not exercise {expected - events(trace)}"


def events(trace) -> set[str]:
    """What happened in a trace, in the words of `CASES`."""
    stats, steps = trace.stats, trace.steps
    found = {
        "recompute": stats.num_preemptions_recompute, "swap": stats.num_preemptions_swap,
        "partial": stats.num_preemptions_partial, "hit": stats.prefix_cache_hits,
        "evict": stats.num_evicted_blocks, "fork": any(r.forked for r in steps),
        "copy": any(r.copied for r in steps),
        "chunk": any(s.num_new_tokens > 1 and not s.sampling for r in steps for s in r.scheduled),
        "idle": any(b > a + 1 for a, b in zip(trace.step_start_s, trace.step_start_s[1:])),
    }
    return {name for name, happened in found.items() if happened}


@st.composite
def random_cases(draw):
    """A tight pool (a few requests' worth), any block size, mode, chunking, prefix caching and samples."""
    block_size = draw(st.sampled_from((1, 2, 4, 8, 16)), "block_size")
    num_blocks = draw(st.integers(cdiv(64, block_size), cdiv(160, block_size)), "num_blocks")
    mode = draw(st.sampled_from(("recompute", "swap", "auto")), "preemption_mode")
    chunked = draw(st.booleans(), "chunked")
    options = dict(
        block_size=block_size, num_kv_blocks=num_blocks, preemption_mode=mode, enable_chunked_prefill=chunked,
        max_num_batched_tokens=draw(st.integers(1, 24) if chunked else st.integers(64, 128), "budget"),
        enable_prefix_caching=draw(st.booleans(), "prefix_caching"),
        enable_partial_preemption=draw(st.booleans(), "partial"), max_num_seqs=draw(st.integers(3, 8), "seqs"),
        num_cpu_blocks=draw(st.integers(0, num_blocks), "cpu_blocks") if mode != "recompute" else None,
    )
    workload_options = dict(seed=draw(st.integers(0, 10**6), "seed"), shared_prefix=draw(st.sampled_from((0, 9))),
                            n=draw(st.sampled_from((1, 1, 2, 3)), "n"))
    return options, workload_options


@pytest.mark.slow
@settings(max_examples=10, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=random_cases())
def test_simulator_records_the_engines_trace_random(model, case):
    options, workload_options = case
    requests = workload(**workload_options)
    config = EngineConfig(**{"max_model_len": 64, "max_trace_steps": None, **options})
    engine = run_engine(model, requests, config)
    trace = simulate_as(engine, requests, config)
    assert_same_trace(engine, trace)


@pytest.mark.parametrize("case", ["bs4-recompute-tight", "bs4-chunked-swap-partial", "bs2-prefix-chunked-recompute",
                                  "bs4-samples-cow"])
def test_simulator_agrees_with_pagedlab_replay(model, case):
    """`pagedlab.replay` (chapter 05) is the same idea counted in steps: on a workload that never idles (so
    that arriving at second a is arriving before step a + 1), both make the same decisions at every step."""
    from pagedlab.replay import Arrival, first_difference, replay_engine
    from pagedlab.sampling_params import SamplingParams

    options, workload_options, _ = CASES[case]
    requests = workload(**workload_options)
    config = EngineConfig(**{"max_model_len": 64, "max_num_batched_tokens": 64, "preemption_mode": "recompute",
                             "max_trace_steps": None, **options})
    engine = LLMEngine(model, None, config)
    simulated = simulate_as(engine, requests, config)
    assert all(r.scheduled for r in simulated), "the workload idles: arrival seconds are not step numbers"
    arrivals = [Arrival(int(r.arrival_s) + 1, str(i), r.prompt_token_ids,
                        SamplingParams(n=r.n, temperature=1.0 if r.n > 1 else 0.0, seed=i, max_tokens=r.output_len,
                                       ignore_eos=True))
                for i, r in enumerate(requests)]
    assert first_difference(replay_engine(engine, arrivals), simulated) is None
