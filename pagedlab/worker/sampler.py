"""Turn each request's next-token logits into a token, by its own `SamplingParams`.

A request's `logit_bias` is added to its row first; tokens it may not yet end with (EOS and stop ids before
min_tokens) are then set to -inf. Greedy rows take the argmax. Random rows divide by the temperature, apply
top-k, top-p and min-p, and draw with the exponential race (argmax of p / E with E ~ Exp(1)), which equals
sampling from p. Each seeded request draws its E from its own `torch.Generator`, so its tokens do not depend
on what else is in the batch; unseeded requests share the sampler's generator (seeded from the engine's seed,
so runs are reproducible). Log-probabilities, when asked for, are those of the raw model distribution (before
the bias and the temperature), as vLLM's.

# Explained in chapters/09_the_whole_engine.ipynb
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedlab.core.sched_output import SamplingRequest
from pagedlab.sampling_params import SamplingParams


def argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)`: the index of the first maximum of each row (NaN counting as the largest), computed as
    `x.max(dim=-1).indices`, which gives the same indices and whose CPU kernel is the faster: 32 rows of 49,152
    float32 logits 0.9 against 2.5 ms on one thread (README, the levers table)."""
    return x.max(dim=-1).indices


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.generator = torch.Generator(device).manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._request_generators.pop(request_id, None)

    def get_state(self) -> tuple:
        """The generators' states, to undo the draws of a batch that is run again (`set_state`)."""
        return self.generator.get_state(), {rid: g.get_state() for rid, g in self._request_generators.items()}

    def set_state(self, state: tuple) -> None:
        shared, per_request = state
        self.generator.set_state(shared)
        self._request_generators = {rid: g for rid, g in self._request_generators.items() if rid in per_request}
        for rid, generator in self._request_generators.items():
            generator.set_state(per_request[rid])

    def generator_for(self, row: SamplingRequest) -> torch.Generator:
        if row.params.seed is None:
            return self.generator
        generator = self._request_generators.get(row.request_id)
        if generator is None:
            generator = torch.Generator(self.device).manual_seed(row.params.seed)
            self._request_generators[row.request_id] = generator
        return generator

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRequest]) -> SamplerOutput:
        """logits: [num_rows, vocab_size], one row per entry of `rows`."""
        logits = logits.float()
        asked = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        raw = torch.log_softmax(logits[asked], dim=-1) if asked else None  # the model's own, before any ban
        apply_logit_bias(logits, [row.params for row in rows])
        banned = [i for i, row in enumerate(rows) if row.banned_token_ids]
        if banned:
            for i in banned:
                logits[i, list(rows[i].banned_token_ids)] = -float("inf")
        token_ids = argmax(logits)
        random_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
        if random_rows:
            index = torch.tensor(random_rows, device=logits.device)
            probs = filtered_probs(logits[index], [rows[i].params for i in random_rows])
            noise = torch.empty_like(probs)
            for j, i in enumerate(random_rows):
                noise[j].exponential_(generator=self.generator_for(rows[i]))
            token_ids[index] = argmax(probs / noise)
        token_list = token_ids.tolist()
        logprobs: list[dict[int, float] | None] = [None] * len(rows)
        for j, i in enumerate(asked):
            (logprobs[i],) = logprob_entries(raw[j : j + 1], [token_list[i]], rows[i].params.logprobs)
        return SamplerOutput(token_list, logprobs)


def logprob_entries(logprobs: torch.Tensor, token_ids: Sequence[int], num_top: int) -> list[dict[int, float]]:
    """One {token_id: logprob} per row: its `num_top` likeliest tokens and its own token (the chosen or the
    prompt's). logprobs: [len(token_ids), vocab_size], log-softmaxed."""
    top = logprobs.topk(num_top) if num_top else None
    index = torch.tensor(list(token_ids), device=logprobs.device)[:, None]
    own = logprobs.gather(1, index)[:, 0].tolist()
    entries = []
    for i, token_id in enumerate(token_ids):
        entry = dict(zip(top.indices[i].tolist(), top.values[i].tolist())) if top is not None else {}
        entry[token_id] = own[i]
        entries.append(entry)
    return entries


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """Add each row's `logit_bias` to its logits, then mask out every token outside its `allowed_token_ids`, in
    place. logits: [len(params), vocab_size]."""
    for i, p in enumerate(params):
        if p.logit_bias:
            token_ids = torch.tensor(list(p.logit_bias), device=logits.device)
            logits[i, token_ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device)
        if p.allowed_token_ids is not None:
            allowed = torch.tensor(p.allowed_token_ids, device=logits.device)
            kept = logits[i, allowed].clone()
            logits[i] = -float("inf")
            logits[i, allowed] = kept


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Softmax of logits / temperature after top-k, top-p and min-p, row by row settings."""
    temperature = torch.tensor([p.temperature for p in params], device=logits.device)
    logits = logits / temperature[:, None]
    vocab_size = logits.shape[-1]
    if any(0 < p.top_k < vocab_size for p in params):
        k = torch.tensor([p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params], device=logits.device)
        kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, -float("inf"))
    probs = logits.softmax(dim=-1)
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], device=logits.device)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # keep a token while the mass before it < top_p
        drop = mass_before >= top_p[:, None]
        drop[:, 0] = False  # the likeliest always stays (a top_p like 1e-46 is 0.0 in float32, and would drop all)
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=logits.device)
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)
