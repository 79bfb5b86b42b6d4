"""What the completion and chat endpoints share: errors in OpenAI's shape, the model check, tokenizing text
prompts and checking them against the context, adding a request to `AsyncLLM` with bad input turned into a
400, Server-Sent Events, and logprobs in OpenAI's shape.

An error is `{"error": {"message", "type", "param", "code"}}` with the HTTP status as OpenAI gives it: 400
for input the engine refuses (its ValueError, whatever the check), 404 for an unknown model, 500 for a
request the engine failed. The engine's per-token logprobs, `{token_id: logprob}` (the chosen token and the
top k), become OpenAI's legacy completion format or its chat format.

# Explained in chapters/13_serving.ipynb
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence

from pagedlab.async_llm import AsyncLLM, EngineDeadError, RequestStream
from pagedlab.outputs import RequestOutput

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                500: "internal_server_error", 503: "service_unavailable"}


class OpenAIError(Exception):
    """An error to send back as OpenAI's error object, with its HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | int | None = None) -> dict:
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code if code is not None else status}}


def sse(data: dict | str) -> str:
    """One Server-Sent Event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


SSE_DONE = sse("[DONE]")


class OpenAIServing:
    """The parts of an endpoint that do not depend on its format."""

    def __init__(self, engine: AsyncLLM, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self._token_text: dict[int, str] = {}

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise OpenAIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                              "model", "model_not_found")

    @staticmethod
    def new_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    @staticmethod
    def created() -> int:
        return int(time.time())

    @staticmethod
    def sampling_params(request, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None):
        """The request's `SamplingParams`; a value the engine refuses is a 400 naming it."""
        try:
            return request.sampling_params(max_tokens, logprobs, prompt_logprobs)
        except ValueError as error:
            raise OpenAIError(400, str(error)) from error

    async def tokenize(self, prompts: Sequence) -> list:
        """Text prompts as {"prompt", "prompt_token_ids"}, tokenized in a thread (the event loop goes on) as the
        engine would; other prompts as they are. Without a tokenizer the engine refuses text."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None or not any(isinstance(p, str) for p in prompts):
            return list(prompts)

        def tokenize_all() -> list:
            return [{"prompt": p, "prompt_token_ids": tokenizer.encode(p)} if isinstance(p, str) else p
                    for p in prompts]

        try:
            return await asyncio.to_thread(tokenize_all)
        except Exception as error:
            raise OpenAIError(400, f"the tokenizer refused the prompt: {error}", "prompt") from error

    def check_context(self, prompt: dict, max_tokens: int | None, what: str, field: str = "max_tokens") -> None:
        """Refuse a prompt plus `max_tokens` beyond max_model_len, as vLLM and OpenAI do (the engine would cut
        the output there)."""
        max_model_len, num_prompt = self.engine.max_model_len, len(prompt.get("prompt_token_ids") or ())
        if max_tokens is None or max_model_len is None or num_prompt + max_tokens <= max_model_len:
            return
        raise OpenAIError(400, (
            f"this model's maximum context length is max_model_len={max_model_len} tokens, but the request needs "
            f"{num_prompt + max_tokens}: {num_prompt} in the {what} and {field}={max_tokens} in the completion; "
            f"shorten the {what} or lower {field}"), field)

    async def add_requests(self, request_id: str, prompts: Sequence, params) -> list[RequestStream]:
        """Add one engine request per prompt; if the engine refuses one, abort the others and raise a 400."""
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                streams.append(await self.engine.add_request(f"{request_id}-{i}", prompt, params))
        except (ValueError, TypeError) as error:
            close_all(streams)
            raise OpenAIError(400, str(error)) from error
        except EngineDeadError as error:
            close_all(streams)
            raise OpenAIError(503, str(error)) from error
        except BaseException:
            close_all(streams)
            raise
        return streams

    # -- logprobs ------------------------------------------------------------------------------------------

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.engine.tokenizer.decode([token_id])
        return text

    def completion_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]], num_top: int,
                            text_offset: int) -> dict:
        """OpenAI's legacy format: tokens, token_logprobs, top_logprobs, text_offset."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, entry in zip(token_ids, logprobs):
            token = self.token_text(token_id)
            out["tokens"].append(token)
            out["text_offset"].append(text_offset)
            text_offset += len(token)
            if entry is None:  # an echoed prompt's first token: nothing before it predicts it
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(entry.get(token_id))
            top = sorted(entry.items(), key=lambda item: -item[1])[:num_top]
            out["top_logprobs"].append({self.token_text(t): lp for t, lp in top} | {token: entry.get(token_id)})
        return out

    def prompt_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float] | None], num_top: int) -> list:
        """vLLM's `prompt_logprobs`: per prompt token, None for the first, then {token id: {logprob, decoded_token}}
        for the top `num_top` and the prompt's own token (vLLM's `rank` is not reported)."""
        out = []
        for token_id, entry in zip(token_ids, logprobs):
            if entry is None:
                out.append(None)
                continue
            kept = dict(sorted(entry.items(), key=lambda item: -item[1])[:num_top]) | {token_id: entry[token_id]}
            out.append({str(t): {"logprob": lp, "decoded_token": self.token_text(t)} for t, lp in kept.items()})
        return out

    def chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]], num_top: int) -> dict:
        """OpenAI's chat format: {"content": [{token, logprob, bytes, top_logprobs}]}."""
        content = []
        for token_id, entry in zip(token_ids, logprobs):
            top = sorted(entry.items(), key=lambda item: -item[1])[:num_top]
            content.append(self._chat_token(token_id, entry.get(token_id)) | {
                "top_logprobs": [self._chat_token(t, lp) for t, lp in top]})
        return {"content": content}

    def _chat_token(self, token_id: int, logprob: float | None) -> dict:
        token = self.token_text(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def usage(streams: Sequence[RequestStream], num_output: int) -> dict:
    """OpenAI's usage of the call's requests: their prompt tokens (of which found in the prefix cache) and the
    tokens generated."""
    num_prompt = sum(len(s.prompt_token_ids or ()) for s in streams)
    return {"prompt_tokens": num_prompt, "completion_tokens": num_output, "total_tokens": num_prompt + num_output,
            "prompt_tokens_details": {"cached_tokens": sum(s.num_cached_tokens for s in streams)}}


def close_all(streams: Sequence[RequestStream]) -> None:
    for stream in streams:
        stream.close()


def raise_if_failed(output: RequestOutput) -> None:
    """A request the engine failed (finish_reason "error") becomes a 500 naming the error."""
    for completion in output.outputs:
        if completion.finish_reason == "error":
            raise OpenAIError(500, f"the engine failed this request: {completion.error or 'unknown error'}")


async def merge_streams(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, delta) from several streams as they come; one stream is read directly."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                await queue.put((i, output, None))
        except Exception as error:
            await queue.put((i, None, error))
        await queue.put((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, output, error = await queue.get()
            if error is not None:
                raise error
            if output is None:
                remaining -= 1
                continue
            yield i, output
    finally:
        for task in tasks:
            task.cancel()


def engine_error(error: BaseException) -> OpenAIError:
    """An exception while waiting for the engine, as the error to send."""
    if isinstance(error, OpenAIError):
        return error
    if isinstance(error, EngineDeadError):
        return OpenAIError(503, str(error))
    return OpenAIError(500, f"{type(error).__name__}: {error}")
