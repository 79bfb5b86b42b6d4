"""`pagedlab serve` over HTTP on a free 127.0.0.1 port, driven by the official `openai` client: the same
tokens as `LLM.generate` streamed or not, `n`, logprobs, usage; bad input as 4xx errors that change nothing;
200 concurrent streams with a fifth of them cut off; metrics; the command line and its clean shutdown.

The server runs the embedded SmolLM2 in a background thread of this process and shares the model object
with the reference `LLM`. Both select pagedlab's attention on the model while they run, so references are
computed only while the server is idle (every client call below returns after its response is complete).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from pagedlab import LLM, SamplingParams
from pagedlab.config import EngineConfig
from pagedlab.engine import LLMEngine
from pagedlab.entrypoints.openai.api_server import ServerThread, build_app
from pagedlab.prometheus import parse_metrics
from tests.helpers import FAIL_TOKEN, FakeEngine, tiny_model

MODEL = "smollm2"
ENGINE = dict(preemption_mode="recompute", num_kv_blocks=1024, max_model_len=512, max_num_seqs=256,
              record_trace=False)
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(smollm2):
    model, tokenizer = smollm2
    with ServerThread(build_app(LLMEngine(model, tokenizer, EngineConfig(**ENGINE)), MODEL)) as running:
        yield running


@pytest.fixture(scope="module")
def reference(smollm2):
    model, tokenizer = smollm2
    return LLM(model, tokenizer, **ENGINE)


def _metrics(server) -> dict[str, float]:
    samples = parse_metrics(httpx.get(f"{server.url}/metrics").text)
    return {re.sub(r'\{model_name="smollm2"\}', "", k): v for k, v in samples.items()}


# -- the same tokens as LLM.generate --------------------------------------------------------------------------


def test_completion_streamed_and_not_equals_llm_generate(client, reference):
    expected = reference.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=12),
                                  use_tqdm=False)[0].outputs[0]
    full = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0)
    assert full.choices[0].text == expected.text and full.choices[0].finish_reason == expected.finish_reason
    assert full.usage.prompt_tokens == 5 and full.usage.completion_tokens == len(expected.token_ids)
    assert full.usage.total_tokens == 5 + len(expected.token_ids)
    chunks = list(client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert len([c for c in chunks if c.choices]) > 1  # it streamed
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason


def test_chat_streamed_and_not_equals_llm_chat(client, reference):
    expected = reference.chat(CHAT, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=24, temperature=0)
    assert full.choices[0].message.content == expected.outputs[0].text == "The capital of France is Paris."
    assert full.choices[0].message.role == "assistant" and full.choices[0].finish_reason == "stop"
    assert full.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert full.usage.completion_tokens == len(expected.outputs[0].token_ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_streamed_multibyte_text_equals_the_full_text(client, reference):
    """Japanese: 8 characters of three UTF-8 bytes in 17 tokens, so every character is split across tokens.
    The deltas come from the engine's incremental detokenizer and must join into exactly the full text."""
    messages = [{"role": "user", "content": 'Translate "thank you very much" into Japanese.'}]
    expected = reference.chat(messages, SamplingParams(temperature=0, max_tokens=17), use_tqdm=False)[0].outputs[0]
    assert expected.text == "お経機ですがくは"  # SmolLM2-135M's Japanese is poor, but it is valid UTF-8
    full = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=17)
    assert full.choices[0].message.content == expected.text
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=17,
                                                 stream=True))
    deltas = [c.choices[0].delta.content or "" for c in chunks]
    assert "".join(deltas) == expected.text
    assert all("\ufffd" not in delta for delta in deltas)  # no half character is ever sent


def test_n_samples_with_a_seed_equal_llm_generate_and_repeat(client, reference):
    params = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=8)
    expected = [c.text for c in reference.generate("Once upon a time", params, use_tqdm=False)[0].outputs]
    first = client.completions.create(model=MODEL, prompt="Once upon a time", n=2, seed=7, temperature=0.8,
                                      max_tokens=8)
    again = client.completions.create(model=MODEL, prompt="Once upon a time", n=2, seed=7, temperature=0.8,
                                      max_tokens=8)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices] == expected
    assert expected[0] != expected[1]
    assert first.usage.completion_tokens == 16


