"""The server's routes, one function per endpoint, and how each error becomes a JSON reply.

Each route reads `ServerState` from ``app.state``. A POST body is checked in a worker thread
(`protocol`), then `generate` answers whole (`collect`) or as server-sent events
(`stream_events`). FastAPI is imported at the top: this module only when a server is built."""

# no `from __future__ import annotations`: FastAPI resolves the handlers' annotations itself

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..engine.errors import APIError
from . import protocol as P
from . import replies as R
from . import schema as S
from .guard import json_bytes

__all__ = ["router", "ServerState", "add_error_handlers"]


@dataclass
class ServerState:
    """What every route reads (``request.app.state.server``)."""

    engine: Any  # the `LLMEngine` the server was built on (its tokenizer, its model)
    async_engine: Any  # where requests go: `AsyncEngine`, `EngineProcess` or `EngineReplicas`
    metrics: Any  # `ServerMetrics`
    limits: P.Limits
    model_name: str
    card: S.ModelCard
    tokenizer: Any
    vocab_size: int
    priorities: bool  # whether ``priority`` is honoured (``--scheduling-policy priority``)
    templates: Any  # `TemplateSandbox`: renders chat templates within their limits

    draining_until: float | None = None  # shutting down: answers end by then (monotonic)

    def cut_short(self) -> bool:
        """Whether the shutdown's grace is over for the answers still open."""
        return self.draining_until is not None and time.monotonic() >= self.draining_until

    def parse_options(self) -> dict:
        """The server-dependent arguments of `protocol`'s parse functions."""
        return dict(model_name=self.model_name, limits=self.limits, tokenizer=self.tokenizer,
                    vocab_size=self.vocab_size, priorities=self.priorities)


def state(request: Request) -> ServerState:
    return request.app.state.server


def reply(err: APIError) -> Response:
    return Response(json_bytes(err.body()), status_code=err.status, headers=err.headers,
                    media_type="application/json")


# ---- the error responses, as the schema documents them ----------------------------------
ERRORS = {status: {"model": S.ErrorResponse, "description": what} for status, what in (
    (400, "Bad request: the error names the parameter"),
    (401, "Missing or wrong API key (when the server has one)"),
    (408, "The body did not arrive in time, or the request ran past its timeout"),
    (413, "The body is too large"), (415, "The body is not JSON"),
    (431, "The headers are too large"),
    (429, "Too many requests waiting; retry after Retry-After seconds"),
    (500, "A server error (the server keeps serving)"),
    (503, "The engine is not running"))}
ERRORS[429]["headers"] = {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}}
ERRORS[401]["headers"] = {"WWW-Authenticate": {"schema": {"type": "string"}}}
COMMON = {s: ERRORS[s] for s in (400, 401, 431, 500)}
SSE = {"text/event-stream": {"schema": {  # one event (Open API before 3.2: `schema`)
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "description": "With stream: true, one event per token whose data is a chunk in JSON "
                   "(a CompletionResponse or a chat.completion.chunk with the new text), "
                   "then `data: [DONE]`"}}}
POST_ERRORS = {**ERRORS, 200: {"content": SSE}}

router = APIRouter()


# ---- GET: what the server is and how it is doing -----------------------------------------
@router.get("/health", response_model=S.Health, responses={503: ERRORS[503], **COMMON},
            response_model_exclude_none=True, summary="200 while the engine loop runs")
async def health(request: Request):
    aengine = state(request).async_engine
    if not aengine.alive:
        return reply(APIError(503, "the engine loop is not running", type="server_error"))
    counts = getattr(aengine, "replicas_alive", None)  # `EngineReplicas`
    if counts is None:
        return {"status": "ok"}
    live, total = counts
    return {"status": "ok" if live == total else "degraded", "replicas": total,
            "replicas_alive": live}


@router.head("/health", include_in_schema=False)
async def health_head(request: Request):
    """``HEAD /health``: the status of ``GET /health`` without a body (load balancers)."""
    return Response(status_code=503 if not state(request).async_engine.alive else 200)


@router.get("/v1/models", response_model=S.ModelList, responses=COMMON, summary="The served model")
async def models(request: Request):
    return {"object": "list", "data": [state(request).card.model_dump()]}


