"""The step-level engine: add requests, call `step()`, read outputs; abort at any time.

A step flows one way: the scheduler decides who runs and where their KV goes; the worker moves blocks, runs the
model once and samples; beam search picks the beams' continuations; the scheduler appends the tokens, forks and
prunes, and finishes what stopped; the output processor turns tokens into text and outputs; the trace records
the step. The engine only wires them together.

# Explained in chapters/09_the_whole_engine.ipynb
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from pagedlab.beam_search import BeamGroup, BeamSearch, BeamSearchParams, beam_output
from pagedlab.config import EngineConfig
from pagedlab.core.kv_cache_manager import KVCacheManager
from pagedlab.core.request import Request, RequestStatus
from pagedlab.core.scheduler import Scheduler
from pagedlab.core.speculation import draft_requests
from pagedlab.core.swap_space import SwapSpace
from pagedlab.core.trace import StepRecord, Trace
from pagedlab.inputs import InputProcessor, PromptType
from pagedlab.models import eos_token_ids, load_model
from pagedlab.output_processor import OutputProcessor, RequestState
from pagedlab.outputs import CompletionOutput, EngineStats, RequestOutput
from pagedlab.sampling_params import SamplingParams
from pagedlab.spec_decode.proposer import make_proposer
from pagedlab.worker.worker import Worker

logger = logging.getLogger("pagedlab")
BEAM_SAMPLING = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)  # beams never stop on their own


class LLMEngine:
    """Continuous batching over a paged KV cache, one `step()` at a time."""

    def __init__(self, model, tokenizer, config: EngineConfig, worker=None) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.worker = worker if worker is not None else Worker(model, config)  # or an executor of N ranks
        self.config = config = self.worker.config  # max_model_len resolved against the model and the cache
        self.max_model_len = config.max_model_len
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        self.kv_cache_manager = KVCacheManager(self.worker.num_blocks, config.block_size, config.enable_prefix_caching)
        self.swap_space = None
        if self.worker.cpu_kv_cache is not None:
            self.swap_space = SwapSpace(self.kv_cache_manager, self.worker.num_cpu_blocks)
        self.scheduler = Scheduler(config, self.kv_cache_manager, self.swap_space, self.worker.cost_model)
        self.proposer = make_proposer(config, model, self.worker.num_blocks, self.worker.attention_backend)
        vocab_size = model.get_input_embeddings().num_embeddings
        self.inputs = InputProcessor(tokenizer, vocab_size, config, self.worker.num_blocks)
        self.output_processor = OutputProcessor(tokenizer)
        self.beam_search = BeamSearch()
        self.trace = Trace(self.worker.num_blocks, config.block_size, self.worker.num_cpu_blocks, config.max_trace_steps)
        self._num_arrivals = 0
        self._totals = dict(peak_used_blocks=0, num_computed_tokens=0, num_generated_tokens=0, num_finished=0)

    @classmethod
    def from_pretrained(cls, model=None, tokenizer=None, *, dtype="auto", device="auto", **config) -> LLMEngine:
        """Load `model` (the embedded default, a path or Hub id, or a model object) and build an engine."""
        engine_config = EngineConfig(**config)
        if engine_config.tensor_parallel_size > 1:  # the weights live in N ranks (pagedlab.worker.executor)
            from pagedlab.worker.executor import launch

            model, tokenizer, worker = launch(model, tokenizer, dtype, device, engine_config)
            return cls(model, tokenizer, engine_config, worker)
        model, tokenizer = load_model(model, tokenizer, dtype, device)
        return cls(model, tokenizer, engine_config)

    # the device side, for the chapters and tests
    model_runner = property(lambda self: self.worker.model_runner)
    cost_model = property(lambda self: self.worker.cost_model)
    attention_backend = property(lambda self: self.worker.attention_backend)

    # -- requests -------------------------------------------------------------------------------------------

    def add_request(self, request_id: str | None, prompt: PromptType, sampling_params: SamplingParams | None = None) -> str:
        """Queue a request. Bad input raises a ValueError before anything changes. Returns the request id."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        request_id, request, text = self._new_request(request_id, prompt, params)
        self.scheduler.add_request(request)
        state = RequestState(request_id, text, request.prompt_token_ids, params, request.arrival_index)
        self.output_processor.add_request(state, request.request_id)
        return request_id

    def add_beam_request(self, request_id: str | None, prompt: PromptType, params: BeamSearchParams) -> str:
        """Queue a beam-search request (see `pagedlab.beam_search`). Its output comes when it finishes."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        request_id, root, text = self._new_request(request_id, prompt, params)
        self.scheduler.add_request(root)
        self.beam_search.add(BeamGroup(
            request_id, params, self.eos_token_ids, min(params.max_tokens, root.max_tokens), {root.request_id: 0.0},
            {root.request_id: ()}, prompt=text, prompt_token_ids=root.prompt_token_ids,
        ))
        return request_id

    def _new_request(self, request_id, prompt, params) -> tuple[str, Request, str | None]:
        """The core request of a new user request (its first sequence), after every check; and the prompt text."""
        request_id = str(self._num_arrivals if request_id is None else request_id)
        if request_id in self.scheduler.groups or request_id in self.output_processor.requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        processed = self.inputs.process(prompt, params)
        room = self.max_model_len - len(processed.token_ids)
        if isinstance(params, BeamSearchParams):  # the beam step decides when beams end
            sampling, max_tokens, beam_width = BEAM_SAMPLING, room, params.beam_width
        else:
            sampling, beam_width = params, 0
            max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        request = Request(
            self.scheduler.unique_id(request_id), processed.token_ids, sampling, self._num_arrivals, max_tokens,
            self.eos_token_ids, processed.cache_salt, group_id=request_id, beam_width=beam_width,
        )
        self._num_arrivals += 1
        return request_id, request, processed.text

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort requests (all their samples or beams) wherever they are and free their blocks at once.

        Unknown or already finished ids are logged and skipped."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for group_id in ids:
            known = self.output_processor.abort(group_id) | (self.beam_search.remove(group_id) is not None)
            if not known:
                logger.warning("abort_request: no unfinished request has id %r; nothing to abort", group_id)
                continue
            finished, _ = self.scheduler.finish_groups([group_id], RequestStatus.FINISHED_ABORTED)
            self.worker.forget(r.request_id for r in finished)
            self._totals["num_finished"] += 1

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks. Refused (False, with a warning) while any request holds blocks."""
        if self.kv_cache_manager.reset_prefix_cache():
            return True
        logger.warning("reset_prefix_cache refused: %d blocks are in use", self.kv_cache_manager.pool.num_used_blocks)
        return False

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.requests) + len(self.beam_search.groups)

    # -- one step -------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and return the outputs of the requests that changed.

        An exception while processing one request (its sampling, its stop strings) finishes that request with
        finish_reason "error" and the message; the others go on."""
        start = time.perf_counter()
        # 1. Schedule: who runs, how many tokens each (and the drafts each verifies), which blocks they get or give up.
        scheduled = self.scheduler.schedule(self._propose())
        # 2. Run: the block moves, one forward pass over the whole batch, sampling.
        ran = self.worker.execute_model(scheduled)
        # 3. Beam search: every beam group whose beams all have their log-probabilities takes a beam step.
        beam_decisions = self.beam_search.step(ran.beam_logprobs, restarted=scheduled.restarted)
        # 4. Update: append the sampled tokens, fork and prune beams, finish what stopped.
        update = self.scheduler.update_from_output(scheduled, ran.sampled, beam_decisions, ran.errors, ran.num_accepted)
        # 5. Outputs: text, stop strings and logprobs; what a stop string ended or an error failed is finished.
        outputs, ended, freed = self._process_outputs(scheduled, update, ran.logprobs)
        # 6. Record the step.
        self._record(scheduled, update, outputs, ended, freed, time.perf_counter() - start)
        return outputs

    def _propose(self) -> dict[str, tuple[int, ...]] | None:
        """Speculative decoding: draft tokens for the running decodes (None when it is off)."""
        if self.proposer is None:
            return None
        k = self.config.speculative_config.num_speculative_tokens
        return self.proposer.propose(draft_requests(self.scheduler, k))

    def _process_outputs(self, scheduled, update, logprobs) -> tuple[list[RequestOutput], list[Request], list[int]]:
        for parent, child in scheduled.forked:
            self.output_processor.fork(parent, child)
        outputs, stopped, failed = self.output_processor.process(update, logprobs)
        outputs += [beam_output(group, self._decode) for group in self.beam_search.commit(update.beam_ids)]
        stops, freed = self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        errors, error_freed = self.scheduler.finish_groups(failed, RequestStatus.FINISHED_ERROR)
        failed = {**dict(scheduled.failed), **dict(update.failed), **failed}
        outputs = [self._error_output(group_id, why) for group_id, why in failed.items()] + outputs
        return [o for o in outputs if o is not None], stops + errors, freed + error_freed

    def _error_output(self, group_id: str, why: str) -> RequestOutput | None:
        logger.error("request %r failed: %s", group_id, why)
        group = self.beam_search.remove(group_id)
        if group is not None:
            error = CompletionOutput(0, "", [], "error", error=why)
            return RequestOutput(group_id, group.prompt, group.prompt_token_ids, [error], True)
        state = self.output_processor.requests.get(group_id)
        return self.output_processor.finish_with_error(state, why) if state is not None else None

    def _decode(self, token_ids) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True) if self.tokenizer is not None else ""

    def _record(self, scheduled, update, outputs, ended: list[Request], freed: list[int], duration: float) -> None:
        """Count the step, let the worker forget finished sequences, and append a `StepRecord` to the trace."""
        self.worker.forget([u.request_id for u in update.sequences if u.finish_reason] + [r.request_id for r in ended])
        totals = self._totals
        totals["peak_used_blocks"] = max(totals["peak_used_blocks"], self.kv_cache_manager.pool.num_used_blocks)
        totals["num_computed_tokens"] += scheduled.num_batched_tokens
        totals["num_generated_tokens"] += len(update.appended)
        totals["num_finished"] += sum(o.finished for o in outputs)
        if self.config.record_trace:
            ended_reasons = tuple((r.request_id, r.status.finish_reason) for r in ended)
            snapshot = self.scheduler.snapshot()
            self.trace.append(StepRecord.build(scheduled, update, snapshot, ended_reasons, tuple(freed), duration))

    # -- reporting ------------------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        pool, swap, counters = self.kv_cache_manager.pool, self.swap_space, self.scheduler.stats
        swapped_blocks = (swap.num_swapped_out_blocks, swap.num_swapped_in_blocks) if swap else (0, 0)
        return EngineStats(
            num_kv_blocks=pool.num_blocks,
            num_used_blocks=pool.num_used_blocks,
            block_size=self.config.block_size,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_steps=counters.num_steps,
            num_preemptions=counters.num_preemptions,
            prefix_cache_queries=self.kv_cache_manager.num_query_tokens,
            prefix_cache_hits=self.kv_cache_manager.num_hit_tokens,
            num_evicted_blocks=pool.num_evicted_blocks,
            num_preemptions_recompute=counters.num_preemptions_recompute,
            num_preemptions_swap=counters.num_preemptions_swap,
            num_preemptions_partial=counters.num_preemptions_partial,
            num_recomputed_tokens=counters.num_recomputed_tokens,
            num_swapped_out_blocks=swapped_blocks[0],
            num_swapped_in_blocks=swapped_blocks[1],
            num_swapped_bytes=sum(swapped_blocks) * self.worker.bytes_per_block,
            num_swapped=len(self.scheduler.swapped),
            num_cpu_blocks=swap.num_cpu_blocks if swap else 0,
            num_used_cpu_blocks=swap.pool.num_used_blocks if swap and swap.num_cpu_blocks else 0,
            kv_cache_dtype=self.config.kv_cache_dtype,
            kv_bytes_per_token=self.worker.bytes_per_block // self.config.block_size,
            spec_num_drafts=counters.spec_num_drafts,
            spec_num_draft_tokens=counters.spec_num_draft_tokens,
            spec_num_accepted_tokens=counters.spec_num_accepted_tokens,
            spec_num_draft_tokens_per_pos=tuple(counters.spec_num_draft_tokens_per_pos),
            spec_num_accepted_tokens_per_pos=tuple(counters.spec_num_accepted_tokens_per_pos),
            **self._totals,
        )

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()

    def shutdown(self) -> None:
        """Stop the worker processes of a tensor-parallel engine (also done when it is garbage-collected)."""
        self.worker.shutdown()

