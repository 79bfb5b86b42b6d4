"""The step-level engine: add requests, call `step()`, read outputs; abort at any time.

Each step flows one way: the scheduler decides who runs, the block manager allocates, the model runner
computes and samples, the scheduler appends tokens and finishes requests, and the engine records a
`StepRecord` and returns outputs. The engine knows about tokenizers only to read prompts and stop strings.

# Explained in chapters/05_continuous_batching.ipynb
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass

from pagedlab.beam_search import BeamGroup, BeamSearchParams
from pagedlab.config import EngineConfig
from pagedlab.core.kv_cache_manager import KVCacheManager
from pagedlab.core.preemption import PreemptionMode
from pagedlab.core.request import Request, RequestStatus
from pagedlab.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, UpdateOutput
from pagedlab.core.swap_space import SwapSpace
from pagedlab.core.trace import BlockTableSnapshot, StepRecord, Trace
from pagedlab.models import eos_token_ids, load_model, resolve_device, resolve_dtype
from pagedlab.outputs import CompletionOutput, EngineStats, RequestOutput
from pagedlab.sampling_params import RequestOutputKind, SamplingParams
from pagedlab.worker.kv_cache import KVCacheSpec, num_blocks_for_budget
from pagedlab.worker.model_runner import ModelRunner, RunnerOutput, WorkItem
from pagedlab.worker.swap import CPUKVCache, measure_cost_model

logger = logging.getLogger("pagedlab")

PromptType = str | list[int] | dict


@dataclass
class _Group:
    """One user request: its sequences in sample order (one, or n once the samples have forked)."""

    request_id: str
    sequences: list[Request]

    @property
    def finished(self) -> bool:
        first = self.sequences[0]
        return all(s.is_finished for s in self.sequences) and not (first.needs_fork and not first.is_finished)


class LLMEngine:
    """Continuous batching over a paged KV cache, one `step()` at a time."""

    def __init__(self, model, tokenizer, config: EngineConfig) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        model_config = model.config
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.eos_token_ids = eos_token_ids(model, tokenizer)

        spec = KVCacheSpec.from_model_config(model_config, self.dtype)
        model_max_len = getattr(model_config, "max_position_embeddings", None) or 1 << 30
        if config.max_model_len is not None and config.max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's limit of {model_max_len} positions"
            )
        wanted_len = config.max_model_len or model_max_len
        num_blocks = num_blocks_for_budget(
            spec,
            config.block_size,
            self.device,
            num_kv_blocks=config.num_kv_blocks,
            kv_cache_memory=config.kv_cache_memory,
            gpu_memory_utilization=config.gpu_memory_utilization,
            max_useful_tokens=config.max_num_seqs * wanted_len,
        )
        capacity = num_blocks * config.block_size
        if config.max_model_len is not None and config.max_model_len > capacity:
            raise ValueError(
                f"max_model_len={config.max_model_len} can never fit: the KV cache holds {num_blocks} blocks "
                f"x {config.block_size} = {capacity} tokens; raise the KV budget or lower max_model_len"
            )
        self.max_model_len = min(wanted_len, capacity)
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB (%s, %s); max_model_len %d",
            num_blocks, config.block_size, capacity, num_blocks * spec.bytes_per_block(config.block_size) / 2**20,
            self.device, str(self.dtype).removeprefix("torch."), self.max_model_len,
        )  # fmt: skip

        self.kv_cache_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.attention_backend = _attention_backend(config.attention_backend, self.device)
        self.model_runner = ModelRunner(
            model, spec, num_blocks, config.block_size, config.seed, self.attention_backend
        )
        if self.device.type == "cuda" and self.attention_backend == "triton" and not config.enforce_eager:
            self.model_runner.capture_decode_graphs(config.max_num_seqs, self.max_model_len)
        self._bytes_per_block = spec.bytes_per_block(config.block_size)
        self.preemption_mode = PreemptionMode(config.preemption_mode)
        self.swap_space, self.cpu_kv_cache, self.cost_model = None, None, None
        num_cpu_blocks = 0
        if self.preemption_mode != PreemptionMode.RECOMPUTE:
            num_cpu_blocks = config.num_cpu_blocks
            if num_cpu_blocks is None:  # swap_space GiB, but never more blocks than the device pool has
                num_cpu_blocks = min(int(config.swap_space * 2**30) // self._bytes_per_block, num_blocks)
            self.swap_space = SwapSpace(self.kv_cache_manager, num_cpu_blocks)
            self.cpu_kv_cache = CPUKVCache(spec, max(num_cpu_blocks, 1), config.block_size, self.device)
            if self.preemption_mode == PreemptionMode.AUTO:
                self.cost_model = measure_cost_model(
                    model, self.model_runner.kv_cache, self.cpu_kv_cache, spec, config.block_size
                )
                logger.info("%s", self.cost_model.explain())
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
                preemption_mode=self.preemption_mode,
                enable_partial_preemption=config.enable_partial_preemption,
                force_preemption_rate=config.force_preemption_rate,
                seed=config.seed,
            ),
            self.kv_cache_manager,
            self.swap_space,
            self.cost_model,
        )
        self.trace = Trace(num_blocks, config.block_size, num_cpu_blocks)
        self._groups: dict[str, _Group] = {}  # unfinished user requests
        self._sequences: dict[str, Request] = {}  # their sequences, finished ones too, until the group ends
        self._beam_groups: dict[str, BeamGroup] = {}  # unfinished beam-search requests
        self._num_arrivals = 0
        self._peak_used_blocks = 0
        self._num_computed_tokens = 0
        self._num_generated_tokens = 0
        self._num_finished = 0
        self._num_idle_steps = 0  # consecutive steps that computed nothing (only preempted or swapped)

    @classmethod
    def from_pretrained(cls, model=None, tokenizer=None, *, dtype="auto", device="auto", **config) -> LLMEngine:
        """Load `model` (the embedded default, a path or Hub id, or a model object) and build an engine."""
        engine_config = EngineConfig(**config)
        device = resolve_device(device)
        model, tokenizer = load_model(model, tokenizer, resolve_dtype(dtype, device), device)
        return cls(model, tokenizer, engine_config)

    # -- requests -----------------------------------------------------------------------------------------

    def add_request(
        self, request_id: str | None, prompt: PromptType, sampling_params: SamplingParams | None = None
    ) -> str:
        """Queue a request. Bad input raises a ValueError before anything changes. Returns the request id."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        text, token_ids = self._tokenize(prompt)
        cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        self._check_prompt(token_ids)
        if request_id is None:
            request_id = str(self._num_arrivals)
        request_id = str(request_id)
        if request_id in self._groups or request_id in self._sequences or request_id in self._beam_groups:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        room = self.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        request = Request(
            request_id, token_ids, params, self._num_arrivals, max_tokens, self.eos_token_ids, text, cache_salt
        )
        self._num_arrivals += 1
        self.scheduler.add_request(request)
        self._groups[request_id] = _Group(request_id, [request])
        self._sequences[request_id] = request
        return request_id

    def add_beam_request(self, request_id: str | None, prompt: PromptType, params: BeamSearchParams) -> str:
        """Queue a beam-search request (see `pagedlab.beam_search`). Its output comes when it finishes."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        # the beam step decides when beams end; the sequences themselves never stop on their own
        request_id = self.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
        root = self._groups.pop(request_id).sequences[0]
        room = self.max_model_len - root.num_prompt_tokens
        root.is_beam = True
        root.group_size = params.beam_width
        self._beam_groups[request_id] = BeamGroup(
            request_id, params, self.eos_token_ids, min(params.max_tokens, room), {request_id: 0.0}, {request_id: ()},
            prompt=root.prompt, prompt_token_ids=root.prompt_token_ids,
        )  # fmt: skip
        return request_id

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass {'prompt_token_ids': [...]} instead of text")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise TypeError(f"a prompt is a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty: it needs at least one token")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if len(token_ids) + 1 > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens; with one generated token that exceeds "
                f"max_model_len={self.max_model_len}"
            )
        num_blocks = self.kv_cache_manager.num_blocks_for(len(token_ids) + 1)
        if num_blocks > self.kv_cache_manager.num_blocks:
            raise ValueError(
                f"the prompt needs {num_blocks} KV blocks but the whole cache has {self.kv_cache_manager.num_blocks}"
            )
        if len(token_ids) > self.config.max_num_batched_tokens and not self.config.enable_chunked_prefill:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, more than max_num_batched_tokens="
                f"{self.config.max_num_batched_tokens}; raise it or enable chunked prefill"
            )

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort requests (all their samples) wherever they are and free their blocks at once.

        Unknown or already finished ids are logged and skipped."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            group = self._groups.pop(rid, None)
            beam_group = self._beam_groups.pop(rid, None)
            if group is None and beam_group is None:
                logger.warning("abort_request: no unfinished request has id %r; nothing to abort", rid)
                continue
            sequence_ids = [s.request_id for s in group.sequences] if group is not None else list(beam_group.beams)
            for sequence_id in sequence_ids:
                if self.scheduler.finish_request(sequence_id, RequestStatus.FINISHED_ABORTED):
                    self.model_runner.forget(sequence_id)
                del self._sequences[sequence_id]
            self._num_finished += 1

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks. Refused (False, with a warning) while any request holds blocks."""
        if self.kv_cache_manager.reset_prefix_cache():
            return True
        logger.warning("reset_prefix_cache refused: %d blocks are in use", self.kv_cache_manager.pool.num_used_blocks)
        return False

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self._groups) + len(self._beam_groups)

    # -- one step -----------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and return the outputs of the requests that changed.

        An exception while processing one request (sampling, stop strings) finishes that request with
        finish_reason "error" and its message; the others go on."""
        output = self.scheduler.schedule()
        self._num_idle_steps = self._num_idle_steps + 1 if output.is_empty else 0
        stuck = output.is_empty and not (output.preempted or output.swapped_in)
        if self.scheduler.has_unfinished_requests() and (stuck or self._num_idle_steps > 1000):
            raise RuntimeError(
                f"the scheduler made no progress: waiting {list(self.scheduler.waiting)}, running "
                f"{self.scheduler.running}, swapped {self.scheduler.swapped}"
            )
        self._move_blocks(output)
        forks = {
            s.request_id: self._fork_samples(self._sequences[s.request_id])
            for s in output.scheduled
            if s.samples and self._sequences[s.request_id].needs_fork
        }
        runner_output = RunnerOutput({}, {})
        failed: list[RequestOutput] = []
        if not output.is_empty:
            kv = self.kv_cache_manager
            items = [
                WorkItem(self._sequences[s.request_id], s, kv.block_table(s.request_id), tuple(forks.get(s.request_id, ())))
                for s in output.scheduled
            ]  # fmt: skip
            runner_output, failed = self._execute(items)
            for failed_output in failed:
                forks.pop(failed_output.request_id, None)
        sampled, beam_logprobs = runner_output.sampled, runner_output.beam_logprobs
        self._peak_used_blocks = max(self._peak_used_blocks, self.kv_cache_manager.pool.num_used_blocks)
        self._num_computed_tokens += output.num_batched_tokens
        tokens = {rid: token for rid, (token, _) in sampled.items()}
        update = self.scheduler.update_from_output(output, tokens, forks)
        for parent_id, children in forks.items():
            group = self._groups[parent_id]
            group.sequences.extend(children)
            self._sequences.update((child.request_id, child) for child in children)
        finished = list(update.finished)
        for rid, _ in update.appended:
            sequence = self._sequences.get(rid)
            if sequence is None:
                continue  # its group failed this step
            logprobs = sampled[rid][1]
            if logprobs is not None:
                sequence.output_logprobs.append(logprobs)
            if sequence.sampling_params.stop and not sequence.is_finished:
                try:
                    hit = self._hit_stop_string(sequence)
                except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the others
                    failed.append(self._fail(self._group_id(rid), exc))
                    continue
                if hit:
                    finished.append(self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED))
        self._num_generated_tokens += len(update.appended)
        for sequence in finished:
            self.model_runner.forget(sequence.request_id)
        beam_outputs, pruned, beam_forks = self._beam_steps(beam_logprobs)
        if self.config.record_trace:
            self._record(output, update, finished + pruned, beam_forks)
        changed = {rid for rid, _ in update.appended} | {s.request_id for s in finished}
        return failed + self._outputs({rid for rid in changed if rid in self._sequences}) + beam_outputs

    def _move_blocks(self, output: SchedulerOutput) -> None:
        """Apply the step's block moves to the KV tensors, in an order that never reads overwritten data:
        swap-outs first (their blocks may be handed out again this step), then clear newly allocated blocks,
        swap-ins, and copy-on-write copies (whose source may have just been swapped in)."""
        if output.swapped_out:
            self.cpu_kv_cache.swap_out(self.model_runner.kv_cache, [p for _, pairs in output.swapped_out for p in pairs])
        self.model_runner.zero_blocks([b for _, blocks in output.allocated for b in blocks])
        if output.swapped_in:
            self.cpu_kv_cache.swap_in(self.model_runner.kv_cache, [p for _, pairs in output.swapped_in for p in pairs])
        self.model_runner.copy_blocks([(source, copy) for _, source, copy in output.copies])

    def _execute(self, items: list[WorkItem]) -> tuple[RunnerOutput, list[RequestOutput]]:
        """Run the step's batch. If it raises, run each request alone (rewriting the same KV is harmless) so
        that only the requests whose processing fails are finished with the error."""
        try:
            return self.model_runner.execute(items), []
        except Exception as exc:  # noqa: BLE001
            if len(items) == 1:
                return RunnerOutput({}, {}), [self._fail(self._group_id(items[0].request.request_id), exc)]
        merged, failed = RunnerOutput({}, {}), []
        for item in items:
            if not self._is_alive(item.request.request_id):
                continue  # failed already, with a sibling
            try:
                one = self.model_runner.execute([item])
            except Exception as exc:  # noqa: BLE001
                failed.append(self._fail(self._group_id(item.request.request_id), exc))
                continue
            merged.sampled.update(one.sampled)
            merged.beam_logprobs.update(one.beam_logprobs)
        alive = RunnerOutput(
            {rid: v for rid, v in merged.sampled.items() if self._is_alive(rid)},
            {rid: v for rid, v in merged.beam_logprobs.items() if self._is_alive(rid)},
        )
        return alive, failed

    def _is_alive(self, sequence_id: str) -> bool:
        """Whether the sequence's request is still unfinished (a sibling's failure finishes it too)."""
        group_id = self._group_id(sequence_id)
        return group_id in self._groups or group_id in self._beam_groups

    def _fail(self, group_id: str, exc: Exception) -> RequestOutput:
        """Finish every sequence of a request with finish_reason "error"; its blocks are freed at once."""
        message = f"{type(exc).__name__}: {exc}"
        logger.error("request %r failed: %s", group_id, message)
        group = self._groups.pop(group_id, None)
        beam_group = self._beam_groups.pop(group_id, None)
        sequences = group.sequences if group is not None else [self._sequences[s] for s in beam_group.beams]
        for sequence in sequences:
            if not sequence.is_finished:
                self.scheduler.finish_request(sequence.request_id, RequestStatus.FINISHED_ERROR)
            sequence.error = message
            self.model_runner.forget(sequence.request_id)
            self._sequences.pop(sequence.request_id, None)
        self._num_finished += 1
        first = sequences[0]
        completions = [
            CompletionOutput(s.sample_index, "", list(s.output_token_ids), "error", error=message) for s in sequences
        ]
        if beam_group is not None:
            completions = [CompletionOutput(0, "", [], "error", error=message)]
        return RequestOutput(group_id, first.prompt, first.prompt_token_ids, completions, True)

    def _beam_steps(self, beam_logprobs: dict) -> tuple[list[RequestOutput], list[Request], list[tuple[str, str]]]:
        """Give each beam group its new log-probabilities; run a beam step for every group that has them all.
        Returns the finished groups' outputs, the pruned sequences and the (parent, child) forks."""
        ready = []
        for sequence_id, logprobs in beam_logprobs.items():
            group = self._beam_groups[self._group_id(sequence_id)]
            group.ready[sequence_id] = logprobs
            if group.is_ready and group not in ready:
                ready.append(group)
        outputs, pruned, forks = [], [], []
        for group in ready:
            pruned += self._beam_step(group, forks)
            if not group.beams:
                outputs.append(self._beam_output(group))
        return outputs, pruned, forks

    def _beam_step(self, group: BeamGroup, forks: list[tuple[str, str]]) -> list[Request]:
        """Apply a beam step: fork parents chosen more than once, extend the others in place, free the rest.
        Returns the sequences it freed; appends the forks it made to `forks`."""
        plan = group.step()
        beams, generated, extended = {}, {}, []
        for continuation in plan.continuations:
            parent = self._sequences[continuation.parent]
            if continuation.parent not in beams:
                sequence = parent  # the first continuation of a beam reuses its sequence; appended below
                extended.append((parent, continuation.token_id))
            else:
                group.num_forks += 1
                sequence = parent.fork(f"{group.request_id}:b{group.num_forks}", group.num_forks, parent.sampling_params)
                self.scheduler.add_fork(parent, sequence)  # before the parent grows: they share its blocks
                forks.append((parent.request_id, sequence.request_id))
                sequence.append_token(continuation.token_id)
                self._sequences[sequence.request_id] = sequence
            beams[sequence.request_id] = continuation.cum_logprob
            generated[sequence.request_id] = group.generated[continuation.parent] + (continuation.token_id,)
        for parent, token_id in extended:
            parent.append_token(token_id)
        freed = []
        for sequence_id in plan.pruned:
            freed.append(self.scheduler.finish_request(sequence_id, RequestStatus.FINISHED_STOPPED))
            del self._sequences[sequence_id]
        group.beams, group.generated = beams, generated  # in rank order, best first
        self._num_generated_tokens += len(plan.continuations)
        return freed

    def _beam_output(self, group: BeamGroup) -> RequestOutput:
        del self._beam_groups[group.request_id]
        self._num_finished += 1
        completions = [
            CompletionOutput(
                i, self._decode_ids(h.token_ids, True), list(h.token_ids), h.finish_reason,
                cumulative_logprob=h.cum_logprob,
            )
            for i, h in enumerate(group.finished)
        ]  # fmt: skip
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions, True)

    def _fork_samples(self, first: Request) -> list[Request]:
        """The other n - 1 samples of a request; sample i draws with seed + i when a seed was given."""
        params = first.sampling_params
        return [
            first.fork(f"{first.request_id}:{i}", i, dataclasses.replace(
                params, n=1, seed=None if params.seed is None else params.seed + i))
            for i in range(1, params.n)
        ]  # fmt: skip

    def _outputs(self, changed_sequences: set[str]) -> list[RequestOutput]:
        """One output per request (group) that changed, in arrival order; finished groups are dropped."""
        group_ids = {self._group_id(rid) for rid in changed_sequences}
        outputs = []
        for group_id in sorted(group_ids, key=lambda g: self._groups[g].sequences[0].arrival_index):
            group = self._groups[group_id]
            output = self._make_output(group)
            if group.finished:
                del self._groups[group_id]
                for sequence in group.sequences:
                    del self._sequences[sequence.request_id]
                self._num_finished += 1
            if output is not None:
                outputs.append(output)
        return outputs

    def _group_id(self, sequence_id: str) -> str:
        if sequence_id in self._groups or sequence_id in self._beam_groups:
            return sequence_id
        return sequence_id.rpartition(":")[0]

    def _hit_stop_string(self, request: Request) -> bool:
        """Detokenize and look for a stop string; on a hit, cut the text before it (vLLM's default)."""
        text = self._decode(request)
        for stop in request.sampling_params.stop:
            index = text.find(stop)
            if index != -1:
                request.text = text[:index]
                request.stop_reason = stop
                return True
        return False

    def _decode(self, request: Request) -> str:
        return self._decode_ids(request.output_token_ids, request.sampling_params.skip_special_tokens)

    def _decode_ids(self, token_ids, skip_special_tokens: bool) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def _make_output(self, group: _Group) -> RequestOutput | None:
        first = group.sequences[0]
        kind = first.sampling_params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not group.finished:
            return None
        completions = [self._completion(sequence, kind) for sequence in group.sequences]
        return RequestOutput(group.request_id, first.prompt, first.prompt_token_ids, completions, group.finished)

    def _completion(self, sequence: Request, kind: RequestOutputKind) -> CompletionOutput:
        params = sequence.sampling_params
        text = sequence.text if isinstance(sequence.stop_reason, str) else self._decode(sequence)
        token_ids = list(sequence.output_token_ids)
        logprobs = list(sequence.output_logprobs) if params.logprobs is not None else None
        if kind == RequestOutputKind.DELTA:
            seen_tokens, seen_text = sequence.delta_seen
            sequence.delta_seen = (len(token_ids), len(text))
            token_ids, text = token_ids[seen_tokens:], text[seen_text:]
            logprobs = logprobs[seen_tokens:] if logprobs is not None else None
        return CompletionOutput(
            sequence.sample_index, text, token_ids, sequence.status.finish_reason, sequence.stop_reason, logprobs
        )

    def _record(
        self, output: SchedulerOutput, update: UpdateOutput, finished: list[Request], beam_forks: list[tuple[str, str]]
    ) -> None:
        kv = self.kv_cache_manager
        self.trace.steps.append(
            StepRecord(
                step=output.step,
                scheduled=output.scheduled,
                allocated=output.allocated,
                freed=self.scheduler.take_freed_blocks(),
                preempted=output.preempted,
                appended=update.appended,
                finished=tuple((r.request_id, r.status.finish_reason) for r in finished),
                block_tables=tuple(
                    BlockTableSnapshot(rid, tuple(t.block_ids), t.num_tokens) for rid, t in kv.block_tables.items()
                ),
                waiting=tuple(r.request_id for r in self.scheduler.waiting),
                running=tuple(r.request_id for r in self.scheduler.running),
                num_free_blocks=kv.num_free_blocks,
                cached_blocks=tuple(sorted(kv.pool.hash_to_block.values())),
                forked=update.forked + tuple(beam_forks),
                copied=output.copies,
                evicted=kv.pool.take_evicted(),
                swapped=tuple(r.request_id for r in self.scheduler.swapped),
                swapped_out=output.swapped_out,
                swapped_in=output.swapped_in,
                cpu_block_tables=tuple(
                    BlockTableSnapshot(rid, tuple(t.block_ids), t.num_tokens)
                    for rid, t in (self.swap_space.block_tables.items() if self.swap_space else ())
                ),
                num_free_cpu_blocks=self.swap_space.num_free_blocks if self.swap_space else 0,
                truncated=output.truncated,
            )
        )

    # -- reporting ----------------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        pool = self.kv_cache_manager.pool
        swap = self.swap_space
        return EngineStats(
            num_kv_blocks=pool.num_blocks,
            num_used_blocks=pool.num_used_blocks,
            peak_used_blocks=self._peak_used_blocks,
            block_size=self.config.block_size,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_steps=self.scheduler.num_steps,
            num_computed_tokens=self._num_computed_tokens,
            num_generated_tokens=self._num_generated_tokens,
            num_finished=self._num_finished,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.kv_cache_manager.num_query_tokens,
            prefix_cache_hits=self.kv_cache_manager.num_hit_tokens,
            num_evicted_blocks=pool.num_evicted_blocks,
            num_preemptions_recompute=self.scheduler.num_preemptions_by_mode[PreemptionMode.RECOMPUTE],
            num_preemptions_swap=self.scheduler.num_preemptions_by_mode[PreemptionMode.SWAP],
            num_preemptions_partial=self.scheduler.num_preemptions_partial,
            num_recomputed_tokens=self.scheduler.num_recomputed_tokens,
            num_swapped_out_blocks=swap.num_swapped_out_blocks if swap else 0,
            num_swapped_in_blocks=swap.num_swapped_in_blocks if swap else 0,
            num_swapped_bytes=(swap.num_swapped_out_blocks + swap.num_swapped_in_blocks) * self._bytes_per_block
            if swap else 0,
            num_swapped=len(self.scheduler.swapped),
            num_cpu_blocks=swap.num_cpu_blocks if swap else 0,
        )

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()


def _attention_backend(name: str, device) -> str:
    """Resolve "auto", and check that "triton" can run here."""
    from pagedlab.kernels import HAS_TRITON

    if name == "auto":
        return "triton" if device.type == "cuda" and HAS_TRITON else "torch"
    if name == "triton":
        if not HAS_TRITON:
            raise ValueError("attention_backend='triton' needs the triton package (Linux only); use 'torch'")
        if device.type == "cpu":
            if os.environ.get("TRITON_INTERPRET") != "1":
                raise ValueError(
                    "attention_backend='triton' on CPU runs the kernels in Triton's interpreter, which must be "
                    "switched on before triton is first imported: start Python with TRITON_INTERPRET=1"
                )
            logger.warning("attention_backend='triton' on CPU: the kernels run in Triton's interpreter (slow)")
    return name


def with_output_kind(params: SamplingParams, kind: RequestOutputKind) -> SamplingParams:
    return dataclasses.replace(params, output_kind=kind)

