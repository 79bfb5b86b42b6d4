"""Seeded synthetic workloads for the simulator: when requests arrive, how long their prompts and outputs
are, which share a prefix, and how many samples or beams they ask for.

A workload is a tuple of `SimRequest`s, the same for the same arguments on every machine (one
`random.Random(seed)`). Arrivals are Poisson, bursty (gamma-distributed gaps, as vLLM's serving benchmark
draws them) or all at once; lengths are fixed, uniform, exponential, lognormal, or drawn from a benchmark
workload's own lengths. Outputs ignore EOS, so a request generates exactly `output_len` tokens.

# Explained in chapters/14_playground.ipynb
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

VOCAB_SIZE = 32_000  # made-up prompt token ids are drawn from [0, VOCAB_SIZE)
LENGTH_KINDS = ("fixed", "uniform", "exponential", "lognormal", "chat")


@dataclass(frozen=True)
class SimRequest:
    """One request of a workload: its prompt, how many tokens it generates, when it arrives (seconds from the
    start), and n > 1 parallel samples or a beam search of `beam_width` beams (each generating `output_len`)."""

    prompt_token_ids: tuple[int, ...]
    output_len: int
    arrival_s: float = 0.0
    n: int = 1
    beam_width: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("SimRequest.prompt_token_ids is empty: a prompt needs at least one token")
        if self.output_len < 1:
            raise ValueError(f"SimRequest.output_len must be >= 1, got {self.output_len}")
        if not self.arrival_s >= 0:
            raise ValueError(f"SimRequest.arrival_s must be >= 0, got {self.arrival_s}")
        if self.n < 1 or self.beam_width < 0 or (self.n > 1 and self.beam_width):
            raise ValueError(f"SimRequest: n >= 1 and beam_width >= 0, not both > 1; got n={self.n}, "
                             f"beam_width={self.beam_width}")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class Lengths:
    """A length distribution, clipped to [low, high]: "fixed" (always `mean`), "uniform" on [low, high],
    "exponential" with `mean`, "lognormal" with median `mean` and shape `sigma`, or "chat": the lengths of
    `pagedlab bench --workload chat` (prompts 20-400 uniform, outputs exponential with mean 128)."""

    kind: str = "fixed"
    mean: float = 128
    low: int = 1
    high: int = 4096
    sigma: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in LENGTH_KINDS:
            raise ValueError(f"Lengths.kind must be one of {', '.join(LENGTH_KINDS)}, got {self.kind!r}")
        if not 1 <= self.low <= self.high:
            raise ValueError(f"Lengths needs 1 <= low <= high, got low={self.low}, high={self.high}")
        if not self.mean > 0 or not self.sigma > 0:
            raise ValueError(f"Lengths needs mean > 0 and sigma > 0, got mean={self.mean}, sigma={self.sigma}")

    def sample(self, rng: random.Random, role: str = "output") -> int:
        """One length; `role` ("prompt" or "output") picks which of the chat workload's two distributions."""
        kind = self.kind
        if kind == "chat":
            value = rng.randint(20, 400) if role == "prompt" else min(max(round(rng.expovariate(1 / 128)), 16), 512)
        elif kind == "fixed":
            value = round(self.mean)
        elif kind == "uniform":
            value = rng.randint(self.low, self.high)
        elif kind == "exponential":
            value = round(rng.expovariate(1 / self.mean))
        else:
            value = round(rng.lognormvariate(math.log(self.mean), self.sigma))
        return min(max(value, self.low), self.high)


def arrival_times(num: int, request_rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """`num` arrival times from 0: all at once when `request_rate` is infinite; else gaps drawn from a gamma
    distribution with mean 1 / request_rate and shape `burstiness` (1: Poisson; below 1: bursts)."""
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 requests/s (math.inf: all at once), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0 (1 = Poisson), got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num
    times, t = [], 0.0
    for _ in range(num):
        times.append(t)
        t += rng.gammavariate(burstiness, 1 / (request_rate * burstiness))
    return times


def make_workload(
    num_requests: int = 200, *, request_rate: float = math.inf, burstiness: float = 1.0,
    prompt_len: Lengths = Lengths("uniform", low=32, high=512), output_len: Lengths = Lengths("exponential", 128,
    low=8, high=512), shared_prefix_fraction: float = 0.0, prefix_len: int = 256, n: int = 1, beam_width: int = 0,
    seed: int = 0,
) -> tuple[SimRequest, ...]:
    """A seeded workload. A `shared_prefix_fraction` of the requests start with one common prefix of
    `prefix_len` tokens (a system prompt) before their own `prompt_len` tokens; the others have none. Prompt
    token ids are random, so that no two prompts share a block by chance."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if not 0.0 <= shared_prefix_fraction <= 1.0:
        raise ValueError(f"shared_prefix_fraction must be in [0, 1], got {shared_prefix_fraction}")
    if prefix_len < 0:
        raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")
    rng = random.Random(seed)
    arrivals = arrival_times(num_requests, request_rate, burstiness, rng)
    vocab = range(VOCAB_SIZE)
    prefix = tuple(rng.choices(vocab, k=prefix_len))
    requests = []
    for arrival in arrivals:
        own = tuple(rng.choices(vocab, k=prompt_len.sample(rng, "prompt")))
        shared = rng.random() < shared_prefix_fraction
        requests.append(SimRequest(prefix + own if shared else own, output_len.sample(rng, "output"), arrival, n,
                                   beam_width))
    return tuple(requests)
