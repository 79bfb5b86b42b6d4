"""The simulator's pieces: seeded workloads, made-up beams, the cost model and its fit, the contiguous side,
the metrics, and the checks it shares with the engine. (Its trace equals the engine's: test_sim_consistency.)"""

from __future__ import annotations

import math
import random
import statistics
import subprocess
import sys

import pytest

from pagedlab.config import EngineConfig
from pagedlab.core.sched_output import ScheduledRequest
from pagedlab.sampling_params import BeamSearchParams
from pagedlab.sim import (
    Lengths,
    SimEngine,
    SimRequest,
    StepCostModel,
    cost_fit,
    load_calibration,
    make_workload,
    metrics,
    simulate,
)
from pagedlab.sim.contiguous_schedule import simulate_contiguous
from pagedlab.sim.cost_model import Calibration, step_features
from pagedlab.sim.experiment import Settings, run

STEP = StepCostModel.constant(1.0)


# -- workloads ------------------------------------------------------------------------------------------------


def test_workloads_are_seeded_and_follow_their_distributions():
    a = make_workload(400, request_rate=5.0, seed=3)
    assert a == make_workload(400, request_rate=5.0, seed=3) and a != make_workload(400, request_rate=5.0, seed=4)
    gaps = [b.arrival_s - a_.arrival_s for a_, b in zip(a, a[1:])]
    assert statistics.mean(gaps) == pytest.approx(1 / 5.0, rel=0.15)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, abs=0.15)  # Poisson: CV 1
    bursty = make_workload(400, request_rate=5.0, burstiness=0.2, seed=3)
    bursty_gaps = [b.arrival_s - a_.arrival_s for a_, b in zip(bursty, bursty[1:])]
    assert statistics.stdev(bursty_gaps) / statistics.mean(bursty_gaps) > 1.8  # gamma shape 0.2: CV sqrt(5)
    assert all(r.arrival_s == 0 for r in make_workload(10))  # all at once by default
    rng = random.Random(0)
    assert statistics.mean(Lengths("exponential", 100, high=10**6).sample(rng) for _ in range(4000)) == pytest.approx(
        100, rel=0.08)
    assert statistics.median(Lengths("lognormal", 50, high=10**6).sample(rng) for _ in range(4000)) == pytest.approx(
        50, rel=0.1)
    assert {Lengths("uniform", low=3, high=5).sample(rng) for _ in range(200)} == {3, 4, 5}
    assert {Lengths("fixed", 7).sample(rng) for _ in range(20)} == {7}
    chat = [Lengths("chat").sample(rng, "prompt") for _ in range(500)]
    assert min(chat) >= 20 and max(chat) <= 400


def test_shared_prefix_fraction():
    requests = make_workload(200, shared_prefix_fraction=0.5, prefix_len=32, prompt_len=Lengths("fixed", 8), seed=1)
    prefix = requests[0].prompt_token_ids[:32] if requests[0].num_prompt_tokens == 40 else None
    shared = [r for r in requests if r.num_prompt_tokens == 40]
    assert 70 < len(shared) < 130 and all(r.prompt_token_ids[:32] == shared[0].prompt_token_ids[:32] for r in shared)
    assert prefix is None or prefix == shared[0].prompt_token_ids[:32]


@pytest.mark.parametrize("bad, match", [
    (dict(num_requests=0), "num_requests"), (dict(request_rate=0), "request_rate"),
    (dict(burstiness=0, request_rate=1), "burstiness"), (dict(shared_prefix_fraction=2), "shared_prefix_fraction"),
])
def test_bad_workloads_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        make_workload(**{"num_requests": 5, **bad})
    with pytest.raises(ValueError, match="kind"):
        Lengths("normal")
    with pytest.raises(ValueError, match="output_len"):
        SimRequest((1,), 0)


# -- the simulator -------------------------------------------------------------------------------------------


