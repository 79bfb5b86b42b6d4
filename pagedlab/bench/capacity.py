"""How many sequences one KV budget holds at once: paged blocks against contiguous reservations.

Both sides are bookkeeping, so this needs no model. The workload's requests (prompt length and a fixed
output length: EOS is ignored, so the tokens themselves change nothing) are driven step by step through

  - paged: pagedlab's own `Scheduler` and `KVCacheManager` (what the engine runs), with made-up tokens;
  - contiguous: `ContiguousAllocator` reserving max_model_len slots per request, in static batches (what
    `ContiguousEngine` does: a batch runs until its longest request ends),

on the same number of token slots. Reported: the most sequences running at once, and the mean over the
steps while requests were still waiting (when the budget, not the workload, is the limit).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Concurrency:
    peak: int  # sequences running at once, at most
    mean_saturated: float  # mean running sequences over the steps while requests waited
    num_steps: int
    num_preemptions: int = 0


def paged_concurrency(
    lengths: list[tuple[int, int]], num_slots: int, block_size: int = 16, max_num_seqs: int = 256,
    max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
) -> Concurrency:
    """Run (prompt_len, output_len) requests through the real scheduler on num_slots // block_size blocks."""
    from pagedlab.config import EngineConfig
    from pagedlab.core.kv_cache_manager import KVCacheManager
    from pagedlab.core.request import Request
    from pagedlab.core.sched_output import ModelRunnerOutput
    from pagedlab.core.scheduler import Scheduler
    from pagedlab.sampling_params import SamplingParams

    max_model_len = max_model_len or max(p + o for p, o in lengths)
    longest_prompt = max(p for p, _ in lengths)
    config = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len, preemption_mode="recompute",
                          max_num_batched_tokens=max(max_num_batched_tokens, longest_prompt))
    scheduler = Scheduler(config, KVCacheManager(num_slots // block_size, block_size))
    params = SamplingParams(temperature=0, ignore_eos=True)
    for i, (prompt_len, output_len) in enumerate(lengths):
        prompt = [1 + (i * 7 + j) % 1000 for j in range(prompt_len)]  # distinct, in case of prefix caching
        scheduler.add_request(Request(f"r{i}", prompt, params, i, output_len, frozenset()))
    running, steps = [], 0
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        if scheduler.waiting:
            running.append(len(scheduler.running))
        made_up = {s.request_id: (7,) for s in output.scheduled if s.is_sampling}
        scheduler.update_from_output(output, ModelRunnerOutput(made_up))
        steps += 1
        if steps > 100 * sum(p + o for p, o in lengths):
            raise RuntimeError("the paged simulation made no progress")
    peak = max(running, default=len(lengths))
    return Concurrency(peak, sum(running) / len(running) if running else float(peak), steps,
                       scheduler.stats.num_preemptions)


def contiguous_concurrency(
    lengths: list[tuple[int, int]], num_slots: int, max_model_len: int, max_batch_size: int = 256
) -> Concurrency:
    """Static batches over `ContiguousAllocator`, each request reserving max_model_len slots up front."""
    from pagedlab.contiguous import ContiguousAllocator

    allocator = ContiguousAllocator(num_slots)
    if max_model_len > num_slots:
        raise ValueError(f"one reservation of {max_model_len} slots does not fit in {num_slots}")
    waiting = deque(enumerate(lengths))
    running_per_step, saturated, steps, peak = [], [], 0, 0
    while waiting:
        batch = []
        while waiting and len(batch) < max_batch_size:
            if allocator.allocate(str(waiting[0][0]), max_model_len) is None:
                break
            batch.append(waiting.popleft())
        peak = max(peak, len(batch))
        outputs = [output_len for _, (_, output_len) in batch]
        for step in range(max(outputs)):  # step 0 prefills and samples the first token; then one token a step
            live = sum(1 for n in outputs if n > step)
            running_per_step.append(live)
            if waiting:
                saturated.append(live)
        steps += max(outputs)
        for index, _ in batch:
            allocator.free(str(index))
    return Concurrency(peak, sum(saturated) / len(saturated) if saturated else float(peak), steps)
