"""An OpenAI-compatible HTTP server on the serving engine (FastAPI + uvicorn, as vLLM uses).

Endpoints:

- ``POST /v1/completions`` — OpenAI's completions API, and ``POST /v1/chat/completions`` — its
  chat API (messages rendered by the chat template of `minifer.serve.chat`), answered whole or
  streamed as server-sent events (``data: {...}`` per token, then ``data: [DONE]``); the fields
  are in `protocol` (requests), `replies` and `schema` (answers) and at ``/openapi.json`` (``/docs`` shows it);
- ``GET /v1/models`` (and ``/v1/models/{id}``) — the one served model; ``GET /health`` — 200
  while the engine loop runs;
- ``GET /metrics`` — Prometheus text: running and waiting requests, KV blocks used, prefix-cache
  hit rate, TTFT / TPOT / E2EL histograms, token and request counters.

A request's path (claim REQ-1): the body is checked against its schema (bad input → 400 naming
the parameter), the prompt is tokenized with the engine's own checks, and the `AsyncEngine`
thread adds it to the engine and runs ``engine.step()`` while anything is unfinished; each
step's `RequestOutput` reaches the handler's queue and leaves as an SSE chunk at once. At the end
the server reports usage and the engine frees the request's KV blocks (REQ-3). Limits (MET-5):
the context window, ``max_tokens``, a per-request timeout, a bounded waiting queue (429 with
``Retry-After`` past it); a client that disconnects — streaming or not — aborts its request,
which frees its blocks.

Guards (`minifer.serve.guard.Guard`, before any route): the ``Host`` header must name this machine (loopback
binds; stops DNS rebinding), an ``Authorization: Bearer`` key when the server has one (every
route but ``/health``), request bodies must be JSON (415 otherwise: a web page cannot post to
the server without a CORS preflight, which it does not answer), at most `max_body_bytes` (413)
arriving within `read_timeout_s` (408), headers of at most `max_header_bytes` (431). uvicorn
adds: headers must arrive within `read_timeout_s` of a connection's first byte, at most
`max_connections` at once (503). Every error — a bad request or a bug — is one OpenAI-style JSON
body, counted in ``minifer_request_rejected_total`` by status, and leaves the connection usable.

From Python or a notebook, `running_server` starts the server in a background thread on a free
loopback port and always stops it. From a shell: ``python -m minifer.serve --model shakespeare``.
FastAPI, uvicorn and prometheus_client (the ``serve`` extra) are imported only when a server is
built, so ``import minifer`` never needs them.
"""

# no `from __future__ import annotations` here: FastAPI reads the handlers' annotations
# (`request: Request`) at definition time, and Request is imported inside create_app.

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from ..checks import check_int
from .async_engine import DEFAULT_MAX_WAITING, AsyncEngine, RequestHandle, engine_max_model_len
from .engine_process import ENGINES, EngineProcess
from .errors import APIError
from .guard import (
    LOOPBACK_HOSTS,
    MAX_BODY_BYTES,
    MAX_HEADER_BYTES,
    READ_TIMEOUT_S,
    Guard,
    h11_protocol,
    json_bytes,
)
from .prometheus import ServerMetrics
from .replicas import EngineReplicas

__all__ = ["create_app", "running_server", "server_config", "ServerMetrics", "DEFAULT_HOST",
           "LOOPBACK_HOSTS"]

log = logging.getLogger("minifer.serve")

DEFAULT_HOST = "127.0.0.1"  # loopback only: exposing a server to a network is a deliberate choice
MAX_CONNECTIONS = 512  # connections (and requests in flight) at once; more get 503
SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's --scheduling-policy

