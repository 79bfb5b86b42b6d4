"""What the scheduler and the block manager cost per step, with a model stub that computes nothing.

`scheduler_step_time` drives `Scheduler` + `KVCacheManager` alone (pure Python) at a steady state of
`num_seqs` decoding sequences: every step each one gets a made-up token; finished ones are replaced by new
arrivals so the batch stays full. `real_step_time` times the real engine's decode steps at the same batch,
so the report can state the scheduler's share of a step.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from pagedlab.bench import run_metrics
from pagedlab.core.block_table import cdiv


@dataclass(frozen=True)
class OverheadResult:
    num_seqs: int
    scheduler_ms: float  # median per step: schedule() + update_from_output(), blocks allocated and freed
    real_step_ms: float | None  # median decode step of the real engine at the same batch (None if not run)

    @property
    def share(self) -> float | None:
        return self.scheduler_ms / self.real_step_ms if self.real_step_ms else None


def scheduler_step_time(num_seqs: int, num_steps: int = 64, prompt_len: int = 128, output_len=(32, 256),
                        block_size: int = 16, seed: int = 0) -> float:
    """Median seconds per step of schedule() + update_from_output() over `num_steps` decode steps."""
    from pagedlab.config import EngineConfig
    from pagedlab.core.kv_cache_manager import KVCacheManager
    from pagedlab.core.request import Request
    from pagedlab.core.sched_output import ModelRunnerOutput
    from pagedlab.core.scheduler import Scheduler
    from pagedlab.sampling_params import SamplingParams

    rng = random.Random(seed)
    max_model_len = prompt_len + output_len[1]
    num_blocks = 2 * num_seqs * cdiv(max_model_len, block_size)  # ample: no preemption, the steady state
    kv = KVCacheManager(num_blocks, block_size)
    config = EngineConfig(max_num_seqs=num_seqs, max_num_batched_tokens=max(2048, num_seqs * prompt_len),
                          max_model_len=max_model_len, preemption_mode="recompute")
    scheduler = Scheduler(config, kv)
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    arrivals = 0

    def arrive() -> None:
        nonlocal arrivals
        prompt = [rng.randrange(1000) for _ in range(prompt_len)]
        scheduler.add_request(Request(f"r{arrivals}", prompt, params, arrivals, rng.randint(*output_len), frozenset()))
        arrivals += 1

    def step() -> float:
        start = time.perf_counter()
        output = scheduler.schedule()
        made_up = {s.request_id: (7,) for s in output.scheduled if s.is_sampling}
        update = scheduler.update_from_output(output, ModelRunnerOutput(made_up))
        elapsed = time.perf_counter() - start
        for _ in update.finished:
            arrive()
        return elapsed

    for _ in range(num_seqs):
        arrive()
    while scheduler.waiting:  # prefill everyone (untimed)
        step()
    times = [step() for _ in range(num_steps)]
    return run_metrics.median(times)


def real_step_time(model, tokenizer, num_seqs: int, prompt_len: int = 8, num_decode_steps: int = 4,
                   seed: int = 0) -> float:
    """Median seconds per decode step of the real engine with `num_seqs` short requests decoding together
    (short prompts keep the set-up cheap; a longer context would only make the real step longer)."""
    from pagedlab.bench.systems import engine_config
    from pagedlab.engine import LLMEngine
    from pagedlab.sampling_params import SamplingParams

    rng = random.Random(seed)
    vocab = model.get_input_embeddings().num_embeddings
    max_len = prompt_len + num_decode_steps + 2
    engine = LLMEngine(model, tokenizer, engine_config(
        max_num_seqs=num_seqs, max_num_batched_tokens=max(2048, prompt_len), max_model_len=max_len,
        num_kv_blocks=num_seqs * cdiv(max_len, 16) + 1, record_trace=False))
    params = SamplingParams(temperature=0, max_tokens=num_decode_steps + 2, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(str(i), [rng.randrange(vocab) for _ in range(prompt_len)], params)
    while engine.scheduler.waiting:  # prefill everyone (untimed)
        engine.step()
    engine.step()  # the first step after prefill may still straggle
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return run_metrics.median(times)


def measure(model, tokenizer, sizes=(256, 1024), real_sizes=(256,), num_steps: int = 64) -> list[OverheadResult]:
    """Scheduler time at each size; the real step time at the sizes in `real_sizes` (model may be None)."""
    results = []
    for n in sizes:
        sched = scheduler_step_time(n, num_steps)
        real = real_step_time(model, tokenizer, n) if model is not None and n in real_sizes else None
        results.append(OverheadResult(n, 1e3 * sched, 1e3 * real if real is not None else None))
    return results
