"""The FastAPI app of `pagedlab serve`, and ways to run it: in the foreground (`run_server`) or in a
background thread on a free loopback port (`ServerThread`, for tests and notebooks).

Routes: GET /v1/models (and /v1/models/{id}), POST /v1/completions, POST /v1/chat/completions, GET /health,
/version, /metrics. With an API key every /v1 route needs `Authorization: Bearer <key>`. Every error is
OpenAI's error object: invalid input is a 400 and changes nothing; an unexpected exception in a handler is a
500 with its message (and the server goes on). The app owns its `AsyncLLM` and metrics from startup to
shutdown, which aborts what is still running.

# Explained in chapters/13_serving.ipynb
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import threading
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagedlab
from pagedlab.async_llm import AsyncLLM
from pagedlab.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedlab.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedlab.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedlab.entrypoints.openai.serving_engine import OpenAIError, error_body
from pagedlab.prometheus import CONTENT_TYPE_LATEST, PrometheusStatLogger

logger = logging.getLogger("pagedlab.serve")


def build_app(engine, model_name: str, api_key: str | None = None, executor=None) -> FastAPI:
    """The server app over an `LLMEngine`, stepped on `executor` (best the `engine_thread()` that built it; see
    `AsyncLLM`). Nothing runs until the app starts (its lifespan)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        metrics = PrometheusStatLogger(model_name, max_model_len=getattr(engine, "max_model_len", None) or 8192)
        async_llm = AsyncLLM(engine, [metrics], executor)
        metrics.record(async_llm.stats)
        app.state.metrics, app.state.async_llm = metrics, async_llm
        app.state.completion = OpenAIServingCompletion(async_llm, model_name)
        app.state.chat = OpenAIServingChat(async_llm, model_name)
        try:
            yield
        finally:
            await async_llm.shutdown()

    app = FastAPI(title="pagedlab", version=pagedlab.__version__, lifespan=lifespan)

    if api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request: Request, exc: RequestValidationError):
        return JSONResponse(error_body(400, validation_message(exc)), status_code=400)

    @app.exception_handler(OpenAIError)
    async def openai_error(_request: Request, exc: OpenAIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException):
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def unexpected_error(_request: Request, exc: Exception):
        # a bug: the client gets OpenAI's error object, Starlette then logs the traceback, and the server goes on
        message = f"the server failed on this request: {type(exc).__name__}: {exc}"
        return JSONResponse(error_body(500, message), status_code=500)

    @app.get("/health")
    async def health(request: Request):
        if not request.app.state.async_llm.is_running:
            return JSONResponse(error_body(503, "the engine stopped after an error"), status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": pagedlab.__version__}

    @app.get("/metrics")
    async def metrics(request: Request):
        return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "pagedlab",
            "root": model_name, "max_model_len": getattr(engine, "max_model_len", None)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str):
        request.app.state.completion.check_model(model_id)  # a 404 for any other id
        return card

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _respond(request, request.app.state.completion.create_completion(body))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _respond(request, request.app.state.chat.create_chat_completion(body))

    return app


class APIKeyMiddleware:
    """Every /v1 route needs `Authorization: Bearer <api_key>` (a plain ASGI middleware: it leaves streams and
    disconnects alone)."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self._expected):
                message = "invalid API key" if given else "missing API key (Authorization: Bearer ...)"
                await JSONResponse(error_body(401, f"Unauthorized: {message}"), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _respond(request: Request, work):
    """Run an endpoint; a client that disconnects before a full response is ready cancels it (which aborts
    its engine requests). A stream is watched by Starlette itself."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return Response(status_code=499)  # nobody is listening; nginx's "client closed request"
    result = task.result()
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def validation_message(exc: RequestValidationError) -> str:
    """Pydantic's errors as one sentence per problem, naming the field."""
    problems = []
    for error in exc.errors():
        location = ".".join(str(part) for part in error.get("loc", ()) if part != "body")
        if error.get("type") == "json_invalid":
            problems.append(f"the body is not valid JSON: {error.get('ctx', {}).get('error', error.get('msg'))}")
        elif error.get("type") == "extra_forbidden":
            problems.append(f"unknown field {location!r}: pagedlab does not implement it")
        else:
            message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
            problems.append(f"{location}: {message}" if location else message)
    return "; ".join(dict.fromkeys(problems)) or "invalid request"


# -- running it -------------------------------------------------------------------------------------------


def bind_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening-ready socket (port 0: a free one, chosen by the OS and held, so no race)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def _uvicorn_server(app: FastAPI, log_level: str):
    import uvicorn

    # Open streams get this long to finish on shutdown; then they are cancelled (and their requests aborted).
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5, access_log=False)
    return uvicorn.Server(config)


def run_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
               sock: socket.socket | None = None) -> None:
    """Serve in the foreground (on `sock` if given) until SIGINT or SIGTERM, then shut down cleanly."""
    sock = sock if sock is not None else bind_socket(host, port)
    _uvicorn_server(app, log_level).run(sockets=[sock])


class ServerThread:
    """The app served from a background thread on a free loopback port (tests, notebooks).

        with ServerThread(build_app(engine, "smollm2")) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        self._socket = bind_socket(host, port)
        self.host, self.port = host, self._socket.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self._server = _uvicorn_server(app, log_level)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True,
                                        name=f"pagedlab-serve-{self.port}")

    def start(self, timeout: float = 60.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
        self._socket.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