def test_several_prompts_give_n_choices_each_in_order(client, reference):
    expected = [o.outputs[0].text for o in reference.generate(["One, two,", "Red, green,"],
                                                              SamplingParams(temperature=0, max_tokens=4),
                                                              use_tqdm=False)]
    response = client.completions.create(model=MODEL, prompt=["One, two,", "Red, green,"], max_tokens=4, temperature=0)
    assert [c.text for c in response.choices] == expected and [c.index for c in response.choices] == [0, 1]


def test_logprobs_in_openai_shape_equal_the_engines(client, reference):
    expected = reference.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=6, logprobs=2),
                                  use_tqdm=False)[0].outputs[0]
    response = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                         temperature=0, logprobs=2)
    logprobs = response.choices[0].logprobs
    assert "".join(logprobs.tokens) == response.choices[0].text
    assert logprobs.token_logprobs == pytest.approx([e[t] for e, t in zip(expected.logprobs, expected.token_ids)])
    assert all(len(top) == 2 and max(top.values()) == lp for top, lp in zip(logprobs.top_logprobs,
                                                                            logprobs.token_logprobs))
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                                          top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content and len(content) == 5
    for token in content:
        assert len(token.top_logprobs) == 3 and token.top_logprobs[0].logprob == token.logprob
        assert bytes(token.bytes).decode() == token.token


def test_models_health_version(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]


# -- bad input: a 4xx that names the problem, and the server goes on -----------------------------------------


BAD_COMPLETIONS = {
    "invalid JSON": (b'{"prompt": "hi", ', 400, "not valid JSON"),
    "unknown model": ({"model": "gpt-4", "prompt": "hi"}, 404, "does not exist"),
    "negative max_tokens": ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    "prompt too long": ({"prompt": [1] * 600, "max_tokens": 1}, 400, "max_model_len=512"),
    "unknown field": ({"prompt": "hi", "best_guess": True}, 400, "unknown field 'best_guess'"),
    "unsupported value": ({"prompt": "hi", "presence_penalty": 0.5}, 400, "presence_penalty"),
    "greedy n": ({"prompt": "hi", "n": 2, "temperature": 0}, 400, "n > 1 needs temperature > 0"),
    "token outside the vocabulary": ({"prompt": [10**7], "max_tokens": 1}, 400, "outside the vocabulary"),
    "missing prompt": ({"max_tokens": 1}, 400, "prompt"),
}


@pytest.mark.parametrize("case", list(BAD_COMPLETIONS))
def test_bad_completion_requests_are_openai_errors_that_change_nothing(server, case):
    body, status, message = BAD_COMPLETIONS[case]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{server.url}/v1/completions", content=content,
                          headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["type"]
    samples = _metrics(server)
    assert samples["pagedlab:num_requests_running"] == samples["pagedlab:num_requests_waiting"] == 0
    assert samples["pagedlab:kv_cache_usage_perc"] == 0
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1, "temperature": 0})
    assert ok.status_code == 200


def test_n_above_the_engines_limit_is_a_400():
    engine = LLMEngine(tiny_model(), None, EngineConfig(max_num_seqs=4, preemption_mode="recompute"))
    with ServerThread(build_app(engine, "tiny")) as server:
        response = httpx.post(f"{server.url}/v1/completions", json={"prompt": [1, 2], "n": 5, "max_tokens": 1})
        assert response.status_code == 400 and "max_num_seqs" in response.json()["error"]["message"]
        ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": [1, 2], "n": 4, "max_tokens": 2})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 4


def test_bad_chat_requests(client):
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        client.chat.completions.create(model=MODEL, messages=CHAT, top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="tools is not supported"):
        client.chat.completions.create(model=MODEL, messages=CHAT, tools=[{"type": "function", "function": {
            "name": "f", "parameters": {}}}])
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.BadRequestError, match="stream_options is only allowed when stream is true"):
        client.chat.completions.create(model=MODEL, messages=CHAT, stream_options={"include_usage": True})


