"""The serving benchmark's client: replay a workload against any OpenAI-compatible server over HTTP.

Each request is sent at its arrival time (seconds after the start) to `/v1/completions` as token ids, greedy,
`ignore_eos` (vLLM's extra field) and streamed with `include_usage`, as vLLM's serving benchmark does. The
client measures what a user sees: time to first token, the gaps between streamed chunks, and per output
token after the first. `local_server` starts `pagedlab serve` on a free loopback port for it.

# Explained in chapters/13_serving.ipynb
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import httpx

from pagedlab.bench.workloads import Workload


@dataclass
class RequestTiming:
    """One request as the client saw it (seconds from its send time)."""

    ttft: float | None = None
    latency: float | None = None
    chunk_gaps: list[float] = field(default_factory=list)  # inter-token latencies: between streamed chunks
    num_output_tokens: int = 0
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.latency is None or self.ttft is None or self.num_output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.num_output_tokens - 1)


def model_name(base_url: str, api_key: str | None = None) -> str:
    """The first model the server lists."""
    response = httpx.get(f"{base_url}/v1/models", headers=_headers(api_key), timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def send_requests(base_url: str, workload: Workload, arrivals: Sequence[float], api_key: str | None = None,
                  bar=None) -> tuple[list[RequestTiming], float]:
    """Send every request at its arrival time; return the timings (in workload order) and the wall time."""
    name = model_name(base_url, api_key)
    return asyncio.run(_send_requests(base_url, name, workload, arrivals, api_key, bar))


async def _send_requests(base_url, name, workload, arrivals, api_key, bar):
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, headers=_headers(api_key), limits=limits, timeout=None) as client:
        start = time.perf_counter()

        async def one(i: int) -> RequestTiming:
            await asyncio.sleep(max(0.0, arrivals[i] - (time.perf_counter() - start)))
            spec = workload.requests[i]
            body = {"model": name, "prompt": list(spec.prompt_token_ids), "max_tokens": spec.max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            timing = await _send(client, body)
            if bar is not None:
                bar.update(1)
            return timing

        timings = await asyncio.gather(*(one(i) for i in range(len(workload.requests))))
        return list(timings), time.perf_counter() - start


async def _send(client: httpx.AsyncClient, body: dict) -> RequestTiming:
    timing = RequestTiming()
    sent = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                timing.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return timing
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    timing.error = chunk["error"].get("message", "error")
                    break
                now = time.perf_counter()
                if chunk.get("choices"):
                    if timing.ttft is None:
                        timing.ttft = now - sent
                    else:
                        timing.chunk_gaps.append(now - last)
                    last = now
                if chunk.get("usage"):
                    timing.num_output_tokens = chunk["usage"]["completion_tokens"]
        timing.latency = time.perf_counter() - sent
    except httpx.HTTPError as error:
        timing.error = f"{type(error).__name__}: {error}"
    return timing


def _headers(api_key: str | None) -> dict:
    key = api_key or os.environ.get("PAGEDLAB_API_KEY") or os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


@contextlib.contextmanager
def local_server(model, tokenizer, engine_options: dict, model_source: str | None = None, in_thread: bool = False,
                 threads: int | None = None, timeout: float = 900.0) -> Iterator[str]:
    """`pagedlab serve` on a free loopback port; yields its base URL.

    By default a child process loads `model_source` (a name or folder; None: the embedded model) with the
    dtype and device of `model`, so that the client does not share a process with the engine. `in_thread`
    serves the `model` object itself from a thread here (a model built in Python: tests, notebooks)."""
    if not in_thread:
        yield from _child_server(model, model_source, engine_options, threads, timeout)
        return
    from pagedlab.async_llm import build_on_engine_thread
    from pagedlab.bench.systems import engine_config
    from pagedlab.engine import LLMEngine
    from pagedlab.entrypoints.openai.api_server import ServerThread, build_app

    # built on the thread that steps it, as `pagedlab serve` does (`engine_thread` says why)
    engine, executor = build_on_engine_thread(LLMEngine, model, tokenizer,
                                              engine_config(**{**engine_options, "record_trace": False}))
    with ServerThread(build_app(engine, "local", executor=executor)) as server:
        yield server.url


# engine options on by default, which `pagedlab serve` turns off with a flag of their own
_OFF_FLAGS = {"cpu_fused_ops": "--no-cpu-fused-ops"}


def serve_command(model, model_source, engine_options: dict) -> list[str]:
    """`pagedlab serve` on a free port with the model's dtype and device and these engine options as its flags."""
    parameter = next(model.parameters())
    command = [sys.executable, "-m", "pagedlab", "serve", *([model_source] if model_source else []), "--port", "0",
               "--dtype", str(parameter.dtype).removeprefix("torch."), "--device", parameter.device.type,
               "--log-level", "warning"]
    for name, value in engine_options.items():
        if value is None or name == "record_trace":
            continue
        flag = "--engine-seed" if name == "seed" else "--" + name.replace("_", "-")
        if name in _OFF_FLAGS:
            command += [] if value else [_OFF_FLAGS[name]]
        elif isinstance(value, bool):
            command += [flag] if value else []
        else:
            command += [flag, str(value)]
    return command


def _child_server(model, model_source, engine_options, threads, timeout) -> Iterator[str]:
    command = serve_command(model, model_source, engine_options)
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = process.stderr.readline()
        match = re.search(r" on (http://[^ ]+)/v1 ", line)
        if not match:  # it is exiting (a flag it refused, a model it cannot load): its whole message
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=30)
            rest = process.stderr.read() if process.poll() is not None else ""
            raise RuntimeError(f"pagedlab serve did not start: {line}{rest}")
        url = match.group(1)
        tail: deque[str] = deque(maxlen=40)  # keep reading its stderr, or a full pipe would block it
        threading.Thread(target=lambda: tail.extend(process.stderr), daemon=True).start()
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pagedlab serve at {url} did not become healthy: {''.join(tail)}")
            time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