def create_app(engine: Any, *, model_name: str = "minifer", model_root: str | None = None,
               max_model_len: int | None = None, max_tokens: int | None = None,
               request_timeout_s: float = 120.0, max_waiting: int = DEFAULT_MAX_WAITING,
               api_key: str | None = None,
               allowed_hosts: Sequence[str] | None = LOOPBACK_HOSTS,
               scheduling_policy: str = "fcfs", read_timeout_s: float = READ_TIMEOUT_S,
               max_body_bytes: int = MAX_BODY_BYTES, max_header_bytes: int = MAX_HEADER_BYTES,
               threads: int | str | None = None, engine_in: str = "thread",
               replicas: int = 1):
    """A FastAPI app serving `engine` (an `LLMEngine`) as model `model_name`.

    Limits (claim MET-5): `max_model_len` (prompt + max_tokens - 1; default: what the engine can
    ever hold), `max_tokens` (default: `max_model_len`), `request_timeout_s` per request (from
    its arrival, reading the body included), `max_waiting` requests waiting for their first step
    (past it: 429). Guards: `api_key` (``Authorization: Bearer``; None: none), `allowed_hosts`
    (``Host`` names; None or ``["*"]``: any — for a server bound to a network address),
    `read_timeout_s`, `max_body_bytes`, `max_header_bytes`. `scheduling_policy`: ``"fcfs"``
    refuses a non-zero ``priority``, ``"priority"`` passes it to the engine. `model_root`: what
    ``/v1/models`` reports as the model's source (default: `model_name`). `threads`: torch's
    CPU threads for the engine's steps (`AsyncEngine`: None, a number, or ``"auto"``, which
    follows the cores other programs leave free). `engine_in`: where the engine steps,
    ``"thread"`` (`AsyncEngine`, a thread of this process) or ``"process"`` (`EngineProcess`,
    a process of its own, built from `engine`'s model and options, or in a thread after a
    warning where that process cannot start). It starts and stops with the app (its lifespan).
    `replicas` (with ``engine_in="process"``): that many engine processes, each with its share
    of ``max_num_seqs`` and of the KV pool (`EngineReplicas`; one process where they cannot
    start).
    """
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import PlainTextResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    from . import protocol as P
    from . import replies as R
    from . import schema as S

    ceiling = engine_max_model_len(engine)
    max_model_len = ceiling if max_model_len is None else max_model_len
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) \
            or not 1 <= max_model_len <= ceiling:
        raise ValueError(f"max_model_len must be an integer in [1, {ceiling}] (the most this "
                         f"engine can hold), got {max_model_len!r}")
    if engine_in not in ENGINES:
        raise ValueError(f"engine_in must be one of {ENGINES}, got {engine_in!r}")
    check_int("replicas", replicas, 1)
    if replicas > 1 and engine_in != "process":
        raise ValueError(f"replicas={replicas} runs engine processes: it needs "
                         f"engine_in='process', got {engine_in!r}")
    if scheduling_policy not in SCHEDULING_POLICIES:
        raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got "
                         f"{scheduling_policy!r}")
    if api_key is not None and (not isinstance(api_key, str) or not api_key.strip()):
        raise ValueError("api_key must be a non-empty string (or None for no key)")
    for name, v in (("read_timeout_s", read_timeout_s), ("max_body_bytes", max_body_bytes),
                    ("max_header_bytes", max_header_bytes)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
            raise ValueError(f"{name} must be a positive number, got {v!r}")
    hosts = None
    if isinstance(allowed_hosts, str):
        allowed_hosts = [allowed_hosts]
    if allowed_hosts is not None and "*" not in allowed_hosts:
        hosts = frozenset(h.strip().lower().strip("[]") for h in allowed_hosts)
    limits = P.Limits(max_model_len, max_model_len if max_tokens is None else max_tokens,
                      request_timeout_s)
    tokenizer = getattr(engine, "tokenizer", None)
    vocab_size = engine.model.config.vocab_size
    if tokenizer is not None:
        vocab_size = min(vocab_size, tokenizer.vocab_size)
    created = int(time.time())
    priorities = scheduling_policy == "priority"
    card = S.ModelCard(id=model_name, created=created, root=model_root or model_name,
                       max_model_len=limits.max_model_len, permission=[S.ModelPermission(
                           id=f"modelperm-{model_name}", created=created)])

    if replicas > 1:
        bm = engine.block_manager
        aengine = EngineReplicas(engine, replicas, max_waiting=max_waiting, threads=threads,
                                 blocks_needed=-(-max_model_len // bm.block_size), fallback=True)
    elif engine_in == "process":
        aengine = EngineProcess(engine, max_waiting=max_waiting, threads=threads, fallback=True)
    else:
        aengine = AsyncEngine(engine, max_waiting=max_waiting, threads=threads)
    metrics = ServerMetrics(aengine)
    aengine.on_finish = metrics.on_finish

    @contextlib.asynccontextmanager
    async def lifespan(app):
        aengine.start()
        try:
            yield
        finally:
            aengine.stop()

    app = FastAPI(title="minifer", version="0.1.0", lifespan=lifespan,
                  summary="OpenAI-compatible completions and chat on minifer's serving engine")
    app.state.engine, app.state.async_engine, app.state.metrics = engine, aengine, metrics
    app.state.limits, app.state.model_name = limits, model_name
    app.state.read_timeout_s, app.state.max_header_bytes = float(read_timeout_s), max_header_bytes
    app.add_middleware(Guard, metrics=metrics, api_key=api_key, allowed_hosts=hosts,
                       max_body_bytes=int(max_body_bytes), max_header_bytes=int(max_header_bytes),
                       read_timeout_s=float(min(read_timeout_s, request_timeout_s)))

    def reply(err: APIError) -> Response:
        return Response(json_bytes(err.body()), status_code=err.status, headers=err.headers,
                        media_type="application/json")

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, err: APIError):
        return reply(err)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, err: RequestValidationError):
        model = P.ChatCompletionBody if request.url.path.endswith("/chat/completions") \
            else P.CompletionBody
        return reply(P.validation_error(err.errors(), model))

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, err: HTTPException):
        cause = err.__cause__
        if isinstance(cause, APIError):  # raised while FastAPI read the body (408, 413)
            return reply(cause)
        headers = dict(getattr(err, "headers", None) or {})  # e.g. a 405's Allow
        if err.status_code == 400 and cause is not None:  # the body is not JSON it can parse
            return reply(APIError(400, f"the request body is not valid JSON: "
                                  f"{type(cause).__name__}: {cause!s:.200}", code="invalid_json"))
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code)
        return reply(APIError(err.status_code, str(err.detail), code=code, headers=headers))

    errors = {status: {"model": S.ErrorResponse, "description": what} for status, what in (
        (400, "Bad request: the error names the parameter"),
        (401, "Missing or wrong API key (when the server has one)"),
        (408, "The body did not arrive in time, or the request ran past its timeout"),
        (413, "The body is too large"), (415, "The body is not JSON"),
        (431, "The headers are too large"),
        (429, "Too many requests waiting; retry after Retry-After seconds"),
        (500, "A server error (the server keeps serving)"),
        (503, "The engine is not running"))}
    errors[429]["headers"] = {"Retry-After": {"schema": {"type": "integer"},
                                              "description": "seconds"}}
    errors[401]["headers"] = {"WWW-Authenticate": {"schema": {"type": "string"}}}
    common = {s: errors[s] for s in (400, 401, 431, 500)}
    sse = {"text/event-stream": {"schema": {  # one event (Open API before 3.2: `schema`)
        "type": "object", "required": ["data"],
        "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
        "description": "With stream: true, one event per token whose data is a chunk in JSON "
                       "(a CompletionResponse or a chat.completion.chunk with the new text), "
                       "then `data: [DONE]`"}}}

    @app.get("/health", response_model=S.Health, responses={503: errors[503], **common},
             summary="200 while the engine loop runs")
    async def health():
        if not aengine.alive:
            return reply(APIError(503, "the engine loop is not running", type="server_error"))
        return {"status": "ok"}

    @app.get("/v1/models", response_model=S.ModelList, responses=common,
             summary="The served model")
    async def models():
        return {"object": "list", "data": [card.model_dump()]}

    @app.get("/v1/models/{model_id}", response_model=S.ModelCard,
             responses={404: {"model": S.ErrorResponse, "description": "No such model"},
                        **common}, summary="One served model")
    async def model(model_id: str):
        if model_id != model_name:
            return reply(APIError(404, f"the model {model_id!r:.80} does not exist; this server "
                                  f"serves {model_name!r}", param="model",
                                  code="model_not_found"))
        return card.model_dump()

    @app.get("/metrics", response_class=PlainTextResponse, responses={
        200: {"content": {"text/plain": {"schema": {"type": "string"}}},
              "description": "Prometheus text format"}, **common},
             summary="Prometheus metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST

        return PlainTextResponse(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    post_errors = {**{s: errors[s] for s in errors}, 200: {"content": sse}}

    async def serve(req: "P.CompletionRequest", request: Request):
        deadline = request.scope.get("minifer.arrival", time.monotonic()) \
            + limits.request_timeout_s
        try:
            handle = await asyncio.wait_for(
                aengine.add(req.prompt_ids, req.params, req.priority,
                            prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None
                            else None, **req.engine_options()),
                max(deadline - time.monotonic(), 0.001))
        except asyncio.TimeoutError:  # the engine did not even take it in time
            raise _timeout_error(limits.request_timeout_s) from None
        if req.stream:
            streamer = R.Streamer(req, tokenizer, handle.prompt_logprobs)
            return StreamingResponse(_sse(streamer, handle, aengine, metrics, deadline, limits),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        out = await _collect(handle, aengine, metrics, deadline, request, limits)
        if out is None:  # the client left; nobody reads this
            return Response(status_code=204)
        return R.reply_body(req, out, tokenizer, handle.prompt_logprobs)

    parse = dict(model_name=model_name, limits=limits, tokenizer=tokenizer,
                 vocab_size=vocab_size, priorities=priorities)

    @app.post("/v1/completions", response_model=S.CompletionResponse, responses=post_errors,
              summary="OpenAI's completions API")
    # Checking a body tokenizes its prompt (and decodes an id prompt): for a large prompt that
    # takes long enough to stall every other stream, so it runs in a worker thread, never on
    # the event loop (the engine thread itself only steps).
    async def completions(body: P.CompletionBody, request: Request):
        return await serve(await asyncio.to_thread(P.parse_completion_request, body, **parse),
                           request)

    @app.post("/v1/chat/completions", response_model=S.ChatCompletionResponse,
              responses=post_errors, summary="OpenAI's chat completions API (minifer.serve.chat)")
    async def chat_completions(body: P.ChatCompletionBody, request: Request):
        return await serve(await asyncio.to_thread(P.parse_chat_request, body, **parse),
                           request)

    _document_this_server(app, model_name, limits.max_tokens, vocab_size)
    return app


def _bound_ints(schema: Any, maximum: int) -> None:
    """Every integer in a JSON schema fragment gets `maximum` (token ids: the vocabulary)."""
    if isinstance(schema, dict):
        if schema.get("type") == "integer":
            schema["maximum"] = maximum
        for value in schema.values():
            _bound_ints(value, maximum)
    elif isinstance(schema, list):
        for value in schema:
            _bound_ints(value, maximum)


def _document_this_server(app, model_name: str, max_tokens: int, vocab_size: int) -> None:
    """The schema of this server: its model name, ``max_tokens`` limit and vocabulary in the
    bodies, and without FastAPI's default 422 (validation errors are 400s here)."""
    original = app.openapi

    def openapi():
        if app.openapi_schema is None:
            schema = original()
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    op.get("responses", {}).pop("422", None)
            components = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            for name in ("CompletionBody", "ChatCompletionBody"):
                props = components.get(name, {}).get("properties", {})
                if "model" in props:
                    props["model"]["enum"] = [model_name]
                for field in ("max_tokens", "max_completion_tokens"):
                    for option in props.get(field, {}).get("anyOf", []):
                        if option.get("type") == "integer":
                            option["maximum"] = max_tokens
                if "prompt" in props:
                    _bound_ints(props["prompt"], vocab_size - 1)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def _timeout_error(limits_s: float) -> APIError:
    return APIError(408, f"the request ran past the server's per-request timeout of "
                    f"{limits_s:g} s and was aborted", type="timeout_error", code="timeout")


async def _until_disconnect(receive) -> None:
    """Return when the client hangs up (the body is already read: only a disconnect is left)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(handle: RequestHandle, aengine: AsyncEngine, metrics: "ServerMetrics",
                   deadline: float, request, limits):
    """Wait for the whole answer; abort as soon as the client leaves or the timeout passes.
    The last `RequestOutput`, or None if the client left."""
    gone = asyncio.ensure_future(_until_disconnect(request.receive))
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _timeout_error(limits.request_timeout_s)
            nxt = asyncio.ensure_future(handle.next())
            done, _ = await asyncio.wait({nxt, gone}, timeout=left,
                                         return_when=asyncio.FIRST_COMPLETED)
            if nxt not in done:
                nxt.cancel()
                if gone in done:
                    return None  # nobody to answer; `finally` aborts the request
                raise _timeout_error(limits.request_timeout_s)
            out = nxt.result()
            if out.finished:
                return out
    finally:
        gone.cancel()
        if not handle.finished:
            aengine.abort(handle.request_id)
            metrics.aborted.inc()


async def _sse(streamer, handle: RequestHandle, aengine: AsyncEngine, metrics: "ServerMetrics",
               deadline: float, limits):
    """Server-sent events: one chunk per generated token (its text may be "" while held back),
    the finish reason on the last, then usage (if asked for) and ``[DONE]``."""

    def event(obj: dict) -> bytes:
        return b"data: " + json_bytes(obj) + b"\n\n"

    n = 0
    try:
        for first in streamer.first():
            yield event(first)
        while True:
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise asyncio.TimeoutError
                out = await handle.next(timeout=left)
            except asyncio.TimeoutError:
                yield event(_timeout_error(limits.request_timeout_s).body())
                break
            except APIError as err:
                yield event(err.body())
                break
            n = len(out.token_ids)
            yield event(streamer.step(out))
            if out.finished:
                if streamer.req.include_usage:
                    yield event(streamer.usage(n))
                break
        yield b"data: [DONE]\n\n"
    finally:  # also runs when the client disconnects (the generator is cancelled)
        if not handle.finished:
            aengine.abort(handle.request_id)
            metrics.aborted.inc()


# ---- in-process server ---------------------------------------------------------------------
def server_config(app, *, max_connections: int = MAX_CONNECTIONS, log_level: str = "warning",
                  **kwargs):
    """The `uvicorn.Config` for `app`: the h11 protocol with the app's header deadline and size
    limit, at most `max_connections` connections, a graceful shutdown of 2 s. `kwargs`: more
    uvicorn options (``host``, ``port``, ...)."""
    import uvicorn

    if isinstance(max_connections, bool) or not isinstance(max_connections, int) \
            or max_connections < 1:
        raise ValueError(f"max_connections must be a positive integer, got {max_connections!r}")
    limit = app.state.max_header_bytes
    return uvicorn.Config(app, http=h11_protocol(app.state.read_timeout_s, limit),
                          log_level=log_level, h11_max_incomplete_event_size=limit,
                          limit_concurrency=max_connections, timeout_graceful_shutdown=2,
                          lifespan="on", **kwargs)


def _free_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


_APP_OPTIONS = ("model_root", "max_model_len", "max_tokens", "request_timeout_s", "max_waiting",
                "api_key", "allowed_hosts", "scheduling_policy", "read_timeout_s",
                "max_body_bytes", "max_header_bytes", "threads", "engine_in", "replicas")


@contextlib.contextmanager
def running_server(model=None, tokenizer=None, *, engine: Any = None,
                   model_name: str = "minifer", host: str = DEFAULT_HOST, port: int = 0,
                   max_connections: int = MAX_CONNECTIONS, log_level: str = "warning",
                   startup_timeout_s: float = 30.0, **options) -> Iterator[str]:
    """Serve in a background thread; yields the base URL (``http://127.0.0.1:PORT``).

    Give a model (and tokenizer) plus `LLMEngine` options, or a ready `engine` (to look at its
    scheduler and blocks afterwards). Server options (`create_app`'s: ``max_waiting``,
    ``api_key``, ``scheduling_policy``, ...) go to the app, the rest to `LLMEngine`. ``port=0``
    picks a free port. The server is always stopped when the block ends, even if it raised::

        with running_server(model, tok, model_name="shakespeare", max_num_seqs=8) as url:
            httpx.post(f"{url}/v1/completions", json={"model": "shakespeare", "prompt": "ROMEO:"})
    """
    import uvicorn

    app_options = {k: options.pop(k) for k in _APP_OPTIONS if k in options}
    if engine is None:
        if model is None:
            raise ValueError("give a model (and tokenizer) or a ready engine=")
        from .engine import LLMEngine

        engine = LLMEngine(model, tokenizer, **options)
    elif options or model is not None:
        raise ValueError("give either engine= or a model with engine options, not both; "
                         f"unknown server options: {sorted(options)}")
    if "allowed_hosts" not in app_options and host not in LOOPBACK_HOSTS:
        app_options["allowed_hosts"] = None  # bound to a network address: its names are many
    app = create_app(engine, model_name=model_name, **app_options)
    sock = _free_socket(host, port)
    server = uvicorn.Server(server_config(app, max_connections=max_connections,
                                          log_level=log_level))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                              name="minifer-http", daemon=True)
    thread.start()
    try:
        t0 = time.monotonic()
        while not server.started:
            if not thread.is_alive() or time.monotonic() - t0 > startup_timeout_s:
                raise RuntimeError("the server did not start (see the log above)")
            time.sleep(0.01)
        bound_host, bound_port = sock.getsockname()[:2]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        yield f"http://{shown}:{bound_port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()