def test_api_key_is_required_on_v1_when_set():
    with ServerThread(build_app(FakeEngine(), "fake", api_key="sesame")) as server:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            response = httpx.get(f"{server.url}/v1/models", headers=headers)
            assert response.status_code == 401 and "Unauthorized" in response.json()["error"]["message"]
        good = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sesame", max_retries=0)
        assert [m.id for m in good.models.list().data] == ["fake"]
        bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model="fake", prompt=[1], max_tokens=1)
        assert httpx.get(f"{server.url}/health").status_code == 200  # outside /v1: open


def test_an_engine_error_in_one_request_is_its_500_and_the_others_go_on():
    with ServerThread(build_app(FakeEngine(step_seconds=0.01), "fake")) as server:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)

        async def main():
            calls = [client.completions.create(model="fake", prompt=[FAIL_TOKEN], max_tokens=3)]
            calls += [client.completions.create(model="fake", prompt=[1, i], max_tokens=3) for i in range(3)]
            results = await asyncio.gather(*calls, return_exceptions=True)
            stream = await client.completions.create(model="fake", prompt=[FAIL_TOKEN], max_tokens=3, stream=True)
            with pytest.raises(openai.APIError, match="boom"):
                async for _ in stream:
                    pass
            await client.close()
            return results

        failed, *others = asyncio.run(main())
    assert isinstance(failed, openai.InternalServerError) and "ValueError: boom" in str(failed)
    assert [r.choices[0].text for r in others] == ["t1 t2 t3 "] * 3


# -- load: many concurrent streams, some cut off -----------------------------------------------------------


def test_200_concurrent_streams_with_a_fifth_cut_off_leave_nothing_running(server, reference):
    num, max_tokens = 200, 8
    prompts = [f"Item {i}: the" for i in range(num)]

    async def one(client, i):
        stream = await client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=max_tokens,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
        text, finish = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
            if i % 5 == 0:  # every fifth client goes away after its first chunk
                await stream.close()
                return None
        return text, finish

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=300)
        results = await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(num))), timeout=300)
        await client.close()
        return results

    start = time.monotonic()
    results = asyncio.run(main())
    elapsed = time.monotonic() - start
    completed = {i: r for i, r in enumerate(results) if r is not None}
    assert len(completed) == num - num // 5 and all(finish == "length" for _, finish in completed.values())
    for _ in range(100):  # the last aborts may still be on their way to the engine thread
        samples = _metrics(server)
        if samples["pagedlab:num_requests_running"] == 0 and samples["pagedlab:kv_cache_usage_perc"] == 0:
            break
        time.sleep(0.05)
    assert samples["pagedlab:num_requests_running"] == samples["pagedlab:num_requests_waiting"] == 0
    assert samples["pagedlab:kv_cache_usage_perc"] == samples["pagedlab:num_kv_blocks_used"] == 0
    assert samples['pagedlab:request_success_total{finished_reason="abort",model_name="smollm2"}'] >= 1
    # the survivors' text is what each prompt gives alone
    some = sorted(completed)[:8]
    expected = reference.generate([prompts[i] for i in some], SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                             ignore_eos=True), use_tqdm=False)
    assert [completed[i][0] for i in some] == [o.outputs[0].text for o in expected]
    print(f"200 streams ({num // 5} cut off) in {elapsed:.1f} s")


def test_metrics_count_tokens_and_latencies(client, server):
    before = _metrics(server)
    client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                              extra_body={"ignore_eos": True})
    after = _metrics(server)
    assert after["pagedlab:prompt_tokens_total"] - before["pagedlab:prompt_tokens_total"] == 5
    assert after["pagedlab:generation_tokens_total"] - before["pagedlab:generation_tokens_total"] == 4
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        key = f"pagedlab:{name}_seconds_count"
        assert after[key] - before[key] == 1
    itl = "pagedlab:inter_token_latency_seconds_count"
    assert after[itl] - before[itl] == 3
    for name in ("num_requests_swapped", "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "swapped_bytes_total", 'num_preemptions_total{mode="recompute",model_name="smollm2"}',
                 'swapped_blocks_total{direction="out",model_name="smollm2"}'):
        assert f"pagedlab:{name}" in after


