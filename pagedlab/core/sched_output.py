"""The data of one step, as it flows one way: scheduler -> worker -> scheduler update -> output processor -> trace.

`SchedulerOutput` is everything the worker needs to run the step (which tokens of which sequences, through
which block tables, sampled how, and which sequences finished since the last step) and everything the trace
records of the decision (blocks allocated, copied, swapped, freed and evicted; who was preempted, forked or
failed). `ModelRunnerOutput` is what the worker computed, whole: each sequence's new tokens in one shape, their
logprobs, and the groups whose processing raised. `UpdateOutput` is what the scheduler did with it. All of it is
frozen, and none of it holds a live object of the core.

# Explained in chapters/09_the_whole_engine.ipynb
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedlab.sampling_params import SamplingParams

Move = tuple[str, tuple[tuple[int, int], ...]]  # (request_id, ((source block, target block), ...))


@dataclass(frozen=True)
class SamplingRequest:
    """One token to draw from a row of logits: for whom, how, and what it may not yet end with. A beam
    sequence (`is_beam`) gets its next-token log-probabilities instead, for the beam step to choose from."""

    request_id: str
    params: SamplingParams
    banned_token_ids: tuple[int, ...] = ()  # EOS and stop token ids while min_tokens is not reached
    is_beam: bool = False
    num_banned_positions: int = 0  # the ban holds for this many tokens from here (a verified row draws several)


@dataclass(frozen=True)
class PromptLogprobsRequest:
    """Score the prompt tokens a chunk predicts (vLLM's prompt_logprobs): row i of the chunk gives the
    log-probability of `token_ids[i]`, the prompt token at position num_computed_tokens + 1 + i, and of the top
    `num_logprobs` tokens."""

    num_logprobs: int
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class ScheduledRequest:
    """One sequence's share of a step: compute tokens [num_computed_tokens, num_computed_tokens + num_new_tokens)
    whose ids are `token_ids`, through the block table `block_ids`; then, if the step reaches its newest token,
    draw from its last row for each of `sampling` (itself, and the samples forked from it this step).

    Speculative decoding: the last `num_spec_tokens` of `token_ids` are proposed (draft) tokens after the
    sequence's newest token. They are computed like the others (a decode becomes a chunk of 1 + k tokens, and the
    budget counts them); every row of the chunk is scored, the longest agreeing prefix of the drafts is
    accepted plus one token drawn after it, and the slots of the rejected drafts are rolled back."""

    request_id: str
    num_computed_tokens: int
    num_new_tokens: int
    group_id: str = ""  # the user's request (for the error of a request whose processing raises)
    token_ids: tuple[int, ...] = ()
    block_ids: tuple[int, ...] = ()
    sampling: tuple[SamplingRequest, ...] = ()
    num_spec_tokens: int = 0
    prompt_logprobs: PromptLogprobsRequest | None = None

    @property
    def spec_token_ids(self) -> tuple[int, ...]:
        """The draft tokens to verify (the end of `token_ids`)."""
        return self.token_ids[len(self.token_ids) - self.num_spec_tokens :]

    @property
    def is_sampling(self) -> bool:
        """The step reaches the sequence's newest token, so a token is drawn (or beam log-probabilities)."""
        return bool(self.sampling)

    @property
    def is_decode(self) -> bool:
        """One query token: attention reads all of it from the cache (a decode, or a one-token chunk)."""
        return self.num_new_tokens == 1


