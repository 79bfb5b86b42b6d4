"""The step-level engine: add requests, call `step()`, read outputs; abort at any time.

`LLMEngine` is the engine core (`pagedlab.core.engine_core`: the scheduler, the KV cache manager and the trace,
stepping the worker) plus the frontend: input processing, the output processor (text, stop strings, logprobs,
output kinds) and beam search. A step flows one way: the core schedules, runs the worker and updates; the
frontend turns the result into outputs; the stop strings it found, the one edge back, finish their sequences
in the core, which records the step.

# Explained in chapters/09_the_whole_engine.ipynb
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from pagedlab.beam_search import BeamGroup, BeamSearch, BeamSearchParams
from pagedlab.config import EngineConfig
from pagedlab.core.engine_core import EngineCore
from pagedlab.inputs import InputProcessor, PromptType
from pagedlab.models import eos_token_ids, load_model
from pagedlab.output_processor import OutputProcessor, RequestState
from pagedlab.outputs import EngineStats, RequestOutput
from pagedlab.sampling_params import SamplingParams
from pagedlab.spec_decode.proposer import make_proposer
from pagedlab.worker.worker import Worker

logger = logging.getLogger("pagedlab")


class LLMEngine:
    """Continuous batching over a paged KV cache, one `step()` at a time."""

    def __init__(self, model, tokenizer, config: EngineConfig, worker=None) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.worker = worker if worker is not None else Worker(model, config)  # or an executor of N ranks
        info = self.worker.info
        proposer = make_proposer(config, model, info.num_blocks, info.attention_backend)
        self.beam_search = BeamSearch()
        self.engine_core = EngineCore(config, self.worker, self.beam_search, proposer)
        self.config = config = self.engine_core.config  # max_model_len resolved against the model and the cache
        self.max_model_len = config.max_model_len
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        vocab_size = model.get_input_embeddings().num_embeddings
        self.inputs = InputProcessor(tokenizer, vocab_size, config, info.num_blocks, self.eos_token_ids)
        self.output_processor = OutputProcessor(tokenizer)

    @classmethod
    def from_pretrained(cls, model=None, tokenizer=None, *, dtype="auto", device="auto", **config) -> LLMEngine:
        """Load `model` (the embedded default, a path or Hub id, or a model object) and build an engine."""
        engine_config = EngineConfig(**config)
        if engine_config.world_size > 1:  # the weights live in P x T ranks (pagedlab.worker.executor)
            from pagedlab.worker.executor import launch

            model, tokenizer, worker = launch(model, tokenizer, dtype, device, engine_config)
            return cls(model, tokenizer, engine_config, worker)
        model, tokenizer = load_model(model, tokenizer, dtype, device)
        return cls(model, tokenizer, engine_config)

    # the core's parts, for the chapters and tests
    scheduler = property(lambda self: self.engine_core.scheduler)
    kv_cache_manager = property(lambda self: self.engine_core.kv_cache_manager)
    swap_space = property(lambda self: self.engine_core.swap_space)
    trace = property(lambda self: self.engine_core.trace)
    proposer = property(lambda self: self.engine_core.proposer)
    num_steps = property(lambda self: self.engine_core.num_steps)
    # the device side
    model_runner = property(lambda self: self.worker.model_runner)
    cost_model = property(lambda self: self.worker.info.cost_model)
    attention_backend = property(lambda self: self.worker.info.attention_backend)

    # -- requests -------------------------------------------------------------------------------------------

    def add_request(self, request_id: str | None, prompt: PromptType,
                    sampling_params: SamplingParams | None = None) -> str:
        """Queue a request. Bad input raises a ValueError (or TypeError) before anything changes. Returns its id."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        request_id, request, text = self._add(request_id, prompt, params)
        state = RequestState(request_id, text, request.prompt_token_ids, params, request.arrival_index)
        self.output_processor.add_request(state, request.request_id)
        return request_id

    def add_beam_request(self, request_id: str | None, prompt: PromptType, params: BeamSearchParams) -> str:
        """Queue a beam-search request (see `pagedlab.beam_search`). Its output comes when it finishes."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        request_id, root, text = self._add(request_id, prompt, params)
        self.beam_search.add(BeamGroup(
            request_id, params, self.eos_token_ids, min(params.max_tokens, root.max_tokens), {root.request_id: 0.0},
            {root.request_id: ()}, prompt=text, prompt_token_ids=root.prompt_token_ids,
        ))
        return request_id

    def _add(self, request_id, prompt, params):
        """Check the id and the prompt, then queue the request's first sequence in the core."""
        in_frontend = (*self.output_processor.requests, *self.beam_search.groups)
        if request_id is None:
            request_id = self.engine_core.new_request_id(taken=in_frontend)
        elif not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string (or None for a generated one), got {request_id!r}")
        elif request_id in in_frontend:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        processed = self.inputs.process(prompt, params)
        request = self.engine_core.add_request(
            request_id, processed.token_ids, params, self.eos_token_ids, processed.cache_salt
        )
        return request_id, request, processed.text

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort requests (all their samples or beams) wherever they are and free their blocks at once.

        Unknown or already finished ids are logged and skipped."""
        many = isinstance(request_id, Iterable) and not isinstance(request_id, str)
        ids = list(request_id) if many else [request_id]
        if not all(isinstance(i, str) for i in ids):
            raise TypeError(f"request_id must be a string or an iterable of strings, got {request_id!r}")
        for group_id in ids:
            known = self.output_processor.abort(group_id) | (self.beam_search.remove(group_id) is not None)
            if not known:
                logger.warning("abort_request: no unfinished request has id %r; nothing to abort", group_id)
                continue
            self.engine_core.abort_requests([group_id])

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks. Refused (False, with a warning) while any request holds blocks."""
        if self.kv_cache_manager.reset_prefix_cache():
            return True
        logger.warning("reset_prefix_cache refused: %d blocks are in use", self.kv_cache_manager.pool.num_used_blocks)
        return False

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.requests) + len(self.beam_search.groups)

    # -- one step -------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and return the outputs of the requests that changed.

        A request whose processing raises (its sampling, its stop strings), or that can never fit, finishes with
        finish_reason "error" and the message; the others go on."""
        start = time.perf_counter()
        # 1. The core: schedule, run the worker (and the beam step), update the scheduler.
        output = self.engine_core.step()
        # 2. The frontend: text, stop strings, logprobs and output kinds; beam searches' results.
        outputs, stopped, failed = self.output_processor.process(output)
        outputs += self.beam_search.process(output.update, self._decode)
        # 3. Back to the core, once: finish what a stop string ended or what failed here; record the step.
        self.engine_core.finish_step(output, stopped, failed, time.perf_counter() - start)
        return outputs

    def _decode(self, token_ids) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True) if self.tokenizer is not None else ""

    # -- reporting ------------------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        return self.engine_core.stats()

    def check_invariants(self) -> None:
        self.engine_core.check_invariants()

    def shutdown(self) -> None:
        """Stop the worker processes of a tensor-parallel engine (also done when it is garbage-collected)."""
        self.worker.shutdown()
