"""How one request wants its tokens chosen and when it wants to stop.

`SamplingParams` mirrors vLLM's class of the same name: the same field names, the same defaults, and a
`ValueError` that names the field for every value that makes no sense. It is a frozen dataclass, so one
object can be shared by many requests.

# Explained in chapters/09_the_whole_engine.ipynb
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from pagedlab.checks import is_int, is_real, is_seed

_GREEDY_EPS = 1e-5


def _as_tuple(name: str, value) -> tuple:
    """A tuple field from None or any iterable (vLLM takes lists); anything else is refused by name."""
    if value is None:
        return ()
    if not isinstance(value, Iterable):
        raise ValueError(f"SamplingParams.{name} must be a sequence, got {value!r}")
    return tuple(value)


class RequestOutputKind(enum.Enum):
    """What `LLMEngine.step()` returns for a request (vLLM's names)."""

    CUMULATIVE = 0  # every step: all tokens and text so far
    DELTA = 1  # every step: only what is new since the last output
    FINAL_ONLY = 2  # once, when the request finishes


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request (vLLM's names and defaults).

    n: how many samples to draw from the prompt; they share its KV blocks (copy-on-write) and, with a seed s,
        sample i equals a separate request with seed s + i.
    temperature: 0 means greedy (argmax); otherwise logits are divided by it before sampling. Finite.
    top_p, top_k, min_p: nucleus, top-k (-1 or 0 = off) and min-p filtering, applied after temperature; a top_p
        so small that no token's mass reaches it (1e-46 is 0.0 in float32) keeps the most likely token.
    seed: a per-request seed; the same seed gives the same tokens whatever else is in the batch. It and
        seed + n - 1 must be seeds a torch generator takes: from -2**63 to 2**64 - 1.
    max_tokens: the most tokens to generate (None = up to the model's length limit).
    stop: strings that end generation; the matched string is not included in the text.
    stop_token_ids: token ids that end generation (kept in `token_ids`, like EOS).
    ignore_eos: keep generating past the end-of-sequence token.
    logprobs: return the log-probabilities of this many most likely tokens (plus the chosen one) per step.
    prompt_logprobs: the same for every prompt token after the first (`RequestOutput.prompt_logprobs`); such a
        request computes its whole prompt (no prefix-cache hits), as in vLLM.
    logit_bias: {token_id: bias} added to the logits before sampling, each bias in [-100, 100] (OpenAI's).
    allowed_token_ids: if set, only these tokens can be drawn: every other one is masked out (after logit_bias).
    skip_special_tokens: leave special tokens out of the returned text.
    output_kind: what `LLMEngine.step()` reports for the request (`LLM.generate` asks for FINAL_ONLY).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        # Accept a single string or any sequence for the tuple fields, as vLLM does.
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        object.__setattr__(self, "stop", _as_tuple("stop", stop))
        object.__setattr__(self, "stop_token_ids", _as_tuple("stop_token_ids", self.stop_token_ids))
        if self.allowed_token_ids is not None and not isinstance(self.allowed_token_ids, str):
            object.__setattr__(self, "allowed_token_ids", _as_tuple("allowed_token_ids", self.allowed_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._verify()
        for name in ("temperature", "top_p", "min_p"):  # an int such as 2**63 would overflow a tensor of int64
            object.__setattr__(self, name, float(getattr(self, name)))

    def _verify(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        if not is_int(self.n) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if not is_real(self.temperature) or self.temperature < 0.0:
            raise bad("temperature", "must be a finite number >= 0")
        if self.n > 1 and self.temperature < _GREEDY_EPS:
            raise bad("n", "> 1 needs temperature > 0: greedy samples would all be the same (use beam_search)")
        if not is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be a number in (0, 1]")
        if not is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "must be an integer >= 0 (0 or -1 disables it)")
        if not is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be a number in [0, 1]")
        self._verify_seed()
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1 or None")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must not exceed max_tokens ({self.max_tokens})")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must hold non-empty strings")
        if any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must hold non-negative integers")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            raise bad("logprobs", "must be an integer >= 0 or None")
        if self.prompt_logprobs is not None and (not is_int(self.prompt_logprobs) or self.prompt_logprobs < 0):
            raise bad("prompt_logprobs", "must be an integer >= 0 or None")
        self._verify_logit_bias()
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not isinstance(allowed, tuple) or any(not is_int(t) or t < 0 for t in allowed):
                raise bad("allowed_token_ids", "must be token ids (integers >= 0) or None")
            if not allowed:
                raise bad("allowed_token_ids", "must hold at least one token id (None allows every token)")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", "must be a RequestOutputKind (e.g. RequestOutputKind.DELTA)")
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be True or False")

    def _verify_seed(self) -> None:
        """Sample i of n draws with seed + i: every one of them must be a seed the generator takes."""
        if self.seed is None:
            return
        if not is_seed(self.seed) or not is_seed(self.seed + self.n - 1):
            raise ValueError(
                f"SamplingParams.seed must be an integer or None, and seed to seed + n - 1 (n={self.n}) within "
                f"[-2**63, 2**64 - 1] (the seeds a torch generator takes), got {self.seed!r}"
            )

    def _verify_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict) or any(not is_int(t) or t < 0 for t in bias):
            raise ValueError(f"SamplingParams.logit_bias must map token ids (integers >= 0) to biases, got {bias!r}")
        bad = {t: b for t, b in bias.items() if not is_real(b) or not -100 <= b <= 100}
        if bad:
            raise ValueError(f"SamplingParams.logit_bias values must be numbers in [-100, 100], got {bad!r}")

    @property
    def greedy(self) -> bool:
        """True when the argmax is taken (temperature 0, as in vLLM)."""
        return self.temperature < _GREEDY_EPS


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's `BeamSearchParams`, plus Hugging Face's `early_stopping` (default False, as HF's)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False

    def __post_init__(self) -> None:
        if not is_int(self.beam_width) or self.beam_width < 1:
            raise ValueError(f"BeamSearchParams.beam_width must be an integer >= 1, got {self.beam_width!r}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"BeamSearchParams.max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not is_real(self.length_penalty):
            raise ValueError(f"BeamSearchParams.length_penalty must be a finite number, got {self.length_penalty!r}")
        object.__setattr__(self, "length_penalty", float(self.length_penalty))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"BeamSearchParams.ignore_eos must be True or False, got {self.ignore_eos!r}")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ValueError(
                f"BeamSearchParams.early_stopping must be True, False or 'never', got {self.early_stopping!r}"
            )


# A beam sequence's own settings: the beam step, not sampling, picks its tokens, and it never stops on its own.
BEAM_SAMPLING = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
