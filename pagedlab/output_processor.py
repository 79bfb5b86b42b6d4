"""The frontend of each request: its text, stop strings, logprobs and output kind, and the n samples it gathers.

The core sees token ids only. For every user request, `OutputProcessor` keeps a `RequestState` (vLLM's name)
holding what the user sees: one `SequenceState` per sample, each with its tokens, its incremental detokenizer
and its logprobs (and the request's prompt logprobs and prefix-cache hits). Each step it takes the core's
output (samples forked, tokens appended with their logprobs, prompt logprobs, sequences finished or failed),
detokenizes, checks stop strings, and returns the `RequestOutput`s of the requests that changed, as their
output kind asks: everything so far (CUMULATIVE), only what is new (DELTA: the samples with new tokens or text,
or with a finish not yet reported, each reported finished once), or once at the end (FINAL_ONLY). Sequences
that hit a stop string are returned too: the engine tells the core to finish them.

# Explained in chapters/09_the_whole_engine.ipynb
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pagedlab.core.engine_core import EngineCoreOutput
from pagedlab.core.sched_output import SequenceUpdate
from pagedlab.detokenizer import IncrementalDetokenizer
from pagedlab.outputs import CompletionOutput, RequestOutput
from pagedlab.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class SequenceState:
    index: int
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0  # for DELTA outputs: what was already returned
    num_sent_chars: int = 0
    finish_sent: bool = False

    @property
    def text(self) -> str:
        return self.detokenizer.text if self.detokenizer is not None else ""


@dataclass
class RequestState:
    """One user request: its prompt, its settings, and a `SequenceState` per sample (n of them once forked)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_index: int
    sequences: dict[str, SequenceState] = field(default_factory=dict)  # core request id -> its state
    num_cached_tokens: int | None = None  # its prompt tokens found in the prefix cache, once admitted
    prompt_logprobs: list[dict[int, float] | None] | None = None  # filled as its prompt's chunks are computed
    prompt_logprobs_sent: bool = False  # for DELTA outputs

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    def add_prompt_logprobs(self, first_position: int, entries) -> None:
        """The logprobs of the prompt tokens from `first_position` on; a chunk computed again (after a
        preemption) changes none that are known."""
        for position, entry in enumerate(entries, start=first_position):
            if self.prompt_logprobs[position] is None:
                self.prompt_logprobs[position] = entry

    @property
    def finished(self) -> bool:
        """All n samples have finished (they fork as the prompt's last chunk is scheduled)."""
        done = [s.finish_reason is not None for s in self.sequences.values()]
        return len(done) == self.params.n and all(done)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}  # unfinished user requests, by the user's id
        self._group_of: dict[str, str] = {}  # sequence id -> its request's id

    def add_request(self, state: RequestState, first_sequence_id: str) -> None:
        self.requests[state.request_id] = state
        self._add_sequence(state, first_sequence_id)

    def _add_sequence(self, state: RequestState, sequence_id: str, parent: SequenceState | None = None) -> None:
        params, detokenizer = state.params, None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, state.prompt_token_ids, params.skip_special_tokens, params.stop, params.min_tokens
            )
        sequence = SequenceState(len(state.sequences), detokenizer)
        if parent is not None and parent.token_ids:
            sequence.token_ids, sequence.logprobs = list(parent.token_ids), list(parent.logprobs)
            if detokenizer is not None:
                detokenizer.update(parent.token_ids)
        state.sequences[sequence_id] = sequence
        self._group_of[sequence_id] = state.request_id

    def fork(self, parent_id: str, child_id: str) -> None:
        """A sample forked from `parent_id` (beams, which output only at the end, are not followed here)."""
        state = self.requests.get(self._group_of.get(parent_id, ""))
        if state is not None:
            self._add_sequence(state, child_id, state.sequences[parent_id])

    def _forget(self, state: RequestState) -> None:
        del self.requests[state.request_id]
        for sequence_id in state.sequences:
            self._group_of.pop(sequence_id, None)

    def process(self, output: EngineCoreOutput) -> tuple[list[RequestOutput], list[str], list[str]]:
        """Apply one step of the core: follow the samples it forked, add the new tokens and their logprobs.
        Returns the outputs of the requests
        that changed: first an error output for each that failed (in the core, or here), then the others in
        arrival order; the sequences a stop string finished; and the requests whose processing raised here, which
        the core must finish."""
        for parent, child in output.scheduler_output.forked:
            self.fork(parent, child)
        self._add_prompt_logprobs(output)
        update, logprobs = output.update, output.runner_output.logprobs
        changed: dict[str, RequestState] = {}
        stopped: list[str] = []
        failed: dict[str, str] = dict(update.failed)
        for u in update.sequences:
            state = self.requests.get(u.group_id)
            if state is None or u.group_id in failed or u.request_id not in state.sequences:
                continue
            sequence = state.sequences[u.request_id]
            if state.num_cached_tokens is None:
                state.num_cached_tokens = u.num_cached_tokens
            try:
                if self._apply(sequence, u, logprobs.get(u.request_id)):
                    stopped.append(u.request_id)
            except Exception as exc:
                failed[u.group_id] = f"{type(exc).__name__}: {exc}"
                continue
            changed[u.group_id] = state
        outputs = []
        for group_id, message in failed.items():
            state = self.requests.get(group_id)
            if state is not None:
                outputs.append(self.finish_with_error(state, message))
        for state in sorted(changed.values(), key=lambda s: s.arrival_index):
            if state.request_id in failed:
                continue
            output = self._make_output(state)
            if output is not None:
                outputs.append(output)
        return outputs, stopped, [g for g in failed if g not in dict(update.failed)]

    def _add_prompt_logprobs(self, output: EngineCoreOutput) -> None:
        computed = output.runner_output.prompt_logprobs
        for scheduled in output.scheduler_output.scheduled if computed else ():
            state = self.requests.get(self._group_of.get(scheduled.request_id, ""))
            if state is not None and scheduled.request_id in computed:
                state.add_prompt_logprobs(scheduled.num_computed_tokens + 1, computed[scheduled.request_id])

    def _apply(self, sequence: SequenceState, update: SequenceUpdate, logprobs) -> bool:
        """Add the step's tokens to one sequence; True if a stop string finished it. `logprobs`: one dict per
        new token (a verified speculative chunk adds several), or None."""
        sequence.token_ids += update.new_token_ids
        if logprobs is not None:
            sequence.logprobs += logprobs[: len(update.new_token_ids)]
        hit = None
        if sequence.detokenizer is not None:
            hit = sequence.detokenizer.update(update.new_token_ids, finished=update.finish_reason is not None)
        if hit is not None:
            # several tokens in one step (speculative decoding): those after the one that completed the stop
            # string are dropped, as if the sequence had been stopped there
            del sequence.token_ids[sequence.detokenizer.num_output_tokens :]
            del sequence.logprobs[sequence.detokenizer.num_output_tokens :]
            sequence.finish_reason, sequence.stop_reason = "stop", hit
            return update.finish_reason is None  # still running in the core: the engine finishes it
        if update.finish_reason is not None:
            sequence.finish_reason, sequence.stop_reason = update.finish_reason, update.stop_reason
        return False

    def finish_with_error(self, state: RequestState, message: str) -> RequestOutput:
        self._forget(state)
        completions = [
            CompletionOutput(s.index, s.text, list(s.token_ids), "error", error=message)
            for s in state.sequences.values()
        ]
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions, True,
                             state.num_cached_tokens)

    def abort(self, request_id: str) -> bool:
        state = self.requests.get(request_id)
        if state is not None:
            self._forget(state)
        return state is not None

    def _make_output(self, state: RequestState) -> RequestOutput | None:
        finished = state.finished
        kind = state.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if finished:
            self._forget(state)
        if kind == RequestOutputKind.DELTA:
            completions = [c for s in state.sequences.values() if (c := self._delta(s, state.params)) is not None]
            if not completions:
                return None
        else:
            completions = [self._completion(s, state.params) for s in state.sequences.values()]
        prompt_logprobs = None if state.prompt_logprobs is None else list(state.prompt_logprobs)
        if kind == RequestOutputKind.DELTA and state.prompt_logprobs_sent:
            prompt_logprobs = None  # a delta carries them once
        state.prompt_logprobs_sent = True
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions, finished,
                             state.num_cached_tokens, prompt_logprobs)

    @staticmethod
    def _completion(sequence: SequenceState, params: SamplingParams) -> CompletionOutput:
        finished = sequence.finish_reason is not None
        text = sequence.detokenizer.streamable_text(finished) if sequence.detokenizer is not None else ""
        logprobs = list(sequence.logprobs) if params.logprobs is not None else None
        return CompletionOutput(sequence.index, text, list(sequence.token_ids), sequence.finish_reason,
                                sequence.stop_reason, logprobs)

    def _delta(self, sequence: SequenceState, params: SamplingParams) -> CompletionOutput | None:
        """What is new in one sample since its last delta; None if nothing is (its finish is reported once)."""
        output = self._completion(sequence, params)
        text, token_ids = output.text[sequence.num_sent_chars :], output.token_ids[sequence.num_sent_tokens :]
        newly_finished = output.finished and not sequence.finish_sent
        if not (text or token_ids or newly_finished):
            return None
        logprobs = output.logprobs[sequence.num_sent_tokens :] if output.logprobs is not None else None
        sequence.num_sent_chars += len(text)
        sequence.num_sent_tokens += len(token_ids)
        sequence.finish_sent = output.finished
        return dataclasses.replace(output, text=text, token_ids=token_ids, logprobs=logprobs)
