"""The engine's core, without a model: the KV cache manager, swap space, scheduler and trace, and one step.

A step is three calls, as vLLM V1's `EngineCore.step`: `Scheduler.schedule()` decides, the executor runs it
(`execute_model`: the real worker, or the simulator's made-up tokens), and `Scheduler.update_from_output` applies
the runner's output whole. Between the last two, beam searches take their beam step from the beams'
log-probabilities. The frontend that drives the core (`LLMEngine`: text, stop strings, outputs; or `SimEngine`:
a simulated clock) then closes the step with `finish_step`: the sequences its stop strings ended and the groups
whose processing failed are finished, and the step is counted and recorded in the trace.

    frontend                     EngineCore.step()                                     frontend
    add_request ->  schedule() -> execute_model() -> beam step -> update_from_output() -> outputs -> finish_step()

An executor that can run several batches at once (pipeline parallelism: `max_concurrent_batches` = P, and
`execute_model(..., non_block=True)` returns a future) gets a queue of them, as vLLM V1's batch queue: `step`
schedules and sends batches until P are in flight (or nothing more can be scheduled), then completes the oldest.
While stage 1 runs the newest batch, stage P runs the oldest, and no stage waits for the whole pipeline.

Pure Python: the executor and the beam search are injected, and the core imports no torch.

# Explained in chapters/09_the_whole_engine.ipynb
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pagedlab.config import EngineConfig
from pagedlab.core.executor import Executor
from pagedlab.core.kv_cache_manager import KVCacheManager
from pagedlab.core.preemption import PreemptionMode
from pagedlab.core.request import Request, RequestStatus
from pagedlab.core.sched_output import BeamDecision, ModelRunnerOutput, SchedulerOutput, UpdateOutput
from pagedlab.core.scheduler import Scheduler
from pagedlab.core.speculation import DraftRequest
from pagedlab.core.stats import CoreStats
from pagedlab.core.swap_space import SwapSpace
from pagedlab.core.trace import StepRecord, Trace
from pagedlab.outputs import EngineStats
from pagedlab.sampling_params import BEAM_SAMPLING, BeamSearchParams, SamplingParams


class BeamStepper(Protocol):
    """Beam search seen from the core: the beam steps of the groups whose beams all got their log-probabilities."""

    def step(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[BeamDecision]: ...


class Proposer(Protocol):
    """Speculative decoding's drafts for the running decodes (`pagedlab.spec_decode`)."""

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, tuple[int, ...]]: ...


@dataclass(frozen=True)
class EngineCoreOutput:
    """One step of the core: what was decided, what the executor computed, and what the scheduler made of it."""

    scheduler_output: SchedulerOutput
    runner_output: ModelRunnerOutput
    update: UpdateOutput


