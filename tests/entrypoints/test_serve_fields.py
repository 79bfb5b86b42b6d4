"""OpenAI's standard fields and vLLM's metrics on `pagedlab serve`, on a tiny random model: GET /v1/models/{id},
`usage.prompt_tokens_details.cached_tokens`, the request histograms under `pagedlab:`, `logit_bias` and `echo`.

The server runs in a background thread on a free 127.0.0.1 port (with prefix caching, blocks of 4 tokens) and
is driven by the official `openai` client.
"""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from pagedlab.entrypoints.openai.api_server import ServerThread, build_app
from pagedlab.prometheus import parse_metrics
from tests.helpers import tiny_model, tiny_server_engine

MODEL = "tiny"


@pytest.fixture(scope="module")
def server():
    engine = tiny_server_engine(enable_prefix_caching=True, block_size=4)
    with ServerThread(build_app(engine, MODEL)) as running:
        yield running


def test_a_model_by_id_and_an_unknown_one(client):
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model" and model.owned_by == "pagedlab"
    assert model.model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError, match="The model `gpt-4` does not exist") as missing:
        client.models.retrieve("gpt-4")
    assert missing.value.body["type"] == "not_found_error" and missing.value.body["param"] == "model"


def test_usage_counts_the_prefix_cache_hits_as_cached_tokens(client):
    """A 14-token prompt in blocks of 4: the second time, its first 3 blocks (12 tokens) are cached."""
    prompt = list(range(1, 15))
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 12 and again.usage.prompt_tokens == 14
    twice = client.completions.create(model=MODEL, prompt=[prompt, prompt[:9]], max_tokens=2)
    assert twice.usage.prompt_tokens_details.cached_tokens == 12 + 8
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, stream=True,
                                              stream_options={"include_usage": True}))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == 12
    messages = [{"role": "user", "content": "What is the capital of France?"}]  # 47 tokens with the template
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert chat.usage.prompt_tokens == 47 and chat.usage.prompt_tokens_details.cached_tokens == 44


def _metrics(server) -> dict[str, float]:
    samples = parse_metrics(httpx.get(f"{server.url}/metrics").text)
    return {k.replace('{model_name="tiny"}', ""): v for k, v in samples.items()}


def test_metrics_of_vllms_dashboards(client, server):
    """One request of 6 prompt tokens and 4 generated, alone on the server: vLLM's token histograms and its
    request phases, which add up to the end-to-end latency."""
    before = _metrics(server)
    client.completions.create(model=MODEL, prompt=[7, 8, 9, 10, 11, 12], max_tokens=4)
    after = _metrics(server)
    grown = {name: after[name] - before.get(name, 0.0) for name in after}
    for name in ("request_prompt_tokens", "request_generation_tokens", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert grown[f"pagedlab:{name}_count"] == 1, name
    assert grown["pagedlab:request_prompt_tokens_sum"] == 6 and grown["pagedlab:request_generation_tokens_sum"] == 4
    assert grown['pagedlab:request_prompt_tokens_bucket{le="5.0",model_name="tiny"}'] == 0
    assert grown['pagedlab:request_prompt_tokens_bucket{le="10.0",model_name="tiny"}'] == 1
    assert grown["pagedlab:iteration_tokens_total_count"] == 4  # steps
    assert grown["pagedlab:iteration_tokens_total_sum"] == 6 + 4
    phases = sum(grown[f"pagedlab:request_{name}_time_seconds_sum"] for name in ("queue", "prefill", "decode"))
    assert phases == pytest.approx(grown["pagedlab:e2e_request_latency_seconds_sum"], rel=1e-6, abs=1e-6)
    assert grown["pagedlab:request_decode_time_seconds_sum"] > 0


def test_logit_bias_picks_the_biased_token(client):
    """Token 77 is "m" in the byte tokenizer: a bias of 100 makes greedy choose it every time."""
    completion = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0,
                                           logit_bias={"77": 100})
    assert completion.choices[0].text == "mmmm"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=0, logit_bias={"77": 100, "78": -100})
    assert chat.choices[0].message.content == "mmm"


def test_allowed_token_ids_keep_the_text_among_them(client):
    """vLLM's extra field: 'm' (77) and 'n' (78) are the only tokens the byte tokenizer may draw."""
    completion = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=1.0, seed=2,
                                           extra_body={"allowed_token_ids": [77, 78]})
    assert set(completion.choices[0].text) <= {"m", "n"} and len(completion.choices[0].text) == 6
    with pytest.raises(openai.BadRequestError, match=r"allowed_token_ids \[500\] are outside the vocabulary"):
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, extra_body={"allowed_token_ids": [500]})


@pytest.mark.parametrize("bias, message", [
    ({"128": 1}, r"logit_bias token ids \[128\] are outside the vocabulary"),
    ({"5": 101}, r"logit_bias values must be numbers in \[-100, 100\]"),
    ({"five": 1}, r"logit_bias keys must be token ids"),
    ({"-3": 1}, r"logit_bias must map token ids \(integers >= 0\)"),
])
def test_a_bad_logit_bias_is_a_400_naming_the_problem(client, bias, message):
    with pytest.raises(openai.BadRequestError, match=message):
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, logit_bias=bias)
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], logit_bias=bias)


