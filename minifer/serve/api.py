"""An OpenAI-compatible HTTP server on the serving engine (FastAPI + uvicorn, as vLLM uses).

Endpoints:

- ``POST /v1/completions`` — OpenAI's completions API (see `protocol` for the fields), answered
  whole or streamed as server-sent events (``data: {...}`` per token, then ``data: [DONE]``);
- ``GET /v1/models`` — the one served model; ``GET /health`` — 200 while the engine loop runs;
- ``GET /metrics`` — Prometheus text: running and waiting requests, KV blocks used, prefix-cache
  hit rate, TTFT / TPOT / E2EL histograms, token and request counters.

A request's path (claim REQ-1): the handler checks the JSON body (bad input → 400 naming the
parameter), tokenizes the prompt, and hands it to the `AsyncEngine` thread, which adds it to the
engine and runs ``engine.step()`` while anything is unfinished; each step's `RequestOutput`
reaches the handler's queue and leaves as an SSE chunk at once. At the end the server reports
usage and the engine frees the request's KV blocks (REQ-3). Limits (MET-5): the context window,
``max_tokens``, a per-request timeout, a bounded waiting queue (429 past it); a client that
disconnects mid-stream aborts its request, which frees its blocks.

From Python or a notebook, `running_server` starts the server in a background thread on a free
loopback port and always stops it. From a shell: ``python -m minifer.serve --model shakespeare``.
FastAPI, uvicorn and prometheus_client (the ``serve`` extra) are imported only when a server is
built, so ``import minifer`` never needs them.
"""

# no `from __future__ import annotations` here: FastAPI reads the handlers' annotations
# (`request: Request`) at definition time, and Request is imported inside create_app.

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from .async_engine import AsyncEngine, RequestHandle, engine_max_model_len
from .protocol import (
    APIError,
    CompletionRequest,
    Limits,
    chunk_body,
    completion_body,
    error_body,
    parse_completion_request,
    usage_body,
)

__all__ = ["create_app", "running_server", "ServerMetrics", "DEFAULT_HOST"]

MAX_BODY_BYTES = 1 << 20  # a request body larger than 1 MiB is refused (413)
DEFAULT_HOST = "127.0.0.1"  # loopback only: exposing a server to a network is a deliberate choice

# histogram buckets (seconds), spaced like vLLM's
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5)
E2EL_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                60.0, 120.0)


class ServerMetrics:
    """The server's Prometheus metrics, in a registry of its own (several servers may share a
    process, as in tests). Gauges are read from the engine at scrape time."""

    def __init__(self, async_engine: AsyncEngine) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.async_engine = async_engine
        r = self.registry
        self.ttft = Histogram("minifer_time_to_first_token_seconds", "Time to first token "
                              "(arrival to first token, queueing included)", buckets=TTFT_BUCKETS,
                              registry=r)
        self.tpot = Histogram("minifer_time_per_output_token_seconds", "Time per output token "
                              "after the first, per request", buckets=TPOT_BUCKETS, registry=r)
        self.e2el = Histogram("minifer_e2e_request_latency_seconds", "End-to-end request latency",
                              buckets=E2EL_BUCKETS, registry=r)
        self.queue = Histogram("minifer_request_queue_time_seconds", "Arrival to first scheduled "
                               "step", buckets=TTFT_BUCKETS, registry=r)
        self.finished = Counter("minifer_request_success", "Finished requests, by OpenAI "
                                "finish_reason", ["finish_reason"], registry=r)
        self.aborted = Counter("minifer_request_aborted", "Requests aborted (client gone, "
                               "timeout)", registry=r)
        self.rejected = Counter("minifer_request_rejected", "Requests refused, by HTTP status",
                                ["status"], registry=r)
        self.prompt_tokens = Counter("minifer_prompt_tokens", "Prompt tokens of finished "
                                     "requests", registry=r)
        self.generation_tokens = Counter("minifer_generation_tokens", "Tokens generated",
                                         registry=r)
        r.register(_EngineGauges(async_engine))

    def on_finish(self, out: Any) -> None:
        """Record a finished request's metrics (called in the engine thread)."""
        from .protocol import openai_finish_reason

        m = out.metrics
        self.finished.labels(openai_finish_reason(out.finish_reason) or "unknown").inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(len(out.token_ids))
        for hist, value in ((self.ttft, m.ttft), (self.e2el, m.e2el), (self.tpot, m.tpot),
                            (self.queue, m.queue_time)):
            if value == value:  # not nan
                hist.observe(value)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class _EngineGauges:
    """A Prometheus collector that reads the engine's queues and KV pool when scraped."""

    GAUGES = {
        "running": ("minifer_num_requests_running", "Requests holding KV blocks and being run"),
        "waiting": ("minifer_num_requests_waiting", "Requests in the engine's waiting queue "
                    "(not started, or preempted)"),
        "unstarted": ("minifer_num_requests_unstarted", "Requests accepted that have no token "
                      "yet (what --max-waiting bounds)"),
        "blocks_used": ("minifer_kv_blocks_used", "KV-cache blocks in use"),
        "blocks_total": ("minifer_kv_blocks_total", "KV-cache blocks in the pool"),
        "kv_usage": ("minifer_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use"),
        "prefix_cache_hit_rate": ("minifer_prefix_cache_hit_rate", "Fraction of looked-up full "
                                  "prompt blocks found in the prefix cache"),
        "preemptions": ("minifer_num_preemptions", "Preemptions so far"),
    }

    def __init__(self, async_engine: AsyncEngine) -> None:
        self.async_engine = async_engine

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        stats = dict(self.async_engine.stats)
        stats["unstarted"] = self.async_engine.num_waiting
        for key, (name, doc) in self.GAUGES.items():
            if key in stats:
                yield GaugeMetricFamily(name, doc, value=float(stats[key]))