# -- the command line --------------------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_pagedlab_serve_answers_the_openai_client_and_stops_cleanly(smollm2, sig):
    process = subprocess.Popen(
        [sys.executable, "-m", "pagedlab", "serve", "--port", "0", "--preemption-mode", "recompute",
         "--num-kv-blocks", "64", "--log-level", "warning"],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PAGEDLAB_API_KEY": "k"},
    )
    try:
        line = process.stderr.readline()
        match = re.search(r"on (http://127\.0\.0\.1:\d+/v1) .*API key required", line)
        assert match, line
        client = openai.OpenAI(base_url=match.group(1), api_key="k", max_retries=0, timeout=60)
        for _ in range(200):
            try:
                models = client.models.list()
                break
            except openai.APIConnectionError:
                time.sleep(0.05)
        assert [m.id for m in models.data] == ["smollm2-135m-instruct"]
        answer = client.chat.completions.create(model="smollm2-135m-instruct", messages=CHAT, temperature=0)
        assert answer.choices[0].message.content == "The capital of France is Paris."
        process.send_signal(sig)
        assert process.wait(timeout=30) == 0
        rest = process.stderr.read()
        assert f"shut down cleanly on {sig.name}" in rest and "Traceback" not in rest
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_pagedlab_serve_builds_its_engine_on_the_thread_that_steps_it(monkeypatch):
    """OpenMP keeps one thread team per thread that ran a parallel region: a model loaded on the main thread and
    stepped on the engine thread makes two teams, more threads than a small machine's cores, and libgomp then
    stops spinning at its barriers (each decode step about 15% slower on 2 cores). `pagedlab serve` loads the
    model on the thread its steps run on."""
    import threading

    from fastapi.testclient import TestClient

    from pagedlab import cli
    from pagedlab.entrypoints.openai import api_server
    from tests.helpers import tiny_server_engine

    threads = {"built": set(), "stepped": set()}

    def from_pretrained(*args, **kwargs):
        threads["built"].add(threading.get_ident())
        engine = tiny_server_engine()
        step = engine.step

        def recorded_step():
            threads["stepped"].add(threading.get_ident())
            return step()

        engine.step = recorded_step
        return engine

    def run_server(app, sock=None, log_level="info"):
        sock.close()
        with TestClient(app) as client:
            response = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0})
            assert response.status_code == 200, response.text

    monkeypatch.setattr(LLMEngine, "from_pretrained", staticmethod(from_pretrained))
    monkeypatch.setattr(api_server, "run_server", run_server)
    assert cli.main(["serve", "--port", "0"]) == 0
    assert len(threads["built"]) == 1 and threads["stepped"] == threads["built"]
    assert threads["built"] != {threading.get_ident()}


def test_local_server_in_thread_builds_its_engine_on_the_thread_that_steps_it(monkeypatch):
    """The benchmark's in-thread server (a model built in Python: tests, notebooks) follows the same rule as
    `pagedlab serve` (above): one thread builds the engine and makes every step."""
    import threading

    from pagedlab.bench.http_client import local_server
    from tests.helpers import ChatByteTokenizer

    threads = {"built": set(), "stepped": set()}
    init, step = LLMEngine.__init__, LLMEngine.step

    def recorded_init(self, *args, **kwargs):
        threads["built"].add(threading.get_ident())
        init(self, *args, **kwargs)

    def recorded_step(self):
        threads["stepped"].add(threading.get_ident())
        return step(self)

    monkeypatch.setattr(LLMEngine, "__init__", recorded_init)
    monkeypatch.setattr(LLMEngine, "step", recorded_step)
    options = dict(preemption_mode="recompute", num_kv_blocks=64, max_num_seqs=4)
    with local_server(tiny_model(), ChatByteTokenizer(), options, in_thread=True) as url:
        response = httpx.post(f"{url}/v1/completions", timeout=60,
                              json={"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0})
        assert response.status_code == 200, response.text
    assert len(threads["built"]) == 1 and threads["stepped"] == threads["built"]
    assert threads["built"] != {threading.get_ident()}