def test_echo_puts_the_prompt_and_its_logprobs_first(client):
    """The prompt tokens' logprobs are Hugging Face's log_softmax of the same model's logits (None for the
    first token); then come the generated tokens', as without echo. Streamed or not, the same."""
    prompt, prompt_ids = "Hello", [ord(c) - 32 for c in "Hello"]  # the byte tokenizer's ids
    with torch.inference_mode():
        expected = torch.log_softmax(tiny_model()(torch.tensor([prompt_ids])).logits[0].float(), dim=-1)
    request = dict(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=2)
    plain = client.completions.create(**request).choices[0]
    full = client.completions.create(echo=True, **request)
    echoed = full.choices[0]
    assert echoed.text == prompt + plain.text and full.usage.completion_tokens == 3
    logprobs = echoed.logprobs
    assert logprobs.tokens == list(prompt) + plain.logprobs.tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1:5] == pytest.approx([expected[i - 1, prompt_ids[i]].item() for i in range(1, 5)],
                                                         abs=1e-4)
    for i, top in enumerate(logprobs.top_logprobs[1:5], start=1):  # the top 2 and the prompt's own token
        assert prompt[i] in top and len(top) in (2, 3)
    assert logprobs.token_logprobs[5:] == pytest.approx(plain.logprobs.token_logprobs)
    assert logprobs.text_offset == list(range(8))
    chunks = list(client.completions.create(echo=True, stream=True, **request))
    assert "".join(c.choices[0].text for c in chunks) == echoed.text
    streamed = [lp for c in chunks for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(logprobs.token_logprobs[1:])
    assert [o for c in chunks for o in c.choices[0].logprobs.text_offset] == logprobs.text_offset
    samples = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=2, n=2, seed=1, echo=True)
    assert [c.text[:5] for c in samples.choices] == [prompt, prompt] and samples.choices[0].logprobs is None


def test_echo_with_max_tokens_0_is_the_prompt_alone_with_its_logprobs(client):
    """vLLM's echo with max_tokens 0 (how evaluation harnesses score a text): the prompt, its tokens' logprobs,
    no completion token in the text or the usage, finish_reason "length"; streamed, one chunk. Without echo,
    max_tokens 0 is a 400 that names it."""
    prompt, prompt_ids = "Hello", [ord(c) - 32 for c in "Hello"]
    with torch.inference_mode():
        expected = torch.log_softmax(tiny_model()(torch.tensor([prompt_ids])).logits[0].float(), dim=-1)
    request = dict(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    full = client.completions.create(**request)
    choice = full.choices[0]
    assert (choice.text, choice.finish_reason, full.usage.completion_tokens) == (prompt, "length", 0)
    assert choice.logprobs.tokens == list(prompt) and choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(
        [expected[i - 1, prompt_ids[i]].item() for i in range(1, 5)], abs=1e-4)
    chunks = list(client.completions.create(stream=True, **request))
    assert [(c.choices[0].text, c.choices[0].finish_reason) for c in chunks] == [(prompt, "length")]
    assert chunks[0].choices[0].logprobs.token_logprobs == choice.logprobs.token_logprobs
    two = client.completions.create(model=MODEL, prompt=[prompt_ids, prompt_ids[:3]], max_tokens=0, echo=True, n=2,
                                    temperature=1.0, seed=0)
    assert [c.text for c in two.choices] == [prompt, prompt, prompt[:3], prompt[:3]]
    with pytest.raises(openai.BadRequestError, match="max_tokens must be at least 1.*only with echo"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=0)


def test_prompt_logprobs_as_vllm_returns_them_in_completions_and_chat(client):
    """vLLM's extra field `prompt_logprobs`: per prompt token, None for the first, then {token id: {logprob,
    decoded_token}} for the top k and the prompt's own token: on each completion choice, and on a chat response.
    Not available with stream (as in vLLM), a 400 that says so."""
    prompt, prompt_ids = "Hello", [ord(c) - 32 for c in "Hello"]
    with torch.inference_mode():
        expected = torch.log_softmax(tiny_model()(torch.tensor([prompt_ids])).logits[0].float(), dim=-1)
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, n=1,
                                     extra_body={"prompt_logprobs": 1})
    entries = full.choices[0].prompt_logprobs
    assert entries[0] is None and len(entries) == len(prompt_ids)
    for i, entry in enumerate(entries[1:], start=1):
        own = entry[str(prompt_ids[i])]
        assert own["logprob"] == pytest.approx(expected[i - 1, prompt_ids[i]].item(), abs=1e-4)
        assert own["decoded_token"] == prompt[i] and len(entry) in (1, 2)
        assert str(expected[i - 1].argmax().item()) in entry
    assert client.completions.create(model=MODEL, prompt=prompt, max_tokens=2).choices[0].model_extra == {}
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    assert chat.prompt_logprobs[0] is None and len(chat.prompt_logprobs) == chat.usage.prompt_tokens
    assert all(len(entry) == 1 for entry in chat.prompt_logprobs[1:])  # k = 0: the prompt's own token alone
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs.*stream"):
        client.completions.create(model=MODEL, prompt=prompt, stream=True, extra_body={"prompt_logprobs": 1})
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs.*stream"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True,
                                       extra_body={"prompt_logprobs": 1})
