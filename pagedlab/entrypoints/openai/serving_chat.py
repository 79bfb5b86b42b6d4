"""POST /v1/chat/completions: the conversation through the tokenizer's chat template (as `LLM.chat` does, in a
thread: the event loop goes on serving), then one engine request whose `n` samples are the choices.

Streamed, each choice opens with a chunk carrying `role: assistant`, then content deltas; the chunk with
the last delta carries the finish reason; `stream_options.include_usage` adds a usage chunk; `data: [DONE]`
ends it. Leaving early aborts the request.

# Explained in chapters/13_serving.ipynb
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from pagedlab.entrypoints.openai.protocol import ChatCompletionRequest
from pagedlab.entrypoints.openai.serving_engine import (
    SSE_DONE,
    OpenAIError,
    OpenAIServing,
    close_all,
    engine_error,
    raise_if_failed,
    sse,
    usage,
)


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, request: ChatCompletionRequest) -> dict | AsyncIterator[str]:
        """The response body, or for `stream` an iterator of SSE lines. Bad input raises `OpenAIError`."""
        self.check_model(request.model)
        # rendering and tokenizing a big conversation takes a while: in a thread, so other streams go on
        prompt = await asyncio.to_thread(self.render, request.conversation())
        field = "max_tokens" if request.max_completion_tokens is None else "max_completion_tokens"
        self.check_context(prompt, request.max_output_tokens, "messages", field)
        num_top = (request.top_logprobs or 0) if request.logprobs else None
        params = self.sampling_params(request, request.max_output_tokens, num_top, request.prompt_logprobs)
        request_id = self.new_id("chatcmpl")
        streams = await self.add_requests(request_id, [prompt], params)
        if request.stream:
            return self._stream(request, request_id, streams[0])
        try:
            return await self._full(request, request_id, streams[0])
        finally:
            close_all(streams)

    def render(self, conversation: list[dict]) -> dict:
        """The engine prompt for a conversation: the template's text and its token ids."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise OpenAIError(400, "this model's tokenizer has no chat template: use /v1/completions")
        try:
            text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        except Exception as error:
            raise OpenAIError(400, f"the chat template refused the messages: {error}", "messages") from error
        try:
            token_ids = tokenizer.encode(text, add_special_tokens=False)
        except Exception as error:
            raise OpenAIError(400, f"the tokenizer refused the rendered messages: {error}", "messages") from error
        return {"prompt": text, "prompt_token_ids": token_ids}

    async def _full(self, request: ChatCompletionRequest, request_id: str, stream) -> dict:
        texts, token_ids, logprobs, finish = {}, {}, {}, {}
        prompt_logprobs = None
        try:
            async for output in stream:
                raise_if_failed(output)
                prompt_logprobs = output.prompt_logprobs if output.prompt_logprobs is not None else prompt_logprobs
                for c in output.outputs:
                    texts[c.index] = texts.get(c.index, "") + c.text
                    token_ids[c.index] = token_ids.get(c.index, []) + c.token_ids
                    logprobs[c.index] = logprobs.get(c.index, []) + (c.logprobs or [])
                    finish[c.index] = c.finish_reason
        except Exception as error:
            raise engine_error(error) from error
        choices = [
            {"index": j, "message": {"role": "assistant", "content": texts[j]},
             "logprobs": self._logprobs(request, token_ids[j], logprobs[j]), "finish_reason": finish[j]}
            for j in sorted(texts)
        ]
        num_output = sum(len(t) for t in token_ids.values())
        response = {
            "id": request_id, "object": "chat.completion", "created": self.created(), "model": self.model_name,
            "choices": choices, "usage": usage([stream], num_output),
        }
        if request.prompt_logprobs is not None:  # vLLM's extra field, beside the choices
            response["prompt_logprobs"] = self.prompt_logprobs(stream.prompt_token_ids, prompt_logprobs,
                                                               request.prompt_logprobs)
        return response

    def _logprobs(self, request: ChatCompletionRequest, token_ids: list[int], logprobs: list) -> dict | None:
        if not request.logprobs:
            return None
        return self.chat_logprobs(token_ids, logprobs, request.top_logprobs or 0)

    async def _stream(self, request: ChatCompletionRequest, request_id: str, stream) -> AsyncIterator[str]:
        head = {"id": request_id, "object": "chat.completion.chunk", "created": self.created(),
                "model": self.model_name}
        num_output = 0
        try:
            for j in range(request.n):
                yield sse(head | {"choices": [{"index": j, "delta": {"role": "assistant", "content": ""},
                                               "logprobs": None, "finish_reason": None}]})
            async for output in stream:
                raise_if_failed(output)
                for c in output.outputs:
                    num_output += len(c.token_ids)
                    delta = {"content": c.text} if c.text or c.finish_reason is None else {}
                    yield sse(head | {"choices": [{"index": c.index, "delta": delta,
                                                   "logprobs": self._logprobs(request, c.token_ids, c.logprobs or []),
                                                   "finish_reason": c.finish_reason}]})
            if request.include_usage:
                yield sse(head | {"choices": [], "usage": usage([stream], num_output)})
        except Exception as error:
            yield sse(engine_error(error).body())
        finally:
            stream.close()
        yield SSE_DONE

