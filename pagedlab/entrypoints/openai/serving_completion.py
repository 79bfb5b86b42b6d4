"""POST /v1/completions: one engine request per prompt, its `n` samples as choices `prompt * n + sample`.

Streamed, each delta of each sample is a `text_completion` chunk; with `stream_options.include_usage` a last
chunk carries the usage; `data: [DONE]` ends the stream. Not streamed, the deltas are joined into one
response. Either way, leaving early (a client that went away) aborts every engine request of the call.

# Explained in chapters/13_serving.ipynb
"""

from __future__ import annotations

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


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest) -> dict | AsyncIterator[str]:
        """The response body, or for `stream` an iterator of SSE lines. Bad input raises `OpenAIError` (400)
        before anything is queued."""
        self.check_model(request.model)
        params = self.sampling_params(request, request.max_tokens, request.logprobs)
        prompts = await self.tokenize(request.prompts())
        for prompt in prompts:
            self.check_context(prompt, request.max_tokens, "prompt")
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
        try:
            async for i, output in merge_streams(streams):
                raise_if_failed(output)
                for c in output.outputs:
                    k = i * n + c.index
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
        num_output = sum(len(t) for t in token_ids)
        return {
            "id": request_id, "object": "text_completion", "created": self.created(), "model": self.model_name,
            "choices": choices, "usage": usage(streams, num_output),
        }

    async def _stream(self, request: CompletionRequest, request_id: str, streams) -> AsyncIterator[str]:
        n, created = request.n, self.created()
        offsets = [0] * (len(streams) * n)
        num_output = 0
        head = {"id": request_id, "object": "text_completion", "created": created, "model": self.model_name}
        try:
            async for i, output in merge_streams(streams):
                raise_if_failed(output)
                for c in output.outputs:
                    k = i * n + c.index
                    choice_logprobs = None
                    if request.logprobs is not None:
                        choice_logprobs = self.completion_logprobs(c.token_ids, c.logprobs or [], request.logprobs,
                                                                   offsets[k])
                        # the tokens' texts, as the full response counts them (a stop string may hold text back)
                        offsets[k] += sum(len(token) for token in choice_logprobs["tokens"])
                    num_output += len(c.token_ids)
                    yield sse(head | {"choices": [{"index": k, "text": c.text, "logprobs": choice_logprobs,
                                                   "finish_reason": c.finish_reason}]})
            if request.include_usage:
                yield sse(head | {"choices": [], "usage": usage(streams, num_output)})
        except Exception as error:
            yield sse(engine_error(error).body())
        finally:
            close_all(streams)
        yield SSE_DONE

