"""An OpenAI-compatible HTTP server on the serving engine (FastAPI + uvicorn, as vLLM uses).

`create_app` puts the routes (`minifer.serve.routes`: a request's path, claims REQ-1 and REQ-3)
behind the limits (MET-5) and guards (`minifer.serve.guard`); `make_server` serves them and
drains on shutdown. FastAPI and uvicorn are imported only when a server is built."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

from ..chat_template import MAX_TEMPLATE_CHARS, TEMPLATE_TIMEOUT_S, TemplateSandbox
from ..checks import check_int, check_number
from ..distributed.engine_process import ENGINES
from ..distributed.replicas import EngineReplicas
from ..engine.async_engine import DEFAULT_MAX_WAITING, AsyncEngine, engine_max_model_len
from .guard import (
    LOOPBACK_HOSTS,
    MAX_BODY_BYTES,
    MAX_HEADER_BYTES,
    READ_TIMEOUT_S,
    Guard,
    h11_protocol,
)
from .prometheus import ServerMetrics

__all__ = ["create_app", "server_config", "make_server", "ServerMetrics",
           "DEFAULT_HOST", "LOOPBACK_HOSTS", "SHUTDOWN_GRACE_S"]

log = logging.getLogger("minifer.serve")

DEFAULT_HOST = "127.0.0.1"  # loopback only: exposing a server to a network is a deliberate choice
MAX_CONNECTIONS = 512  # connections (and requests in flight) at once; more get 503
SHUTDOWN_GRACE_S = 30.0  # on SIGTERM, requests in flight have this long to finish
SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's --scheduling-policy

def create_app(engine: Any, *, model_name: str = "minifer", model_root: str | None = None,
               max_model_len: int | None = None, max_tokens: int | None = None,
               request_timeout_s: float = 120.0, max_waiting: int = DEFAULT_MAX_WAITING,
               api_key: str | None = None, allowed_hosts: Sequence[str] | None = LOOPBACK_HOSTS,
               scheduling_policy: str = "fcfs", read_timeout_s: float = READ_TIMEOUT_S,
               max_body_bytes: int = MAX_BODY_BYTES, max_header_bytes: int = MAX_HEADER_BYTES,
               threads: int | str | None = None, engine_in: str = "thread", replicas: int = 1,
               chat_template_timeout_s: float = TEMPLATE_TIMEOUT_S,
               chat_template_max_chars: int = MAX_TEMPLATE_CHARS):
    """A FastAPI app serving `engine` (an `LLMEngine`) as model `model_name`.

    Limits (claim MET-5): `max_model_len` (prompt + max_tokens - 1; default: what the engine can
    hold), `max_tokens` (default: `max_model_len`), `request_timeout_s` per request from its
    arrival, `max_waiting` requests waiting for their first step (past it: 429). Guards:
    `api_key` (``Authorization: Bearer``), `allowed_hosts` (None or ``["*"]``: any),
    `read_timeout_s`, `max_body_bytes`, `max_header_bytes`. `scheduling_policy`: ``"fcfs"``
    refuses a non-zero ``priority``. `model_root`: the model's source in ``/v1/models``.
    `threads`: torch's CPU threads for the steps (None, a number or ``"auto"``). `engine_in`:
    where the engine steps, ``"thread"`` (`AsyncEngine`) or ``"process"`` (`EngineReplicas`:
    restarted when it dies; a thread, after a warning, where it cannot start), for the app's
    lifespan. `replicas`: that many engine processes sharing ``max_num_seqs`` and the KV pool.
    Chat templates render in a `TemplateSandbox` (`chat_template_timeout_s`, `_max_chars`)."""
    from fastapi import FastAPI

    from . import routes
    from .protocol import Limits

    check_server_options(engine, max_model_len=max_model_len, engine_in=engine_in,
                         replicas=replicas, scheduling_policy=scheduling_policy,
                         api_key=api_key, read_timeout_s=read_timeout_s,
                         max_body_bytes=max_body_bytes, max_header_bytes=max_header_bytes)
    max_model_len = engine_max_model_len(engine) if max_model_len is None else max_model_len
    limits = Limits(max_model_len, max_model_len if max_tokens is None else max_tokens,
                    request_timeout_s)
    tokenizer = getattr(engine, "tokenizer", None)
    vocab_size = engine.model.config.vocab_size
    vocab_size = vocab_size if tokenizer is None else min(vocab_size, tokenizer.vocab_size)
    aengine = _engine_loop(engine, engine_in=engine_in, replicas=replicas,
                           max_waiting=max_waiting, threads=threads, max_model_len=max_model_len)
    metrics = ServerMetrics(aengine)
    aengine.on_finish = metrics.on_finish
    app = FastAPI(title="minifer", version="0.1.0", lifespan=_running(aengine),
                  summary="OpenAI-compatible completions and chat on minifer's serving engine")
    priorities = scheduling_policy == "priority"
    app.state.server = routes.ServerState(
        engine=engine, async_engine=aengine, metrics=metrics, limits=limits,
        model_name=model_name, card=_model_card(model_name, model_root, max_model_len),
        tokenizer=tokenizer, vocab_size=vocab_size, priorities=priorities,
        templates=TemplateSandbox(timeout_s=chat_template_timeout_s,
                                  max_chars=chat_template_max_chars))
    app.state.read_timeout_s, app.state.max_header_bytes = float(read_timeout_s), max_header_bytes
    app.add_middleware(Guard, metrics=metrics, api_key=api_key, allowed_hosts=_hosts(allowed_hosts),
                       max_body_bytes=int(max_body_bytes), max_header_bytes=int(max_header_bytes),
                       read_timeout_s=float(min(read_timeout_s, request_timeout_s)))
    routes.add_error_handlers(app)
    app.include_router(routes.router)
    _document_this_server(app, model_name, limits.max_tokens, vocab_size, priorities)
    return app


def _running(aengine):
    """The app's lifespan: the engine loop (and the template sandbox) runs while the app does."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        aengine.start()
        try:
            yield
        finally:
            aengine.stop()
            app.state.server.templates.close()

    return lifespan


