"""POST /v1/completions: one engine request per prompt, its `n` samples as choices `prompt * n + sample`.
With `echo` each choice starts with its prompt (and, with `logprobs`, the prompt tokens' logprobs: vLLM's
`prompt_logprobs`, None for the first token); with `echo` and `max_tokens` 0, the prompt alone (how evaluation
harnesses score a text). vLLM's extra `prompt_logprobs` puts them on each choice in vLLM's format instead.

Streamed, each delta of each sample is a `text_completion` chunk; with `stream_options.include_usage` a last
chunk carries the usage; `data: [DONE]` ends the stream. Not streamed, the deltas are joined into one
response. Either way, leaving early (a client that went away) aborts every engine request of the call.

# Explained in chapters/13_serving.ipynb
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from pagedlab.entrypoints.openai.protocol import CompletionRequest
from pagedlab.entrypoints.openai.serving_engine import (
    SSE_DONE,
    OpenAIServing,
    close_all,
    engine_error,
    merge_streams,
    raise_if_failed,
    sse,
    usage,
)
from pagedlab.outputs import CompletionOutput, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest) -> dict | AsyncIterator[str]:
        """The response body, or for `stream` an iterator of SSE lines. Bad input raises `OpenAIError` (400)
        before anything is queued."""
        self.check_model(request.model)
        wanted = [k for k in (request.prompt_logprobs, request.logprobs if request.echo else None) if k is not None]
        # max_tokens 0 (echo alone): the engine draws one token, which the response leaves out (as vLLM does)
        max_tokens = 1 if request.max_tokens == 0 else request.max_tokens
        params = self.sampling_params(request, max_tokens, request.logprobs, max(wanted, default=None))
        prompts = await self.tokenize(request.prompts())
        for prompt in prompts:
            self.check_context(prompt, max_tokens, "prompt")
        request_id = self.new_id("cmpl")
        streams = await self.add_requests(request_id, prompts, params)
        if request.stream:
            return self._stream(request, request_id, streams)
        try:
            return await self._full(request, request_id, streams)
        finally:
            close_all(streams)

    async def _full(self, request: CompletionRequest, request_id: str, streams) -> dict:
        n = request.n
        texts = [""] * (len(streams) * n)
        token_ids: list[list[int]] = [[] for _ in texts]
        logprobs: list[list] = [[] for _ in texts]
        finish = [None] * len(texts)
        prompt_logprobs: dict[int, list] = {}  # prompt index -> its prompt tokens' logprobs
        echo, num_output = Echo(self, request), 0
        try:
            async for i, output in merge_streams(streams):
                raise_if_failed(output)
                if output.prompt_logprobs is not None:
                    prompt_logprobs[i] = output.prompt_logprobs
                for c in output.outputs:
                    k = i * n + c.index
                    c = echo.generated(c)
                    num_output += len(c.token_ids)
                    c = echo.before_first(k, i, output, c)
                    texts[k] += c.text
                    token_ids[k] += c.token_ids
                    logprobs[k] += c.logprobs or []
                    finish[k] = c.finish_reason
        except Exception as error:
            raise engine_error(error) from error
        choices = []
        for k, text in enumerate(texts):
            choice_logprobs = None
            if request.logprobs is not None:
                choice_logprobs = self.completion_logprobs(token_ids[k], logprobs[k], request.logprobs, 0)
            choices.append({"index": k, "text": text, "logprobs": choice_logprobs, "finish_reason": finish[k]})
            if request.prompt_logprobs is not None:
                i = k // n
                choices[-1]["prompt_logprobs"] = self.prompt_logprobs(streams[i].prompt_token_ids,
                                                                      prompt_logprobs[i], request.prompt_logprobs)
        return {
            "id": request_id, "object": "text_completion", "created": self.created(), "model": self.model_name,
            "choices": choices, "usage": usage(streams, num_output),
        }

    async def _stream(self, request: CompletionRequest, request_id: str, streams) -> AsyncIterator[str]:
        n, created = request.n, self.created()
        offsets = [0] * (len(streams) * n)
        num_output = 0
        head = {"id": request_id, "object": "text_completion", "created": created, "model": self.model_name}
        echo = Echo(self, request)
        try:
            async for i, output in merge_streams(streams):
                raise_if_failed(output)
                for c in output.outputs:
                    k = i * n + c.index
                    c = echo.generated(c)
                    num_output += len(c.token_ids)
                    c = echo.before_first(k, i, output, c)
                    choice_logprobs = None
                    if request.logprobs is not None:
                        choice_logprobs = self.completion_logprobs(c.token_ids, c.logprobs or [], request.logprobs,
                                                                   offsets[k])
                        # the tokens' texts, as the full response counts them (a stop string may hold text back)
                        offsets[k] += sum(len(token) for token in choice_logprobs["tokens"])
                    yield sse(head | {"choices": [{"index": k, "text": c.text, "logprobs": choice_logprobs,
                                                   "finish_reason": c.finish_reason}]})
            if request.include_usage:
                yield sse(head | {"choices": [], "usage": usage(streams, num_output)})
        except Exception as error:
            yield sse(engine_error(error).body())
        finally:
            close_all(streams)
        yield SSE_DONE



class Echo:
    """`echo`: each choice's first delta gets its prompt in front, as a delta of its own would be (the prompt's
    text, its token ids, and the logprobs of its tokens when they were asked for). With max_tokens 0 the prompt
    is all there is: the one token the engine drew is left out."""

    def __init__(self, serving: OpenAIServingCompletion, request: CompletionRequest) -> None:
        self.serving, self.enabled = serving, request.echo
        self.prompt_only = request.echo and request.max_tokens == 0
        self.prompts: dict[int, CompletionOutput] = {}  # prompt index -> its prompt as a delta
        self.echoed: set[int] = set()  # choices whose prompt went out

    def generated(self, delta: CompletionOutput) -> CompletionOutput:
        """What of a delta the completion keeps: all of it, or with max_tokens 0 nothing but that it finished."""
        if not self.prompt_only:
            return delta
        return dataclasses.replace(delta, text="", token_ids=[], logprobs=None if delta.logprobs is None else [],
                                   finish_reason="length" if delta.finish_reason is not None else None)

    def before_first(self, choice: int, prompt_index: int, output: RequestOutput,
                     delta: CompletionOutput) -> CompletionOutput:
        if not self.enabled or choice in self.echoed:
            return delta
        self.echoed.add(choice)
        if prompt_index not in self.prompts:  # a request's first output carries its prompt's logprobs
            self.prompts[prompt_index] = CompletionOutput(0, self.prompt_text(output), list(output.prompt_token_ids),
                                                          logprobs=output.prompt_logprobs)
        prompt = self.prompts[prompt_index]
        logprobs = None if delta.logprobs is None else list(prompt.logprobs or ()) + delta.logprobs
        return dataclasses.replace(delta, text=prompt.text + delta.text, token_ids=prompt.token_ids + delta.token_ids,
                                   logprobs=logprobs)

    def prompt_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        tokenizer = self.serving.engine.tokenizer
        return tokenizer.decode(output.prompt_token_ids) if tokenizer is not None else ""
