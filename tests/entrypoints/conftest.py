"""The fixtures every server test file shares: `server`, a `pagedlab serve` app on a tiny random model in a
background thread on a free 127.0.0.1 port (a file overrides it to serve another engine), and `client`, the
official `openai` client pointed at whichever `server` the file uses."""

from __future__ import annotations

import openai
import pytest

from pagedlab.entrypoints.openai.api_server import ServerThread, build_app
from tests.helpers import tiny_server_engine

MODEL = "tiny"


@pytest.fixture(scope="module")
def server():
    with ServerThread(build_app(tiny_server_engine(), MODEL)) as running:
        yield running


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