@dataclass(frozen=True)
class SchedulerOutput:
    step: int
    scheduled: tuple[ScheduledRequest, ...]
    allocated: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (request_id, blocks added to its table)
    preempted: tuple[str, ...] = ()  # victims in order (a partial victim may appear more than once)
    copies: tuple[tuple[str, int, int], ...] = ()  # copy-on-write: (request_id, source block, its copy)
    swapped_out: tuple[Move, ...] = ()  # ((device block, cpu block), ...) per request, copied before the step
    swapped_in: tuple[Move, ...] = ()  # ((cpu block, device block), ...) per request, copied before the step
    truncated: tuple[tuple[str, int], ...] = ()  # partial preemptions: (request_id, computed tokens it keeps)
    forked: tuple[tuple[str, str], ...] = ()  # (parent, child): samples forked as the prompt's last chunk runs
    restarted: tuple[tuple[str, str], ...] = ()  # (group_id, first beam): recomputed beam groups start again
    failed: tuple[tuple[str, str], ...] = ()  # (group_id, why): groups that can never fit, finished with an error
    finished: tuple[tuple[str, str], ...] = ()  # (request_id, finish_reason): the failed groups' sequences
    freed: tuple[int, ...] = ()  # blocks that became free while scheduling
    evicted: tuple[int, ...] = ()  # cached blocks handed out again (their hash is gone)
    # sequences finished since the previous step (any way: stopped, aborted, failed): the worker drops their state
    finished_req_ids: tuple[str, ...] = ()

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_swapped_blocks(self) -> int:
        """Blocks copied between the pools before the step, out and in."""
        return sum(len(pairs) for _, pairs in self.swapped_out + self.swapped_in)


@dataclass(frozen=True)
class ModelRunnerOutput:
    """What the worker computed in one step, handed to `Scheduler.update_from_output` whole.

    `sampled_token_ids`: each sequence that drew, its new tokens in one shape: one token, or (speculative
    decoding) the accepted drafts followed by the token drawn after them. `logprobs`: for the sequences that asked,
    one {token_id: logprob} per new token. `beam_logprobs`: each beam sequence's next-token log-probabilities (a
    [vocab_size] tensor), for the beam step. `errors`: the groups whose processing raised, with the message.
    `prompt_logprobs`: for the chunks that asked, one {token_id: logprob} per prompt token they predict."""

    sampled_token_ids: dict[str, tuple[int, ...]] = field(default_factory=dict)
    logprobs: dict[str, tuple[dict[int, float], ...]] = field(default_factory=dict)
    beam_logprobs: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[dict[int, float], ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class BeamDecision:
    """One beam step of one group (made by `pagedlab.beam_search`): the next beams in rank order, each the
    parent it extends and its token (a parent chosen again is forked), and the beams nobody continues."""

    group_id: str
    continuations: tuple[tuple[str, int], ...]
    pruned: tuple[str, ...]


@dataclass(frozen=True)
class SequenceUpdate:
    """What happened to one sequence in a step's update."""

    request_id: str
    group_id: str
    new_token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    stop_reason: int | None = None  # the stop token id that ended it
    num_cached_tokens: int | None = None  # its prompt tokens found in the prefix cache (known once admitted)


@dataclass(frozen=True)
class UpdateOutput:
    """The scheduler's update after the model ran: tokens appended, forks, finishes, and blocks freed. `failed`
    is the step's one error channel: every group that failed in it, in scheduling (it can never fit) or in the
    worker (its processing raised), with why; the output processor turns each into an error output."""

    sequences: tuple[SequenceUpdate, ...]
    forked: tuple[tuple[str, str], ...] = ()  # (parent, child): beams forked by the beam step
    beam_ids: tuple[tuple[str, tuple[str, ...]], ...] = ()  # per beam decision: the sequence of each continuation
    failed: tuple[tuple[str, str], ...] = ()  # (group_id, why): groups that failed in this step
    freed: tuple[int, ...] = ()
    verified: tuple[tuple[str, int, int], ...] = ()  # speculative decoding: (request_id, drafts, drafts accepted)
    rolled_back: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (request_id, slots of the rejected drafts)

    @property
    def appended(self) -> tuple[tuple[str, int], ...]:
        return tuple((u.request_id, t) for u in self.sequences for t in u.new_token_ids)

    @property
    def finished(self) -> tuple[tuple[str, str], ...]:
        return tuple((u.request_id, u.finish_reason) for u in self.sequences if u.finish_reason is not None)
