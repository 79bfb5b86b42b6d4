"""Verify draft tokens: accept the longest prefix the target model agrees with, plus one token of its own.

A sequence that speculated ran a chunk of 1 + k rows: row i holds the target's next-token logits after its newest
token and its first i drafts. Row by row, the target draws its own token t_i exactly as the sampler does (the
argmax for greedy; for random sampling the exponential race, argmax p / E, with E drawn from the sequence's
generator), and draft i + 1 is accepted when it equals t_i. At the first disagreement t_i is emitted instead;
when all k drafts are accepted, row k's token comes as a bonus. So 1 to k + 1 tokens come out of one pass.

This is the rejection-sampling rule of Leviathan et al. and Chen et al. for drafts proposed with certainty (the
draft distribution q is a point mass on d, as for n-gram lookup and a greedy draft model): accept d with
probability min(1, p(d) / q(d)) = p(d); after a rejection, draw from the residual max(0, p - q) renormalized,
which is p without d. The target's own draw does both with one coin: P(t_i = d) = p(d), and given t_i != d,
t_i follows p without d. The tokens therefore follow the target's distribution exactly. A row draws only after
its predecessor was accepted, so a sequence with its own seed consumes its random stream as it would without
speculation, one draw per token: greedy or seeded, speculation changes no token (up to floating-point rounding
between the chunk and decode attention paths).

# Explained in chapters/11_speculative_decoding.ipynb
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedlab.core.sched_output import SamplingRequest
from pagedlab.worker.sampler import Sampler, apply_logit_bias, argmax, filtered_probs, logprob_entries


@dataclass(frozen=True)
class Verification:
    """One sequence's verified chunk: how many drafts were accepted, the token drawn after them, and the raw
    logprobs of each emitted token (accepted drafts, then that token) when the request asked for them."""

    num_accepted: int
    token_id: int
    logprobs: list[dict[int, float]] | None


def verify(
    logits: torch.Tensor, rows: list[tuple[tuple[int, ...], SamplingRequest]], sampler: Sampler
) -> list[Verification]:
    """logits: [sum of (1 + k) over `rows`, vocab], each sequence's chunk in order; `rows`: per sequence its
    drafts (k tokens) and how to sample. Returns one `Verification` per sequence."""
    logits = logits.float()
    raw = logits
    starts, start, banned_any = [], 0, False
    for drafts, target in rows:
        starts.append(start)
        start += len(drafts) + 1
        banned_any |= bool(target.banned_token_ids)
    if banned_any or any(target.params.logit_bias or target.params.allowed_token_ids is not None for _, target in rows):
        logits = logits.clone()
        apply_logit_bias(logits, [target.params for drafts, target in rows for _ in range(len(drafts) + 1)])
        for start, (drafts, target) in zip(starts, rows):
            for i in range(min(target.num_banned_positions, len(drafts) + 1) if target.banned_token_ids else 0):
                logits[start + i, list(target.banned_token_ids)] = -float("inf")
    greedy = argmax(logits).tolist()
    random = [j for j, (_, target) in enumerate(rows) if not target.params.greedy]
    probs = {}
    if random:
        row_ids = [starts[j] + i for j in random for i in range(len(rows[j][0]) + 1)]
        params = [rows[j][1].params for j in random for _ in range(len(rows[j][0]) + 1)]
        all_probs = filtered_probs(logits[torch.tensor(row_ids, device=logits.device)], params)
        probs = {row: all_probs[n] for n, row in enumerate(row_ids)}
    out = []
    for start, (drafts, target) in zip(starts, rows):
        generator = sampler.generator_for(target) if not target.params.greedy else None
        accepted, token = 0, None
        for i in range(len(drafts) + 1):
            if generator is None:
                token = greedy[start + i]
            else:  # the sampler's draw: argmax p / E, E ~ Exp(1) from the sequence's generator
                noise = torch.empty_like(probs[start + i]).exponential_(generator=generator)
                token = int(argmax(probs[start + i] / noise))
            if i == len(drafts) or token != drafts[i]:
                break
            accepted += 1
        emitted = [*drafts[:accepted], token]
        out.append(Verification(accepted, token, _logprobs(raw, start, emitted, target)))
    return out


def _logprobs(raw: torch.Tensor, start: int, emitted: list[int], target: SamplingRequest):
    """The model's own log-probabilities (before any ban) of each emitted token, with the top ones asked for."""
    n = target.params.logprobs
    if n is None:
        return None
    return logprob_entries(torch.log_softmax(raw[start : start + len(emitted)], dim=-1), emitted, n)