def test_latencies_on_a_hand_checked_run():
    """One request, 4 prompt tokens, 3 out, one second a step: its tokens come at 1, 2, 3 s."""
    trace = simulate([SimRequest((1, 2, 3, 4), 3, 0.0), SimRequest((5, 6), 2, 10.0)], cost_model=STEP,
                     num_kv_blocks=8, block_size=4, preemption_mode="recompute")
    assert metrics.token_times(trace) == {"0": [1.0, 2.0, 3.0], "1": [11.0, 12.0]}  # idle from 3 s to 10 s
    latencies = metrics.latencies(trace)
    assert latencies.ttft_s == (1.0, 1.0) and latencies.tpot_s == (1.0, 1.0) and latencies.e2e_s == (3.0, 2.0)
    assert metrics.makespan(trace) == 12.0 and metrics.num_output_tokens(trace) == 5
    assert trace.step_start_s == [0.0, 1.0, 2.0, 10.0, 11.0]


def test_kv_usage_agrees_with_the_benchmark_accounting():
    from pagedlab.bench.run_metrics import kv_samples

    trace = simulate(make_workload(30, n=2, request_rate=4.0, seed=2), cost_model=STEP, num_kv_blocks=300,
                     block_size=8, preemption_mode="swap", enable_prefix_caching=True)
    for usage, sample in zip(metrics.paged_usage(trace), kv_samples(trace)):
        assert (usage.allocated, usage.live) == (sample.allocated, sample.live)
        assert usage.allocated + usage.free == 300 * 8
    assert any(r.copied for r in trace.steps) and trace.stats.num_preemptions > 0


