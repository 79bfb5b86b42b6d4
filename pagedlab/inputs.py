"""Prompts in: text, token ids or a dict, tokenized and checked against what this engine can ever run.

Every check happens before anything changes, and each failure is a `ValueError` that names the problem: an empty
prompt, token ids that are not integers or lie outside the vocabulary, a cache salt that is not a non-empty
string, a prompt that could never fit (in max_model_len, in the whole KV cache, or in one step without chunked
prefill), more samples or beams than max_num_seqs lets run at once, stop token ids outside the vocabulary, more
logprobs than the vocabulary has tokens, allowed token ids that min_tokens bans every one of.

# Explained in chapters/09_the_whole_engine.ipynb
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedlab.config import EngineConfig
from pagedlab.core.block_table import cdiv
from pagedlab.core.scheduler_step import banned_until_min_tokens
from pagedlab.sampling_params import BeamSearchParams, SamplingParams

PromptType = str | list[int] | dict


@dataclass(frozen=True)
class ProcessedPrompt:
    text: str | None
    token_ids: list[int]
    cache_salt: str | None = None


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, config: EngineConfig, num_blocks: int,
                 eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.config = config  # with max_model_len resolved
        self.num_blocks = num_blocks

    def process(self, prompt: PromptType, params: SamplingParams | BeamSearchParams) -> ProcessedPrompt:
        """Tokenize and check a prompt and its parameters (a ValueError before anything changes)."""
        processed = self._tokenize(prompt)
        self._check_prompt(processed.token_ids)
        self._check_params(params)
        return processed

    def _tokenize(self, prompt: PromptType) -> ProcessedPrompt:
        salt = _cache_salt(prompt.get("cache_salt")) if isinstance(prompt, dict) else None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return ProcessedPrompt(prompt.get("prompt"), _token_ids(prompt["prompt_token_ids"]), salt)
            if "prompt" not in prompt:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass {'prompt_token_ids': [...]} instead of text")
            return ProcessedPrompt(prompt, self.tokenizer.encode(prompt), salt)
        if isinstance(prompt, (list, tuple)):
            return ProcessedPrompt(None, _token_ids(prompt), salt)
        raise TypeError(f"a prompt is a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def _check_prompt(self, token_ids: list[int]) -> None:
        config = self.config
        if not token_ids:
            raise ValueError("the prompt is empty: it needs at least one token")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if len(token_ids) + 1 > config.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens; with one generated token that exceeds "
                f"max_model_len={config.max_model_len}"
            )
        num_blocks = cdiv(len(token_ids) + 1, config.block_size)
        if num_blocks > self.num_blocks:
            raise ValueError(f"the prompt needs {num_blocks} KV blocks but the whole cache has {self.num_blocks}")
        if len(token_ids) > config.max_num_batched_tokens and not config.enable_chunked_prefill:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, more than max_num_batched_tokens="
                f"{config.max_num_batched_tokens}; raise it or enable chunked prefill"
            )

    def _check_params(self, params: SamplingParams | BeamSearchParams) -> None:
        max_num_seqs = self.config.max_num_seqs
        if isinstance(params, BeamSearchParams):
            if params.beam_width > max_num_seqs:
                raise ValueError(
                    f"beam_width={params.beam_width} is more than max_num_seqs={max_num_seqs}: its beams could "
                    "never run at once; lower beam_width or raise max_num_seqs"
                )
            return
        if params.n > max_num_seqs:
            raise ValueError(
                f"SamplingParams n={params.n} is more than max_num_seqs={max_num_seqs}: its samples could never "
                "run at once; lower n or raise max_num_seqs"
            )
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(
                f"SamplingParams stop_token_ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
            )
        bad = [t for t in params.logit_bias or () if t >= self.vocab_size]
        if bad:
            raise ValueError(
                f"SamplingParams.logit_bias token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
            )
        bad = [t for t in params.allowed_token_ids or () if t >= self.vocab_size]
        if bad:
            raise ValueError(
                f"SamplingParams.allowed_token_ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
            )
        banned = set(banned_until_min_tokens(params, self.eos_token_ids))
        if params.min_tokens and params.allowed_token_ids is not None and banned >= set(params.allowed_token_ids):
            raise ValueError(
                f"SamplingParams.allowed_token_ids {list(params.allowed_token_ids)[:5]} are all banned until "
                f"min_tokens={params.min_tokens} (they are stop token ids or EOS): no token could be drawn"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.vocab_size:
                raise ValueError(
                    f"SamplingParams.{name}={value} is more than the vocabulary's {self.vocab_size} tokens"
                )


def _token_ids(values) -> list[int]:
    """A prompt's token ids as ints: floats, bools (True would pass for 1) and other values are refused."""
    bad = [t for t in values if not isinstance(t, int) or isinstance(t, bool)]
    if bad:
        raise ValueError(f"prompt token ids must be integers, got {bad[:5]!r}")
    return list(values)


def _cache_salt(salt) -> str | None:
    """A cache salt is hashed as UTF-8 into every block hash of its request: a non-empty string that encodes."""
    if salt is None:
        return None
    try:
        if isinstance(salt, str) and salt:
            salt.encode("utf-8")
            return salt
    except UnicodeEncodeError:
        pass
    raise ValueError(f"cache_salt must be a non-empty string that UTF-8 can encode, got {salt!r}")
