"""Request bodies of the OpenAI API, as pydantic models, and their translation into `SamplingParams`.

A field pagedlab does not know is refused (400, naming it), never ignored; so is text that is not valid
Unicode. Fields it knows but does not implement are refused when their value would change the result (a
non-zero presence penalty, `suffix`, tools). vLLM's extra sampling fields (`top_k`, `min_p`, `min_tokens`,
`ignore_eos`, `stop_token_ids`, `allowed_token_ids`, `prompt_logprobs`) are accepted as vLLM accepts them.
`logit_bias` maps token ids (JSON's string keys) to biases in [-100, 100]. Responses are plain dicts built by the
serving modules.

# Explained in chapters/13_serving.ipynb
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pagedlab.sampling_params import SamplingParams

MAX_LOGPROBS = 20  # as OpenAI's top_logprobs and vLLM's default max_logprobs


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="after")
    def _valid_unicode(self):
        for name in type(self).model_fields:
            check_unicode(name, getattr(self, name))
        return self


def check_unicode(name: str, value: Any) -> None:
    """Refuse a string that is not valid Unicode: JSON's "\\udfff" escape parses into a lone UTF-16 surrogate,
    which no tokenizer can encode. Looks into lists and dicts; a nested model checks its own fields."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ValueError(f"{name} holds a lone surrogate U+{ord(value[error.start]):04X} at character "
                             f"{error.start}, which is not valid Unicode text") from None
    elif isinstance(value, (list, tuple)):
        for item in value:
            check_unicode(name, item)
    elif isinstance(value, dict):
        for key, item in value.items():
            check_unicode(name, key)
            check_unicode(name, item)


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


def _refuse(name: str, why: str = "pagedlab does not implement it") -> ValueError:
    return ValueError(f"{name} is not supported: {why}")


class _SamplingRequest(OpenAIBaseModel):
    """The fields that completions and chat completions share."""

    model: str | None = None
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # {token id: bias}, JSON's keys being strings
    user: str | None = None  # accepted and ignored: it does not change the result
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # the prompt tokens' logprobs, in the response

    @model_validator(mode="after")
    def _check_shared(self):
        if self.presence_penalty != 0.0:
            raise _refuse("presence_penalty (non-zero)")
        if self.frequency_penalty != 0.0:
            raise _refuse("frequency_penalty (non-zero)")
        bad = [key for key in self.logit_bias or () if not key.strip().lstrip("-").isdigit()]
        if bad:
            raise ValueError(f"logit_bias keys must be token ids (integers), got {bad[:5]}")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs are not available when stream is true (as in vLLM)")
        return self

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's settings for this request (SamplingParams checks the values and names the field)."""
        logit_bias = {int(key): bias for key, bias in self.logit_bias.items()} if self.logit_bias else None
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, min_p=self.min_p or 0.0,
            seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop or (),
            stop_token_ids=self.stop_token_ids or (), ignore_eos=self.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, logit_bias=logit_bias, allowed_token_ids=self.allowed_token_ids,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # OpenAI's default for completions; 0 only with echo
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # the prompt before each choice's text (with logprobs: the prompt tokens' too)
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_completion(self):
        if self.suffix:
            raise _refuse("suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise _refuse("best_of (other than n)")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be an empty list")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be at least 1 (0 is allowed only with echo: the prompt alone, with "
                             "its logprobs)")
        return self

    def prompts(self) -> list[str | dict]:
        """The prompts as engine prompts: text, or {"prompt_token_ids": [...]}."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [{"prompt_token_ids": list(p)}]
        return [x if isinstance(x, str) else {"prompt_token_ids": list(x)} for x in p]


class ContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self):
        if self.type != "text" or self.text is None:
            raise _refuse(f"content part of type {self.type!r}", "only text parts are")
        return self


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # deprecated by OpenAI for max_completion_tokens
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    metadata: dict[str, str] | None = None  # accepted and ignored
    store: bool | None = None  # accepted and ignored (nothing is stored)

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true")
        if self.response_format not in (None, {"type": "text"}):
            raise _refuse("response_format other than {'type': 'text'}")
        if self.tools:
            raise _refuse("tools")
        if self.tool_choice not in (None, "none"):
            raise _refuse("tool_choice other than 'none'")
        return self

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]