def test_beam_search_forks_prunes_and_ends_at_its_length():
    config = EngineConfig(block_size=4, num_kv_blocks=200, max_model_len=256, preemption_mode="recompute",
                          max_trace_steps=None)
    engine = SimEngine(config, STEP)
    for i in range(3):
        engine.add_beam_request(None, list(range(10 + i)), BeamSearchParams(4, 12, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        engine.scheduler.check_invariants()
    trace = engine.trace
    finished = [reason for r in trace for _, reason in r.finished]
    assert set(finished) == {"pruned"} and not engine.beams.groups
    assert sum(len(r.forked) for r in trace) >= 3 * 3  # each search forked at least its first 3 extra beams
    tokens = metrics.token_times(trace)
    assert all(len(set(times)) == 11 for times in tokens.values())  # 11 beam steps append; the 12th ends it
    assert engine.kv_cache_manager.num_free_blocks == 200


def test_beam_search_survives_recompute_preemption():
    trace = simulate([SimRequest(tuple(range(20)), 16, beam_width=3), SimRequest(tuple(range(30, 50)), 16,
                      beam_width=3)], cost_model=STEP, num_kv_blocks=16, block_size=4,
                     preemption_mode="recompute")
    assert any(r.restarted for r in trace) and trace.steps[-1].num_free_blocks == 16


@pytest.mark.parametrize("spec, options", [
    (SimRequest(tuple(range(70)), 4), {}),  # longer than max_model_len
    (SimRequest(tuple(range(40)), 4), dict(max_num_batched_tokens=32)),  # one step cannot hold it
    (SimRequest((1, 2, 3), 4, n=5), dict(max_num_seqs=4)),
    (SimRequest((1, 2, 3), 4, beam_width=5), dict(max_num_seqs=4)),
])
def test_a_request_that_can_never_run_is_refused_as_the_engine_refuses_it(spec, options):
    import torch

    from pagedlab.beam_search import BeamSearchParams
    from pagedlab.engine import LLMEngine
    from pagedlab.sampling_params import SamplingParams
    from tests.helpers import tiny_model

    config = dict(block_size=4, num_kv_blocks=32, max_model_len=64, preemption_mode="recompute", **options)
    engine = LLMEngine(tiny_model(), None, EngineConfig(**config))
    with torch.inference_mode(), pytest.raises(ValueError) as expected:
        prompt = {"prompt_token_ids": [t % 100 for t in spec.prompt_token_ids]}
        if spec.beam_width:
            engine.add_beam_request("x", prompt, BeamSearchParams(spec.beam_width, spec.output_len))
        else:
            engine.add_request("x", prompt, SamplingParams(n=spec.n, temperature=1.0, max_tokens=spec.output_len))
    with pytest.raises(ValueError) as simulated:
        simulate([spec], cost_model=STEP, **config)
    assert str(expected.value) in str(simulated.value)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="num_kv_blocks"):
        simulate(make_workload(2), cost_model=STEP, preemption_mode="recompute")
    with pytest.raises(ValueError, match="can never fit"):
        simulate(make_workload(2), cost_model=STEP, num_kv_blocks=4, max_model_len=100, preemption_mode="recompute")
    with pytest.raises(ValueError, match="KV budget"):
        run(Settings(kv_slots=128, num_requests=5))


def test_the_simulator_imports_no_torch():
    code = ("import sys; from pagedlab.sim.experiment import Settings, run; from pagedlab.viz import playground; "
            "run(Settings(num_requests=10)); assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- contiguous memory ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("reserve", ["max_model_len", "max_tokens"])
def test_static_contiguous_simulation_equals_the_contiguous_engine(reserve):
    """All at once, static batches: the simulator's reports are `ContiguousEngine`'s, step for step."""
    from pagedlab.contiguous import ContiguousEngine
    from pagedlab.sampling_params import SamplingParams
    from tests.helpers import random_prompts, tiny_model

    rng = random.Random(5)
    lengths = [(rng.randint(1, 20), rng.randint(1, 12)) for _ in range(9)]
    prompts = random_prompts([p for p, _ in lengths])
    engine = ContiguousEngine(tiny_model(), num_slots=100, max_model_len=32, max_batch_size=4, reserve=reserve)
    out = engine.generate(prompts, [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in lengths])
    trace = simulate_contiguous([SimRequest(tuple(p), o) for p, (_, o) in zip(prompts, lengths)], num_slots=100,
                                max_model_len=32, cost_model=STEP, max_num_seqs=4, max_num_batched_tokens=10**6,
                                batching="static", reserve=reserve)
    assert [r.report for r in trace.steps] == list(out.reports)
    assert [r.num_running for r in trace.steps] == list(out.num_running)
    assert trace.peak_num_seqs == out.peak_num_seqs


def test_continuous_contiguous_frees_at_once_and_never_preempts():
    requests = make_workload(60, request_rate=3.0, seed=4, output_len=Lengths("exponential", 40, high=200))
    static = simulate_contiguous(requests, num_slots=4096, max_model_len=800, cost_model=STEP, batching="static")
    continuous = simulate_contiguous(requests, num_slots=4096, max_model_len=800, cost_model=STEP)
    for trace in (static, continuous):
        assert metrics.num_output_tokens(trace) == sum(r.output_len for r in requests)
        for record in trace.steps:
            r = record.report
            held = getattr(r, "held_after_finish", 0)
            assert r.reserved == r.used + held + r.reservation_waste + r.internal_fragmentation
            assert len(record.reservations) <= 4096 // 800
    assert all(getattr(r.report, "held_after_finish", 0) == 0 for r in continuous.steps)
    assert metrics.makespan(continuous) < metrics.makespan(static)
    assert metrics.median(metrics.latencies(continuous).ttft_s) < metrics.median(metrics.latencies(static).ttft_s)


# -- the cost model ------------------------------------------------------------------------------------------


def test_step_features():
    steps = (ScheduledRequest("a", 0, 10), ScheduledRequest("b", 7, 1), ScheduledRequest("c", 99, 1))
    assert step_features(steps, 3) == (1.0, 10, 2, 10 + 8 + 100, 3)
    assert step_features(()) == (0.0, 0, 0, 0, 0)
    model = StepCostModel(0.1, 0.01, 0.02, 0.001, 0.5)
    assert model.step_seconds(steps, 3) == pytest.approx(0.1 + 0.1 + 0.04 + 0.118 + 1.5)
    with pytest.raises(ValueError, match=">= 0"):
        StepCostModel(-1, 0, 0, 0)


def test_fit_recovers_a_known_model_from_noisy_steps():
    truth = StepCostModel(0.05, 0.002, 0.004, 3e-6)
    rng = random.Random(0)
    trace = simulate(make_workload(80, request_rate=2.0, seed=1, prompt_len=Lengths("uniform", low=8, high=600)),
                     cost_model=STEP, num_kv_blocks=400, block_size=16, preemption_mode="recompute",
                     enable_chunked_prefill=True, max_num_batched_tokens=256)
    features = tuple(step_features(r.scheduled) for r in trace)
    durations = tuple(tuple(truth.seconds(f) * rng.uniform(0.95, 1.05) for f in features) for _ in range(3))
    times = cost_fit.StepTimes("synthetic", features, durations)
    fitted = cost_fit.fit([times])
    for got, want in zip(fitted.coefficients[:4], truth.coefficients[:4]):
        assert got == pytest.approx(want, rel=0.15)
    error = cost_fit.step_error(fitted, times)
    assert abs(error.total_error) < 0.03 and error.median_abs_step_error < 0.05


def test_nnls_keeps_coefficients_non_negative():
    rows = [(1, x, 0) for x in range(10)]
    targets = [5 - 0.1 * x for x in range(10)]  # a negative slope is not allowed: it is dropped
    solution = cost_fit.nnls(rows, targets, [1] * 10)
    assert solution[1] == 0 and solution[0] == pytest.approx(statistics.mean(targets))


def test_the_shipped_calibration_loads_and_round_trips(tmp_path):
    calibration = load_calibration()
    assert all(c >= 0 for c in calibration.step_cost.coefficients) and calibration.step_cost.overhead_s > 0
    assert calibration.preemption_cost_model(32).bytes_per_block == 32 * calibration.kv_bytes_per_token
    calibration.save(tmp_path / "c.json")
    assert load_calibration(tmp_path / "c.json") == calibration
    assert Calibration.from_dict(calibration.to_dict()) == calibration


def test_calibration_measures_the_engine_and_fits(tmp_path):
    """The whole calibration on a tiny model and tiny workloads (the numbers mean nothing; the plumbing does)."""
    from tests.helpers import tiny_model

    model = tiny_model()
    requests = [SimRequest(tuple(range(1, 1 + p)), o, a) for p, o, a in [(12, 5, 0), (30, 3, 0), (5, 8, 2)]]
    times, engine = cost_fit.measure_steps(model, None, "tiny", requests, repeats=2, num_kv_blocks=64,
                                            max_model_len=64)
    assert len(times.durations) == 2 and len(times.features) == len(engine.trace)
    assert cost_fit.noise(times)["repeats"] == 2
    fitted = cost_fit.fit([times])
    assert math.isfinite(cost_fit.step_error(fitted, times).total_error)


# -- the playground's experiment ------------------------------------------------------------------------------


def test_run_compares_paged_and_contiguous_on_the_same_workload():
    comparison = run(Settings(num_requests=40, request_rate=4.0, kv_slots=4096))
    paged, contiguous = comparison.paged, comparison.contiguous
    assert metrics.num_output_tokens(paged) == metrics.num_output_tokens(contiguous) == sum(
        r.output_len for r in comparison.requests)
    assert metrics.kv_slots(paged) == metrics.kv_slots(contiguous) == 4096
    used = {name: metrics.time_average(t, metrics.kv_breakdown(t)["used"]) for name, t in
            (("paged", paged), ("contiguous", contiguous))}
    assert used["paged"] > used["contiguous"]
    assert run(Settings(num_requests=40, request_rate=4.0, kv_slots=4096)) == comparison  # pure


def test_the_readme_states_the_shipped_calibrations_error():
    """The README's statement of the cost model's error is `error_summary` of the shipped calibration, which
    is a real measurement (not the placeholder), with held-out workloads and real-time serving errors."""
    from pathlib import Path

    from pagedlab.bench.calibration_run import error_summary

    calibration = load_calibration()
    assert not calibration.machine.get("placeholder"), "ship a calibration from `pagedlab bench --workload calibrate`"
    assert any(not e["fitted"] for e in calibration.error["steps"].values()) and calibration.error["serving"]["real"]
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    start = readme.index("<!-- calibration: error_summary(load_calibration()) -->\n")
    stated = readme[readme.index("\n", start) + 1 : readme.index("\n<!-- /calibration -->")]
    assert stated == error_summary(calibration), "README.md: paste error_summary(load_calibration()) in again"


def test_the_pressure_validation_workloads_preempt_at_full_scale():
    """What `pagedlab bench --workload calibrate` validates swapping and recomputing on does preempt (simulated:
    the simulator is the engine's scheduler)."""
    for name, mode in (("pressure-swap", "num_swapped_out_blocks"), ("pressure-recompute", "num_preemptions")):
        requests, config = cost_fit.validation_workloads(100, 1.0)[name]
        max_model_len = max(r.num_prompt_tokens + r.output_len for r in requests)
        trace = simulate(requests, cost_model=STEP, max_model_len=max_model_len, **config)
        assert getattr(trace.stats, mode) > 0, name
