"""`SpeculativeConfig`: vLLM's `speculative_config` dict, checked when the engine is made. Imports no torch.

    LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                            "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    LLM(speculative_config={"method": "draft_model", "model": "path/or/hub-id", "num_speculative_tokens": 4})

# Explained in chapters/11_speculative_decoding.ipynb
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How tokens are drafted for verification.

    method: "ngram" (prompt lookup: the tokens that followed the latest earlier occurrence of the context's last
        n tokens, for the longest n from prompt_lookup_max down to prompt_lookup_min), or "draft_model" (a smaller
        causal LM with the target's vocabulary, run greedily on its own paged KV cache).
    num_speculative_tokens: k, the most draft tokens a sequence verifies in one step.
    prompt_lookup_min, prompt_lookup_max: the n-gram lengths tried (ngram only; vLLM's defaults: either one
        given sets the other, neither gives 5 and 5).
    model: the draft model (draft_model only): a name, a local folder, a Hub id or a `PreTrainedModel` object,
        as `LLM` takes; it runs in the target's dtype on the target's device.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: object = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {METHODS}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer >= 1, got {k!r}")
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("speculative_config: method 'ngram' takes no model (it looks tokens up in context)")
            low = self.prompt_lookup_min if self.prompt_lookup_min is not None else self.prompt_lookup_max
            high = self.prompt_lookup_max if self.prompt_lookup_max is not None else low
            low, high = (5, 5) if low is None else (low, high)
            for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {value!r}")
            if low > high:
                raise ValueError(
                    f"speculative_config: prompt_lookup_min ({low}) must not exceed prompt_lookup_max ({high})"
                )
            object.__setattr__(self, "prompt_lookup_min", low)
            object.__setattr__(self, "prompt_lookup_max", high)
        else:
            if self.model is None:
                raise ValueError("speculative_config: method 'draft_model' needs a model (a name, path or object)")
            if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
                raise ValueError("speculative_config: prompt_lookup_min/max are for method 'ngram' only")

    @classmethod
    def from_dict(cls, value: Mapping | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """A config from vLLM's dict (or one already made, or None); unknown keys are refused by name."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; pagedlab knows {sorted(known)}")
        for name in ("method", "num_speculative_tokens"):
            if name not in value:
                raise ValueError(f"speculative_config needs {name!r}")
        return cls(**value)
