"""Beam search as a group of sequences inside the engine, with Hugging Face's exact selection rules.

Each live beam is a sequence with its own block table. After every beam has its next-token log-probabilities,
one *beam step* picks the continuations (a `BeamDecision`); the scheduler then forks the chosen parents (their
blocks are shared, copy-on-write on the partial last block) and frees the beams that no continuation chose, at
that very step. Memory therefore follows the distinct tokens of the beams, not beam_width x length. A beam
search preempted by recompute starts again from its prompt (`BeamSearch.restart`): it reaches the same beams.

The selection follows `transformers`' `generate(num_beams=k, do_sample=False)`:
  - take the top 2k (k x (1 + number of EOS ids), at least 2k) continuations over all beams by cumulative
    log-probability; the best k that do not end (EOS, or the length limit) become the next beams;
  - a continuation that ends and ranks in the top k is a finished hypothesis, scored
    cum_logprob / generated_length ** length_penalty (its EOS counted); the best k hypotheses are kept;
  - stop when no running beam can beat the worst kept hypothesis (`early_stopping=False`: judged at the current
    length; "never": at the longest length when length_penalty > 0), when k hypotheses are kept
    (`early_stopping=True`), or when every continuation ends.
vLLM's own beam search differs (it scores every candidate with a length penalty over prompt + output and keeps
going until max_tokens); pagedlab follows Hugging Face so that the two can be compared token for token.

# Explained in chapters/04_copy_on_write.ipynb
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from pagedlab.core.sched_output import BeamDecision, ModelRunnerOutput, SchedulerOutput, UpdateOutput
from pagedlab.outputs import CompletionOutput, RequestOutput
from pagedlab.sampling_params import BeamSearchParams


def length_normalized(cum_logprob: float, length: int, length_penalty: float) -> float:
    """Hugging Face's score, cum_logprob / length ** length_penalty, in floats; where length ** length_penalty
    leaves the float range (an extreme penalty), the score is its limit: -0.0 or -inf, not an OverflowError."""
    try:
        scale = float(length) ** length_penalty  # a float base: an int penalty of 2**64 is no huge integer power
    except OverflowError:
        scale = math.inf
    return cum_logprob / scale if scale else -math.inf


@dataclass(frozen=True)
class BeamSearchSequence:
    tokens: list[int]  # prompt + generated, as vLLM's
    text: str
    cum_logprob: float | None  # None when the request failed
    score: float | None  # cum_logprob / len(generated) ** length_penalty
    finish_reason: str  # "stop" (EOS), "length", or "error"
    error: str | None = None  # finish_reason "error": what went wrong


@dataclass(frozen=True)
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


@dataclass(frozen=True)
class Continuation:
    parent: str  # the beam (sequence id) it extends
    token_id: int
    cum_logprob: float


@dataclass(frozen=True)
class Hypothesis:
    token_ids: tuple[int, ...]  # generated tokens
    cum_logprob: float
    score: float
    finish_reason: str


@dataclass
class BeamPlan:
    """What one beam step decided: the next beams in order, and the beams nobody continues."""

    continuations: list[Continuation]
    pruned: list[str]
    done: bool


@dataclass
class BeamGroup:
    """The state of one beam-search request between steps (pure bookkeeping; tensors only in `step`)."""

    request_id: str
    params: BeamSearchParams
    eos_token_ids: frozenset[int]
    max_tokens: int  # params.max_tokens, capped by the room under max_model_len
    beams: dict[str, float]  # live beam sequence id -> cumulative log-probability, best first
    generated: dict[str, tuple[int, ...]]  # live beam -> its generated tokens
    finished: list[Hypothesis] = field(default_factory=list)
    num_generated: int = 0
    improvable: bool = True
    ready: dict[str, torch.Tensor] = field(default_factory=dict)  # beam -> next-token log-probs
    prompt: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    plan: BeamPlan | None = None  # the last step's, until the scheduler says which sequence holds each beam

    def restart(self, root_id: str) -> None:
        """Start again from the prompt, with `root_id` as the one beam (a preemption dropped the others)."""
        self.beams, self.generated = {root_id: 0.0}, {root_id: ()}
        self.finished, self.ready, self.plan = [], {}, None
        self.num_generated, self.improvable = 0, True

    @property
    def is_ready(self) -> bool:
        return set(self.ready) >= set(self.beams)

    def step(self) -> BeamPlan:
        """Choose continuations from the log-probabilities of every live beam (see the module docstring)."""
        k = self.params.beam_width
        beam_ids = list(self.beams)
        scores = torch.stack([self.ready[b] + self.beams[b] for b in beam_ids])  # [num_beams, vocab]
        self.ready.clear()
        vocab_size = scores.shape[-1]
        num_eos = 0 if self.params.ignore_eos else len(self.eos_token_ids)
        top_scores, top_indices = scores.flatten().topk(min(max(2, 1 + num_eos) * k, scores.numel()))
        length = self.num_generated + 1
        # judged on the state before this step, as HF does: no hypothesis joins once none can improve the
        # kept ones, or once k are kept with early_stopping=True
        accepting = self.improvable and not (self.params.early_stopping is True and len(self.finished) == k)
        continuations: list[Continuation] = []
        all_end = True
        for rank, (score, index) in enumerate(zip(top_scores.tolist(), top_indices.tolist())):
            parent, token_id = beam_ids[index // vocab_size], index % vocab_size
            ends_with_eos = not self.params.ignore_eos and token_id in self.eos_token_ids
            if ends_with_eos or length >= self.max_tokens:
                if rank < k and accepting:
                    self._add_hypothesis(self.generated[parent] + (token_id,), score, length, ends_with_eos)
                continue
            all_end = False
            if len(continuations) < k:
                continuations.append(Continuation(parent, token_id, score))
        self.num_generated = length
        if continuations and len(self.finished) == k:
            longest = self.params.early_stopping == "never" and self.params.length_penalty > 0
            best_length = self.max_tokens if longest else length
            best_possible = length_normalized(continuations[0].cum_logprob, best_length, self.params.length_penalty)
            self.improvable = self.improvable and best_possible > min(h.score for h in self.finished)
        full = self.params.early_stopping is True and len(self.finished) == k
        done = all_end or not self.improvable or full
        parents = {c.parent for c in continuations} if not done else set()
        return BeamPlan(continuations if not done else [], [b for b in beam_ids if b not in parents], done)

    def _add_hypothesis(self, token_ids: tuple[int, ...], cum_logprob: float, length: int, eos: bool) -> None:
        k = self.params.beam_width
        score = length_normalized(cum_logprob, length, self.params.length_penalty)
        self.finished.append(Hypothesis(token_ids, cum_logprob, score, "stop" if eos else "length"))
        self.finished.sort(key=lambda h: -h.score)  # stable: earlier hypotheses win ties, as with HF's topk
        del self.finished[k:]


class BeamSearch:
    """The beam-search requests of an engine: their log-probabilities in, their beam steps out."""

    def __init__(self) -> None:
        self.groups: dict[str, BeamGroup] = {}
        self._group_of: dict[str, str] = {}  # live beam sequence -> its group

    def add(self, group: BeamGroup) -> None:
        self.groups[group.request_id] = group
        self._group_of.update((beam, group.request_id) for beam in group.beams)

    def remove(self, group_id: str) -> BeamGroup | None:
        group = self.groups.pop(group_id, None)
        if group is not None:
            for beam in group.beams:
                self._group_of.pop(beam, None)
        return group

    def restart(self, group_id: str, root_id: str) -> None:
        group = self.groups[group_id]
        for beam in group.beams:
            self._group_of.pop(beam, None)
        group.restart(root_id)
        self._group_of[root_id] = group_id

    def step(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[BeamDecision]:
        """Give each group its new log-probabilities; a beam step for every group that has them all. Groups that a
        recompute preemption sent back to their prompt (`scheduler_output.restarted`) start again first."""
        for group_id, root_id in scheduler_output.restarted:
            self.restart(group_id, root_id)
        beam_logprobs = runner_output.beam_logprobs
        ready: dict[str, BeamGroup] = {}
        for beam, logprobs in beam_logprobs.items():
            group = self.groups.get(self._group_of.get(beam, ""))
            if group is None:
                continue  # its request failed or was aborted this step
            group.ready[beam] = logprobs
            if group.is_ready:
                ready[group.request_id] = group
        decisions = []
        for group in ready.values():
            group.plan = group.step()
            continuations = tuple((c.parent, c.token_id) for c in group.plan.continuations)
            decisions.append(BeamDecision(group.request_id, continuations, tuple(group.plan.pruned)))
        return decisions

    def commit(self, beam_ids: Iterable[tuple[str, tuple[str, ...]]]) -> list[BeamGroup]:
        """The scheduler applied the decisions: `beam_ids` names the sequence of each continuation. Returns the
        groups that are done (no beam left), which leave."""
        done = []
        for group_id, ids in beam_ids:
            group = self.groups[group_id]
            for beam in group.beams:
                self._group_of.pop(beam, None)
            continuations = group.plan.continuations
            group.generated = {i: group.generated[c.parent] + (c.token_id,) for i, c in zip(ids, continuations)}
            group.beams = {i: c.cum_logprob for i, c in zip(ids, continuations)}  # in rank order, best first
            group.plan = None
            self._group_of.update((beam, group_id) for beam in group.beams)
            if not group.beams:
                done.append(self.remove(group_id))
        return done

    def process(self, update: UpdateOutput, decode: Callable[[tuple[int, ...]], str]) -> list[RequestOutput]:
        """The outputs of one step's update: an error output for each failed beam search, the finished hypotheses
        of each search that is done."""
        outputs = []
        for group_id, why in update.failed:
            group = self.remove(group_id)
            if group is not None:
                error = CompletionOutput(0, "", [], "error", error=why)
                outputs.append(RequestOutput(group_id, group.prompt, group.prompt_token_ids, [error], True))
        return outputs + [beam_output(group, decode) for group in self.commit(update.beam_ids)]


def beam_output(group: BeamGroup, decode: Callable[[tuple[int, ...]], str]) -> RequestOutput:
    """The finished hypotheses, best first, as one `RequestOutput`."""
    completions = [
        CompletionOutput(i, decode(h.token_ids), list(h.token_ids), h.finish_reason, cumulative_logprob=h.cum_logprob)
        for i, h in enumerate(group.finished)
    ]
    return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions, True)
