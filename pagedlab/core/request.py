"""One sequence inside the core: its tokens, how many have KV, where it came from, and whether it is done.

A request's tokens are its prompt followed by what it has generated. `num_computed_tokens` counts those whose
K and V are already in the cache; the scheduler's one rule is to compute `num_tokens - num_computed_tokens`
more. A prefill is just a request with many uncomputed tokens; a decode is one with exactly one.

A user's request with `n > 1` samples, or a beam search, grows into a *group* of requests: the first one holds
the user's id and computes the prompt; the others are forked from it (or from each other, for beams), share its
KV blocks, and record where they came from in `parent_id`. All of them carry the user's id as `group_id`. The
core sees token ids only: text, stop strings and logprobs belong to the output processor.

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
    FINISHED_ERROR = "error"  # its processing raised, or it can never fit
    FINISHED_PRUNED = "pruned"  # a beam that no continuation chose

    @property
    def is_finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.SWAPPED)

    @property
    def finish_reason(self) -> str | None:
        """vLLM's `finish_reason` string, or None while the request is unfinished."""
        return self.value if self.is_finished else None


class Request:
    """A sequence inside the core (mutable; the scheduler updates it each step).

    Invariants:
      - 0 <= num_computed_tokens <= num_tokens; a running request has num_computed_tokens < num_tokens
        between steps (its newest token still needs its KV computed);
      - requests of one group share `group_id` and `arrival_index`; the first has `parent_id` None.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_index: int,
        max_tokens: int,
        eos_token_ids: frozenset[int] = frozenset(),
        cache_salt: str | None = None,
        *,
        group_id: str | None = None,
        parent_id: str | None = None,
        sample_index: int = 0,
        beam_width: int = 0,
    ) -> None:
        self.request_id = request_id
        self.group_id = request_id if group_id is None else group_id  # the user's request
        self.parent_id = parent_id  # the sequence this one was forked from
        self.sample_index = sample_index  # its place in its group (sample i of n, or the i-th beam forked)
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params
        self.arrival_index = arrival_index
        self.max_tokens = max_tokens
        self.eos_token_ids = eos_token_ids
        self.cache_salt = cache_salt  # an extra prefix-cache key: equal tokens with other salts never share KV
        self.prompt_block_hashes: tuple[bytes, ...] = ()  # its prompt's full blocks, hashed once on arrival
        self.beam_width = beam_width  # > 0 for beam search: the engine's beam step picks its tokens
        self.forked = False  # set once the n - 1 other samples have been forked from this one
        self.num_computed_tokens = 0
        self.num_cached_tokens: int | None = None  # prefix-cache hits at its first admission (vLLM's name)
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | None = None  # the stop token id that ended it, if one did

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
    def is_beam(self) -> bool:
        return self.beam_width > 0

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Its prompt tokens' logprobs are asked for and not all computed yet (they are, once it has a token)."""
        return self.sampling_params.prompt_logprobs is not None and not self.output_token_ids

    @property
    def needs_fork(self) -> bool:
        """True for the first sample of an n > 1 request until its prompt is done and the others fork."""
        return self.sampling_params.n > 1 and not self.forked

    @property
    def num_seqs_reserved(self) -> int:
        """Sequence slots its group needs at most from now on (vLLM's max_num_running_seqs): the beam width for
        a beam search, n for a request whose samples have not forked yet, else 1 per running sequence."""
        if self.is_beam:
            return self.beam_width
        return self.sampling_params.n if self.needs_fork else 1

    @property
    def order(self) -> tuple[int, int]:
        """First come, first served: by arrival, then by place within the group."""
        return (self.arrival_index, self.sample_index)

    def fork(self, request_id: str, sample_index: int, sampling_params: SamplingParams) -> Request:
        """A new sequence of this group with this one's tokens so far (the block manager shares its blocks)."""
        child = Request(
            request_id, self.prompt_token_ids, sampling_params, self.arrival_index, self.max_tokens,
            self.eos_token_ids, self.cache_salt, group_id=self.group_id, parent_id=self.request_id,
            sample_index=sample_index, beam_width=self.beam_width,
        )
        child.output_token_ids = list(self.output_token_ids)
        child.prompt_block_hashes = self.prompt_block_hashes
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.forked = True
        return child

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """The finished status the newest token implies, or None to go on (stop strings are the output
        processor's: it sees text)."""
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