def create_app(engine: Any, *, model_name: str = "minifer", max_model_len: int | None = None,
               max_tokens: int | None = None, request_timeout_s: float = 120.0,
               max_waiting: int = 64):
    """A FastAPI app serving `engine` (an `LLMEngine`) as model `model_name`.

    Limits (claim MET-5): `max_model_len` (prompt + max_tokens - 1; default: what the engine can
    ever hold), `max_tokens` (default: `max_model_len`), `request_timeout_s` per request,
    `max_waiting` requests waiting for their first step (past it: 429). The engine thread starts
    and stops with the app (its lifespan).
    """
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    ceiling = engine_max_model_len(engine)
    max_model_len = ceiling if max_model_len is None else max_model_len
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) \
            or not 1 <= max_model_len <= ceiling:
        raise ValueError(f"max_model_len must be an integer in [1, {ceiling}] (the most this "
                         f"engine can hold), got {max_model_len!r}")
    limits = Limits(max_model_len, max_model_len if max_tokens is None else max_tokens,
                    request_timeout_s)
    tokenizer = getattr(engine, "tokenizer", None)
    vocab_size = engine.model.config.vocab_size
    if tokenizer is not None:
        vocab_size = min(vocab_size, tokenizer.vocab_size)
    created = int(time.time())

    aengine = AsyncEngine(engine, max_waiting=max_waiting)
    metrics = ServerMetrics(aengine)
    aengine.on_finish = metrics.on_finish

    @contextlib.asynccontextmanager
    async def lifespan(app):
        aengine.start()
        try:
            yield
        finally:
            aengine.stop()

    app = FastAPI(title="minifer", summary="OpenAI-compatible completions on minifer's "
                  "serving engine", lifespan=lifespan)
    app.state.engine, app.state.async_engine, app.state.metrics = engine, aengine, metrics
    app.state.limits, app.state.model_name = limits, model_name

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, err: APIError):
        metrics.rejected.labels(str(err.status)).inc()
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, err: HTTPException):
        return JSONResponse(error_body(str(err.detail), type="invalid_request_error"),
                            status_code=err.status_code)

    @app.exception_handler(Exception)
    async def on_error(request: Request, err: Exception):  # a bug: say so, keep serving
        return JSONResponse(error_body(f"internal error: {type(err).__name__}: {err}",
                                       type="server_error"), status_code=500)

    @app.get("/health")
    async def health():
        if not aengine.alive:
            return JSONResponse(error_body("the engine loop is not running", type="server_error"),
                                status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": created, "owned_by": "minifer",
                                            "max_model_len": limits.max_model_len}]}

    @app.get("/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST

        return PlainTextResponse(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request):
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > MAX_BODY_BYTES:
                raise APIError(413, f"the request body is larger than {MAX_BODY_BYTES:,} bytes",
                               code="body_too_large")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
            raise APIError(400, f"the request body is not valid JSON: {err}",
                           code="invalid_json") from None
        req = parse_completion_request(body, model_name=model_name, limits=limits,
                                       tokenizer=tokenizer, vocab_size=vocab_size)
        deadline = time.monotonic() + limits.request_timeout_s
        try:
            handle = await asyncio.wait_for(aengine.add(req.prompt_ids, req.params,
                                                        req.priority), limits.request_timeout_s)
        except asyncio.TimeoutError:  # the engine did not even take it in time
            raise _timeout_error(limits.request_timeout_s) from None
        if req.stream:
            return StreamingResponse(_sse(req, handle, aengine, metrics, deadline, limits),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _collect(req, handle, aengine, metrics, deadline, request, limits)

    return app


def _timeout_error(limits_s: float) -> APIError:
    return APIError(408, f"the request ran past the server's per-request timeout of "
                    f"{limits_s:g} s and was aborted", type="timeout_error", code="timeout")


async def _collect(req: CompletionRequest, handle: RequestHandle, aengine: AsyncEngine,
                   metrics: ServerMetrics, deadline: float, request, limits: Limits) -> dict:
    """Wait for the whole answer; abort if the client leaves or the timeout passes."""
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _timeout_error(limits.request_timeout_s)
            try:
                out = await handle.next(timeout=min(left, 0.5))
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return {}  # nobody to answer; `finally` aborts the request
                continue
            if out.finished:
                return completion_body(req, out.text if out.text is not None else "",
                                       out.finish_reason, len(out.token_ids))
    finally:
        if not handle.finished:
            aengine.abort(handle.request_id)
            metrics.aborted.inc()


async def _sse(req: CompletionRequest, handle: RequestHandle, aengine: AsyncEngine,
               metrics: ServerMetrics, deadline: float, limits: Limits):
    """Server-sent events: one chunk per generated token (its text may be "" while held back),
    the finish reason on the last, then usage (if asked for) and ``[DONE]``."""

    def event(obj: dict) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    n = 0
    try:
        while True:
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise asyncio.TimeoutError
                out = await handle.next(timeout=left)
            except asyncio.TimeoutError:
                err = _timeout_error(limits.request_timeout_s)
                yield event(err.body())
                break
            except APIError as err:
                yield event(err.body())
                break
            n = len(out.token_ids)
            yield event(chunk_body(req, out.delta, out.finish_reason if out.finished else None))
            if out.finished:
                if req.include_usage:
                    yield event(chunk_body(req, None, usage=usage_body(len(req.prompt_ids), n)))
                break
        yield "data: [DONE]\n\n"
    finally:  # also runs when the client disconnects (the generator is cancelled)
        if not handle.finished:
            aengine.abort(handle.request_id)
            metrics.aborted.inc()


# ---- in-process server ---------------------------------------------------------------------
def _free_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


@contextlib.contextmanager
def running_server(model=None, tokenizer=None, *, engine: Any = None,
                   model_name: str = "minifer", host: str = DEFAULT_HOST, port: int = 0,
                   max_model_len: int | None = None, max_tokens: int | None = None,
                   request_timeout_s: float = 120.0, max_waiting: int = 64,
                   log_level: str = "warning", startup_timeout_s: float = 30.0,
                   **engine_options) -> Iterator[str]:
    """Serve in a background thread; yields the base URL (``http://127.0.0.1:PORT``).

    Give a model (and tokenizer) plus `LLMEngine` options, or a ready `engine` (to look at its
    scheduler and blocks afterwards). ``port=0`` picks a free port. The server is always
    stopped when the block ends, even if it raised::

        with running_server(model, tok, model_name="shakespeare", max_num_seqs=8) as url:
            httpx.post(f"{url}/v1/completions", json={"model": "shakespeare", "prompt": "ROMEO:"})
    """
    import uvicorn

    if engine is None:
        if model is None:
            raise ValueError("give a model (and tokenizer) or a ready engine=")
        from .engine import LLMEngine

        engine = LLMEngine(model, tokenizer, **engine_options)
    elif engine_options or model is not None:
        raise ValueError("give either engine= or a model with engine options, not both")
    app = create_app(engine, model_name=model_name, max_model_len=max_model_len,
                     max_tokens=max_tokens, request_timeout_s=request_timeout_s,
                     max_waiting=max_waiting)
    sock = _free_socket(host, port)
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=2,
                            lifespan="on")
    server = uvicorn.Server(config)
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
        yield f"http://{bound_host}:{bound_port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()