class EngineCore:
    """One scheduler over one KV cache manager (and swap space), stepping an injected executor."""

    def __init__(
        self, config: EngineConfig, executor: Executor, beam_search: BeamStepper | None = None,
        proposer: Proposer | None = None, trace: Trace | None = None,
    ) -> None:
        info = executor.info
        self.config = config = dataclasses.replace(config, max_model_len=info.max_model_len)
        self.executor, self.beam_search, self.proposer = executor, beam_search, proposer
        self.kv_cache_manager = KVCacheManager(info.num_blocks, config.block_size, config.enable_prefix_caching)
        self.swap_space = None
        if PreemptionMode(config.preemption_mode) != PreemptionMode.RECOMPUTE:
            self.swap_space = SwapSpace(self.kv_cache_manager, info.num_cpu_blocks)
        self.max_concurrent_batches = getattr(executor, "max_concurrent_batches", 1)
        self.scheduler = Scheduler(config, self.kv_cache_manager, self.swap_space, info.cost_model,
                                   self.max_concurrent_batches)
        self.batch_queue: deque = deque()  # (SchedulerOutput, its future), oldest first, when several fly at once
        if trace is None:
            trace = Trace(info.num_blocks, config.block_size, info.num_cpu_blocks, config.max_trace_steps)
        self.trace = trace
        self.num_arrivals = 0
        self._counters = CoreStats()

    # -- requests -------------------------------------------------------------------------------------------

    def new_request_id(self, taken: Iterable[str] = ()) -> str:
        """An id for a request added without one: the arrival count, or the next count that no request holds."""
        taken = set(taken)
        for n in itertools.count(self.num_arrivals):
            if not self.scheduler.has_group(str(n)) and str(n) not in taken:
                return str(n)
        raise AssertionError("unreachable")

    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams | BeamSearchParams,
        eos_token_ids: frozenset[int] = frozenset(), cache_salt: str | None = None,
    ) -> Request:
        """Queue a user request's first sequence (its prompt already checked) and return it. Its max_tokens is
        capped by the room under max_model_len; a beam search's beams run until its beam step ends them."""
        if self.scheduler.has_group(request_id):
            raise ValueError(f"request id {request_id!r} is already in the engine")
        room = self.config.max_model_len - len(prompt_token_ids)
        if isinstance(params, BeamSearchParams):
            sampling, max_tokens, beam_width = BEAM_SAMPLING, room, params.beam_width
        else:
            sampling, beam_width = params, 0
            max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        request = Request(
            self.scheduler.unique_id(request_id), list(prompt_token_ids), sampling, self.num_arrivals, max_tokens,
            eos_token_ids, cache_salt, group_id=request_id, beam_width=beam_width,
        )
        self.scheduler.add_request(request)
        self.num_arrivals += 1
        return request

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        """Finish every sequence of these user requests wherever they are; their blocks are free at once."""
        return self.scheduler.finish_groups(request_ids, RequestStatus.FINISHED_ABORTED)[0]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def num_steps(self) -> int:
        """Steps scheduled so far (the next step's number is one more)."""
        return self.scheduler.stats.num_steps

    # -- one step -------------------------------------------------------------------------------------------

    def step(self) -> EngineCoreOutput:
        """Schedule, execute, update. The frontend closes the step with `finish_step`."""
        if self.max_concurrent_batches > 1:
            return self._step_with_batch_queue()
        # 1. Schedule: who runs, how many tokens each (and the drafts each verifies), which blocks they get.
        scheduler_output = self.scheduler.schedule(self._propose())
        # 2. Execute: the block moves, one forward pass over the whole batch, sampling.
        runner_output = self.executor.execute_model(scheduler_output)
        return self._update(scheduler_output, runner_output)

    def _step_with_batch_queue(self) -> EngineCoreOutput:
        """Fill the queue of batches in flight, then complete the oldest: one step, as `step` without a queue."""
        while len(self.batch_queue) < self.max_concurrent_batches:
            scheduler_output = self.scheduler.schedule(self._propose())
            if scheduler_output is None:  # everything that could run is in flight
                break
            self.batch_queue.append((scheduler_output, self.executor.execute_model(scheduler_output, non_block=True)))
            if not scheduler_output.scheduled:  # it only preempted or failed: let it land before scheduling more
                break
        scheduler_output, future = self.batch_queue.popleft()
        return self._update(scheduler_output, future.result())

    def _update(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> EngineCoreOutput:
        # 3. Beam step: every beam group whose beams all have their log-probabilities picks its continuations.
        beam_decisions = self.beam_search.step(scheduler_output, runner_output) if self.beam_search else ()
        # 4. Update: append the new tokens, fork and prune beams, finish what stopped or failed.
        update = self.scheduler.update_from_output(scheduler_output, runner_output, beam_decisions)
        return EngineCoreOutput(scheduler_output, runner_output, update)

    def _propose(self) -> dict[str, tuple[int, ...]] | None:
        if self.proposer is None:
            return None
        k = self.config.speculative_config.num_speculative_tokens
        return self.proposer.propose(self.scheduler.draft_requests(k))

    def finish_step(
        self, output: EngineCoreOutput, stopped: Iterable[str] = (), failed: Iterable[str] = (),
        duration_s: float = 0.0,
    ) -> StepRecord | None:
        """Close the step: finish the sequences the frontend's stop strings ended and the groups whose output
        processing failed, count the step, and record it in the trace (None when the engine keeps no trace)."""
        stops, freed = self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        errors, error_freed = self.scheduler.finish_groups(failed, RequestStatus.FINISHED_ERROR)
        ended = tuple((r.request_id, r.status.finish_reason) for r in stops + errors)
        scheduler_output, update = output.scheduler_output, output.update
        counters = self._counters
        self._counters = dataclasses.replace(
            counters,
            peak_used_blocks=max(counters.peak_used_blocks, self.kv_cache_manager.pool.num_used_blocks),
            num_computed_tokens=counters.num_computed_tokens + scheduler_output.num_batched_tokens,
            num_generated_tokens=counters.num_generated_tokens + len(update.appended),
        )
        if not self.config.record_trace:
            return None
        record = StepRecord.build(
            scheduler_output, update, self.scheduler.snapshot(), ended, tuple(freed + error_freed), duration_s
        )
        self.trace.append(record)
        return record

    # -- reporting ------------------------------------------------------------------------------------------

    def stats(self, **device_values) -> EngineStats:
        """Each component's slice, combined; `device_values`: what only the device side knows."""
        slices = [self.kv_cache_manager.stats(), self.scheduler.queue_stats()]
        if self.swap_space is not None:
            slices.append(self.swap_space.stats())
        counters = dataclasses.replace(self._counters, num_finished=self.scheduler.num_finished_groups)
        bytes_per_block = self.executor.info.bytes_per_block
        swapped = self.swap_space.stats() if self.swap_space else None
        moved = swapped.num_swapped_out_blocks + swapped.num_swapped_in_blocks if swapped else 0
        return EngineStats.combine(
            *slices, counters, kv_cache_dtype=self.config.kv_cache_dtype,
            kv_bytes_per_token=bytes_per_block // self.config.block_size, num_swapped_bytes=moved * bytes_per_block,
            **device_values,
        )

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()
