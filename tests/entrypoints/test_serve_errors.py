"""Errors of `pagedlab serve` in OpenAI's shape, on a tiny random model: an unexpected exception in a handler is
a JSON 500 and the server goes on; text that is not valid Unicode is a 400 that says so; a prompt plus
max_tokens beyond the context is refused with both numbers.

The servers run in background threads on free 127.0.0.1 ports, driven by the official `openai` client (and
httpx for raw bodies).
"""

from __future__ import annotations

import httpx
import openai
import pytest

from pagedlab.entrypoints.openai.api_server import ServerThread, build_app
from tests.helpers import FakeEngine

MODEL = "tiny"
SURROGATE_CHAT = b'{"messages": [{"role": "user", "content": "Hi \\udfff"}], "max_tokens": 3}'
SURROGATE_COMPLETION = b'{"prompt": "Hi \\udfff", "max_tokens": 3}'


def _post(server, path: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", content=body, headers={"content-type": "application/json"}, timeout=120)


class BrokenEngine(FakeEngine):
    """A fake engine with a bug: a prompt starting with token 13 raises something no handler expects."""

    def add_request(self, request_id, prompt, params):
        if prompt["prompt_token_ids"][0] == 13:
            raise KeyError("injected")
        return super().add_request(request_id, prompt, params)


def test_an_unexpected_exception_is_a_json_500_and_the_server_goes_on():
    with ServerThread(build_app(BrokenEngine(), "fake")) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)
        with pytest.raises(openai.InternalServerError, match="KeyError: 'injected'"):
            client.completions.create(model="fake", prompt=[13, 1], max_tokens=2)
        response = httpx.post(f"{server.url}/v1/completions", json={"prompt": [13], "max_tokens": 2})
        assert response.status_code == 500 and response.headers["content-type"] == "application/json"
        error = response.json()["error"]
        assert "KeyError" in error["message"] and error["type"] == "internal_server_error" and error["code"] == 500
        assert client.completions.create(model="fake", prompt=[1, 2], max_tokens=2).choices[0].text == "t1 t2 "


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", SURROGATE_CHAT),
                                        ("/v1/completions", SURROGATE_COMPLETION)], ids=["chat", "completions"])
def test_a_lone_surrogate_is_a_400_that_names_it(server, path, body):
    response = _post(server, path, body)
    assert response.status_code == 400 and response.headers["content-type"] == "application/json", response.text
    message = response.json()["error"]["message"]
    assert "lone surrogate U+DFFF" in message and "not valid Unicode" in message, message
    assert _post(server, path, body.replace(b" \\udfff", b"")).status_code == 200


def test_a_prompt_plus_max_tokens_beyond_the_context_is_a_400_with_both_numbers(server, client):
    """max_model_len is 512: a 500-token prompt may ask for 12 tokens, not 13 (vLLM and OpenAI refuse it too;
    the offline LLM cuts the output at max_model_len instead)."""
    prompt = [5] * 500
    assert client.completions.create(model=MODEL, prompt=prompt, max_tokens=12).usage.completion_tokens == 12
    with pytest.raises(openai.BadRequestError, match="max_model_len=512") as refused:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=13)
    assert "500 in the prompt" in str(refused.value) and "max_tokens=13" in str(refused.value)
    with pytest.raises(openai.BadRequestError, match="505 in the prompt and max_tokens=8"):
        client.completions.create(model=MODEL, prompt=["Hi", "x" * 505], max_tokens=8)  # text, the second prompt
    content = "y" * 483  # and 17 characters of the template: "user: ...|assistant:"
    with pytest.raises(openai.BadRequestError, match="500 in the messages and max_completion_tokens=13"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                       max_completion_tokens=13)
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}])
    assert answer.usage.completion_tokens == 12 and answer.choices[0].finish_reason == "length"


@pytest.mark.parametrize("value", [b"Infinity", b"NaN", b"1e999"])
def test_an_infinite_or_nan_temperature_is_a_400(server, value):
    """JSON parsers accept the literals Infinity and NaN (and 1e999 overflows to infinity); SamplingParams refuses
    them, and the server answers 400 naming the field."""
    response = _post(server, "/v1/completions", b'{"prompt": "Hi", "max_tokens": 2, "temperature": ' + value + b"}")
    assert response.status_code == 400 and "temperature" in response.json()["error"]["message"], response.text
