"""One request's state as the scheduler sees it: its tokens, how many have KV, and whether it is done.

A request's tokens are its prompt followed by what it has generated. `num_computed_tokens` counts those whose
K and V are already in the cache; the scheduler's one rule is to compute `num_tokens - num_computed_tokens`
more. A prefill is just a request with many uncomputed tokens; a decode is one with exactly one.

# Explained in chapters/05_continuous_batching.ipynb
"""

from __future__ import annotations

import enum

from pagedlab.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted, its KV kept in the CPU swap space
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # its processing raised; the error is in `Request.error`

    @property
    def is_finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.SWAPPED)

    @property
    def finish_reason(self) -> str | None:
        """vLLM's `finish_reason` string, or None while the request is unfinished."""
        return self.value if self.is_finished else None


class Request:
    """A request inside the engine (mutable; the scheduler and the engine update it each step).

    Invariants:
      - 0 <= num_computed_tokens <= num_tokens; a running request has num_computed_tokens < num_tokens
        between steps (its newest token still needs its KV computed);
      - output_token_ids only grows, except that nothing is ever removed from it.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_index: int,
        max_tokens: int,
        eos_token_ids: frozenset[int],
        prompt: str | None = None,
        cache_salt: str | None = None,
        sample_index: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.cache_salt = cache_salt  # an extra prefix-cache key: equal tokens with other salts never share KV
        self.sample_index = sample_index  # which of the n samples of its group this sequence is
        self.forked = False  # set once the n - 1 other samples have been forked from this one
        self.is_beam = False  # a beam-search sequence: the engine's beam step picks its tokens
        self.group_size = sampling_params.n  # sequences the request grows into (n, or the beam width)
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_index = arrival_index
        self.max_tokens = max_tokens
        self.eos_token_ids = eos_token_ids
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[dict[int, float]] = []
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.error: str | None = None  # why it finished with FINISHED_ERROR
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.text = ""  # set when a stop string ends the request: the output text, cut before it
        self.delta_seen = (0, 0)  # tokens and characters already returned, for DELTA outputs

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output, without building the whole list."""
        num_prompt = len(self.prompt_token_ids)
        if stop <= num_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : stop - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - num_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def needs_fork(self) -> bool:
        """True for the first sample of an n > 1 request until its prompt is done and the others fork."""
        return self.sampling_params.n > 1 and not self.forked

    @property
    def num_seqs(self) -> int:
        """How many running sequences it counts as: its group size until it has forked, then 1."""
        return 1 if self.forked else self.group_size

    @property
    def order(self) -> tuple[int, int]:
        """First come, first served: by arrival, then by sample index within a group."""
        return (self.arrival_index, self.sample_index)

    def fork(self, request_id: str, sample_index: int, sampling_params: SamplingParams) -> Request:
        """A new sequence with this one's tokens so far (its KV blocks are shared by the block manager)."""
        child = Request(
            request_id, self.prompt_token_ids, sampling_params, self.arrival_index, self.max_tokens,
            self.eos_token_ids, self.prompt, self.cache_salt, sample_index,
        )  # fmt: skip
        child.output_token_ids = list(self.output_token_ids)
        child.output_logprobs = list(self.output_logprobs)
        child.num_computed_tokens = self.num_computed_tokens
        child.is_beam = self.is_beam
        child.forked = True
        return child

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """The finished status the newest token implies, or None to go on. Stop strings are checked by the
        engine, which owns the tokenizer."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