def _model_card(model_name: str, model_root: str | None, max_model_len: int):
    """What ``/v1/models`` says of the one model served (`model_root`: its source)."""
    from . import schema as S

    created = int(time.time())
    return S.ModelCard(id=model_name, created=created, root=model_root or model_name,
                       max_model_len=max_model_len, permission=[S.ModelPermission(
                           id=f"modelperm-{model_name}", created=created)])


def check_server_options(engine: Any, *, max_model_len, engine_in, replicas, scheduling_policy,
                         api_key, read_timeout_s, max_body_bytes, max_header_bytes) -> None:
    """ValueError naming the first of `create_app`'s options that is out of range."""
    ceiling = engine_max_model_len(engine)
    if max_model_len is not None:
        check_int("max_model_len", max_model_len, 1, ceiling, why=" (the most this engine can hold)")
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
        check_number(name, v, gt=0, finite=True)


def _hosts(allowed_hosts: Sequence[str] | str | None) -> frozenset[str] | None:
    """The Host names the guard lets in (None: any)."""
    if isinstance(allowed_hosts, str):
        allowed_hosts = [allowed_hosts]
    if allowed_hosts is None or "*" in allowed_hosts:
        return None
    return frozenset(h.strip().lower().strip("[]") for h in allowed_hosts)


def _engine_loop(engine: Any, *, engine_in: str, replicas: int, max_waiting: int, threads,
                 max_model_len: int):
    """Where the engine steps: a thread, or engine processes (one or more replicas), each
    restarted when it dies (`EngineReplicas`)."""
    if engine_in == "process":
        return EngineReplicas(engine, replicas, max_waiting=max_waiting, threads=threads,
                              blocks_needed=-(-max_model_len // engine.block_manager.block_size),
                              fallback=True)
    return AsyncEngine(engine, max_waiting=max_waiting, threads=threads)


def _bound_ints(schema: Any, **bounds: int) -> None:
    """Every integer in a JSON schema fragment gets `bounds` (``maximum``, ``minimum``)."""
    if isinstance(schema, dict):
        if schema.get("type") == "integer":
            schema.update(bounds)
        for value in schema.values():
            _bound_ints(value, **bounds)
    elif isinstance(schema, list):
        for value in schema:
            _bound_ints(value, **bounds)


def _document_this_server(app, model_name: str, max_tokens: int, vocab_size: int,
                          priorities: bool) -> None:
    """The schema of this server: its model name, ``max_tokens`` limit, vocabulary and (first
    come, first served) ``priority`` 0 in the bodies, without FastAPI's 422 (400s here)."""
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
                    _bound_ints(props.get(field), maximum=max_tokens)
                _bound_ints(props.get("prompt"), maximum=vocab_size - 1)  # token ids
                if not priorities:  # refused unless 0 (or null)
                    _bound_ints(props.get("priority"), minimum=0, maximum=0)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


# ---- in-process server ---------------------------------------------------------------------
def server_config(app, *, max_connections: int = MAX_CONNECTIONS, log_level: str = "warning",
                  shutdown_grace_s: float = SHUTDOWN_GRACE_S, **kwargs):
    """The `uvicorn.Config` for `app`: `h11_protocol`, at most `max_connections` connections, a
    graceful shutdown of `shutdown_grace_s`; `kwargs`: more uvicorn options (``host``, ...)."""
    import uvicorn

    check_int("max_connections", max_connections, 1)
    check_number("shutdown_grace_s", shutdown_grace_s, gt=0, finite=True)
    limit = app.state.max_header_bytes
    return uvicorn.Config(app, http=h11_protocol(app.state.read_timeout_s, limit),
                          log_level=log_level, h11_max_incomplete_event_size=limit,
                          limit_concurrency=max_connections,
                          timeout_graceful_shutdown=shutdown_grace_s, lifespan="on", **kwargs)


def make_server(config):
    """A `uvicorn.Server` for `config` whose shutdown (SIGTERM, Ctrl-C, ``should_exit``) drains:
    no new connections, the requests in flight have ``timeout_graceful_shutdown`` to finish,
    and a moment before it ends each open stream gets an error event and ``[DONE]`` and each
    waiting answer a 503: no client sees its connection simply cut."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            grace = float(self.config.timeout_graceful_shutdown or 0)
            state = getattr(getattr(self.config.app, "state", None), "server", None)
            if state is not None:
                state.draining_until = time.monotonic() + grace - min(1.0, grace / 2)
            await super().shutdown(sockets)

    return Server(config)
