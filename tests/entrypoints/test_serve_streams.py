"""Streams of `pagedlab serve` against OpenAI's contract, on a tiny random model: one finish chunk per choice
with n > 1 (completions and chat), logprob offsets equal streamed or not, and other streams going on while a
chat template renders.

The server runs in a background thread on a free 127.0.0.1 port and is driven by the official `openai` client.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter

import openai

from pagedlab.entrypoints.openai.api_server import ServerThread, build_app
from tests.helpers import ChatByteTokenizer, tiny_server_engine

MODEL = "tiny"
# A sampled token in 0-39 ends a sample: with n = 3 the choices finish at different steps.
STOPPING = dict(n=3, temperature=1.0, seed=42, max_tokens=30, extra_body={"stop_token_ids": list(range(40))})


def _finish_chunks(chunks) -> Counter:
    return Counter(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason is not None)


def test_a_streamed_completion_sends_one_finish_chunk_per_choice(client):
    full = client.completions.create(model=MODEL, prompt="Hello", **STOPPING)
    chunks = list(client.completions.create(model=MODEL, prompt="Hello", stream=True, **STOPPING))
    assert _finish_chunks(chunks) == {0: 1, 1: 1, 2: 1}
    texts = ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(3)]
    assert texts == [c.text for c in full.choices]
    finish = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason}
    assert [finish[i] for i in range(3)] == [c.finish_reason for c in full.choices]
    assert len({len(t) for t in texts}) > 1  # the choices finished at different steps


def test_a_streamed_chat_sends_one_finish_chunk_per_choice(client):
    messages = [{"role": "user", "content": "Hi"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, **STOPPING)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True, **STOPPING))
    assert _finish_chunks(chunks) == {0: 1, 1: 1, 2: 1}
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i) for i in range(3)]
    assert texts == [c.message.content for c in full.choices]
    # the samples finished at different steps, so a finished one was left behind by the others
    assert len({len(t) for t in texts}) > 1


def test_streamed_text_offsets_equal_the_full_ones_while_a_stop_string_holds_text_back(client):
    """A stop string that could still be forming holds the last characters back from the stream; the offsets
    are the tokens' places in the text all the same."""
    request = dict(model=MODEL, prompt="Hello", max_tokens=8, temperature=0, logprobs=0, stop=["~~~~"])
    full = client.completions.create(**request).choices[0].logprobs
    chunks = list(client.completions.create(stream=True, **request))
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert len(full.text_offset) == 8 and offsets == full.text_offset
    assert full.text_offset == [sum(len(t) for t in full.tokens[:i]) for i in range(8)]


class HeldTemplate(ChatByteTokenizer):
    """Rendering a conversation whose last message is "hold" waits until `release` is set (20 s at most)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()
        self.released_in_time = None

    def apply_chat_template(self, conversation, **kwargs) -> str:
        if conversation[-1]["content"] == "hold":
            self.entered.set()
            self.released_in_time = self.release.wait(20)
        return super().apply_chat_template(conversation, **kwargs)


def test_other_streams_go_on_while_a_chat_template_renders():
    """A big chat body takes a while to render and tokenize: that runs in a thread, so the event loop keeps
    serving the other streams. Here the rendering waits until another stream has finished; on the event
    loop it would wait in vain (and the stream only after it)."""
    tokenizer = HeldTemplate()
    with ServerThread(build_app(tiny_server_engine(tokenizer), MODEL)) as server:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)

        async def main():
            held = asyncio.ensure_future(client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hold"}], max_tokens=2))
            assert await asyncio.to_thread(tokenizer.entered.wait, 20)
            stream = await client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0,
                                                     stream=True)
            chunks = [chunk async for chunk in stream]
            tokenizer.release.set()
            answer = await held
            await client.close()
            return chunks, answer

        chunks, answer = asyncio.run(asyncio.wait_for(main(), timeout=90))
    assert tokenizer.released_in_time and answer.choices[0].finish_reason == "length"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert tokenizer.render_threads and f"pagedlab-serve-{server.port}" not in tokenizer.render_threads