@router.get("/v1/models/{model_id}", response_model=S.ModelCard,
            responses={404: {"model": S.ErrorResponse, "description": "No such model"},
                       **COMMON}, summary="One served model")
async def model(model_id: str, request: Request):
    name = state(request).model_name
    if model_id != name:
        return reply(APIError(404, f"the model {model_id!r:.80} does not exist; this server "
                              f"serves {name!r}", param="model", code="model_not_found"))
    return state(request).card.model_dump()


@router.get("/metrics", response_class=PlainTextResponse, responses={
    200: {"content": {"text/plain": {"schema": {"type": "string"}}},
          "description": "Prometheus text format"}, **COMMON}, summary="Prometheus metrics")
async def prometheus(request: Request):
    from prometheus_client import CONTENT_TYPE_LATEST

    return PlainTextResponse(state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


# ---- POST: completions and chat ------------------------------------------------------------
# Checking a body would stall every stream: in worker threads (a chat's render: its own threads).
CHAT_THREADS = ThreadPoolExecutor(32, thread_name_prefix="minifer-chat")
@router.post("/v1/completions", response_model=S.CompletionResponse, responses=POST_ERRORS,
             summary="OpenAI's completions API")
async def completions(body: P.CompletionBody, request: Request):
    s = state(request)
    reqs = await asyncio.to_thread(P.parse_completion_requests, body, **s.parse_options())
    return await generate(reqs, request)


@router.post("/v1/chat/completions", response_model=S.ChatCompletionResponse,
             responses=POST_ERRORS, summary="OpenAI's chat completions API (minifer.play_chat)")
async def chat_completions(body: P.ChatCompletionBody, request: Request):
    s = state(request)
    arrival = request.scope.get("minifer.arrival", time.monotonic())
    render = partial(s.templates.render, deadline=arrival + s.templates.timeout_s)
    req = await asyncio.get_running_loop().run_in_executor(CHAT_THREADS, partial(
        P.parse_chat_request, body, render=render, **s.parse_options()))
    return await generate([req], request)


async def generate(reqs: list, request: Request):
    """Hand checked requests (one per prompt) to the engine at once; answer whole or streamed."""
    s = state(request)
    deadline = request.scope.get("minifer.arrival", time.monotonic()) + s.limits.request_timeout_s
    handles = await _add_all(reqs, s, deadline)
    if reqs[0].stream:
        streams = [(R.Streamer(req, s.tokenizer, h.prompt_logprobs), h)
                   for req, h in zip(reqs, handles)]
        return StreamingResponse(stream_events(streams, s, deadline),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    outs = await collect(handles, s, deadline, request)
    if outs is None:  # the client left; nobody reads this
        return Response(status_code=204)
    return R.merge_bodies([R.reply_body(req, out, s.tokenizer, h.prompt_logprobs)
                           for req, out, h in zip(reqs, outs, handles)])


async def _add_all(reqs: list, s: ServerState, deadline: float) -> list:
    """Every request added to the engine, or none: the first refusal aborts the others."""
    async def add(req):
        return await s.async_engine.add(
            req.prompt_ids, req.params, req.priority,
            prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None else None,
            **req.engine_options())

    tasks = [asyncio.ensure_future(add(req)) for req in reqs]
    try:  # (the engine did not even take them in time: a timeout)
        await asyncio.wait_for(asyncio.gather(*tasks), max(deadline - time.monotonic(), 0.001))
    except BaseException as err:
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is None:
                s.async_engine.abort(t.result().request_id)
            t.cancel()
        if isinstance(err, asyncio.TimeoutError):
            raise timeout_error(s.limits.request_timeout_s) from None
        raise
    return [t.result() for t in tasks]


def timeout_error(limit_s: float) -> APIError:
    return APIError(408, f"the request ran past the server's per-request timeout of "
                    f"{limit_s:g} s and was aborted", type="timeout_error", code="timeout")


async def _until_disconnect(receive) -> None:
    """Return when the client hangs up (the body is already read: only a disconnect is left)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _abort_unfinished(handles, s: ServerState) -> None:
    for handle in handles:
        if not handle.finished:
            s.async_engine.abort(handle.request_id)
            s.metrics.aborted.inc()


POLL_S = 0.25  # how often a waiting answer looks whether the server is shutting down


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down and its grace period for requests in "
                    "flight ended; retry on another server or after it restarts",
                    type="server_error", code="shutting_down")


async def collect(handles: list, s: ServerState, deadline: float, request: Request):
    """The last `RequestOutput` of each request, or None if the client left; aborted as soon as
    the client leaves, the timeout passes or the shutdown grace ends."""
    gone = asyncio.ensure_future(_until_disconnect(request.receive))
    outs, nxt = [], None
    try:
        for handle in handles:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise timeout_error(s.limits.request_timeout_s)
                if s.cut_short():
                    raise shutting_down()
                nxt = asyncio.ensure_future(handle.next()) if nxt is None else nxt
                done, _ = await asyncio.wait({nxt, gone}, timeout=min(left, POLL_S),
                                             return_when=asyncio.FIRST_COMPLETED)
                if nxt in done:
                    out, nxt = nxt.result(), None
                    if out.finished:
                        outs.append(out)
                        break
                elif gone in done:
                    return None  # nobody to answer; `finally` aborts the requests
        return outs
    finally:
        gone.cancel()
        if nxt is not None:
            nxt.cancel()
        _abort_unfinished(handles, s)


def event(obj: dict) -> bytes:
    """One server-sent event."""
    return b"data: " + json_bytes(obj) + b"\n\n"


async def _events(streamer, handle, s: ServerState, deadline: float, sent: list[int]):
    """One request's events: a chunk per token (text "" while held back), the finish reason on
    the last, or an error event early. `sent`: its count of tokens (for usage)."""
    for first in streamer.first():
        yield event(first)
    while True:
        left = deadline - time.monotonic()
        if s.cut_short():
            yield event(shutting_down().body())
            return
        try:
            if left <= 0:
                raise asyncio.TimeoutError
            out = await handle.next(timeout=min(left, POLL_S))
        except asyncio.TimeoutError:
            if left > POLL_S:
                continue  # only a look at the shutdown
            yield event(timeout_error(s.limits.request_timeout_s).body())
            return
        except APIError as err:
            yield event(err.body())
            return
        sent[0] = 0 if streamer.req.score_only else len(out.token_ids)
        yield event(streamer.step(out))
        if out.finished:
            return


async def stream_events(streams: list, s: ServerState, deadline: float):
    """Server-sent events of every request (a list of prompts: their chunks interleaved as
    they come, each naming its choice's index), then usage (if asked for) and ``[DONE]``."""
    counts = [[0] for _ in streams]
    gens = [_events(st, h, s, deadline, n) for (st, h), n in zip(streams, counts)]
    try:
        if len(gens) == 1:  # one prompt: its events as they come
            async for chunk in gens[0]:
                yield chunk
        else:
            async for chunk in _merge(gens):
                yield chunk
        first = streams[0][0]
        if first.req.include_usage:
            yield event(first.usage(sum(n[0] for n in counts),
                                    sum(len(st.req.prompt_ids) for st, _ in streams)))
        yield b"data: [DONE]\n\n"
    finally:  # also runs when the client disconnects (the generator is cancelled)
        _abort_unfinished([h for _, h in streams], s)


async def _merge(gens: list):
    """The items of several async generators, in the order they come."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(gen) -> None:
        try:
            async for item in gen:
                await queue.put(item)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(g)) for g in gens]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()


# ---- errors --------------------------------------------------------------------------------
async def on_api_error(request: Request, err: APIError):
    return reply(err)


async def on_invalid(request: Request, err: RequestValidationError):
    model = P.ChatCompletionBody if request.url.path.endswith("/chat/completions") \
        else P.CompletionBody
    return reply(P.validation_error(err.errors(), model))


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


def add_error_handlers(app) -> None:
    """Every error as one OpenAI-style JSON body: ours, FastAPI's validation, Starlette's."""
    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_invalid)
    app.add_exception_handler(HTTPException, on_http_error)
