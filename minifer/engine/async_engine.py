"""`AsyncEngine`: one thread owns the engine; asyncio handlers talk to it through queues.

An `LLMEngine` is not thread-safe and its `step()` blocks, so one background thread runs the
engine loop (`drive`, the model's only thread); each handler's `RequestHandle` receives its
outputs from there. Past `max_waiting` requests waiting for their first step, `add` refuses
with 429 (claim MET-5); a step that raises fails the requests in flight with a 500."""

from __future__ import annotations

import asyncio
import logging
import math
import re
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import hooks
from ..checks import check_int, check_threads
from .driver import drive
from .errors import APIError

__all__ = ["AsyncEngine", "RequestHandle", "engine_stats", "engine_max_model_len",
           "check_loop_options", "add_request", "add_failure", "step_failure", "request_failure",
           "score_prompt", "quietly", "settle", "shutting_down", "DEFAULT_MAX_WAITING",
           "RETRY_AFTER_S"]

log = logging.getLogger("minifer.serve")

DEFAULT_MAX_WAITING = 256  # requests that may wait for their first token; more get 429
RETRY_AFTER_S = 1  # the Retry-After of a 429 (seconds)


def engine_stats(engine: Any) -> dict[str, float]:
    """What the engine's scheduler and block manager say now (whatever of it they expose)."""
    stats: dict[str, float] = {}
    sch = getattr(engine, "scheduler", None)
    if sch is not None:
        stats["running"] = len(getattr(sch, "running", ()))
        stats["waiting"] = len(getattr(sch, "waiting", ()))
        stats["preemptions"] = getattr(sch, "num_preemptions", 0)
    bm = getattr(engine, "block_manager", None)
    if bm is not None:
        stats["blocks_total"] = bm.num_blocks
        stats["blocks_used"] = bm.num_used_blocks
        stats["kv_usage"] = bm.num_used_blocks / bm.num_blocks
        hit = getattr(bm, "hit_rate", math.nan)
        stats["prefix_cache_hit_rate"] = 0.0 if hit is None or math.isnan(hit) else hit
    return stats


def engine_max_model_len(engine: Any) -> int:
    """The most tokens (prompt + max_tokens - 1) one request can ever have on this engine: within
    the context window, the KV pool and, without chunked prefill, one step's token budget."""
    limit = getattr(getattr(engine, "config", None), "max_model_len", None) \
        or engine.model.config.context_length
    bm, sch = getattr(engine, "block_manager", None), getattr(engine, "scheduler", None)
    if bm is not None:
        limit = min(limit, bm.num_blocks * bm.block_size)
    if sch is not None and not getattr(sch, "chunked", True):
        limit = min(limit, sch.max_num_batched_tokens)
    return limit


@dataclass
class RequestHandle:
    """One request in flight: its id and the queue its outputs arrive on."""

    request_id: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False
    prompt_logprobs: list | None = None  # set before `add` returns, if they were asked for

    async def next(self, timeout: float | None = None):
        """The next `RequestOutput` (raises `APIError` if the engine failed, TimeoutError)."""
        item = await asyncio.wait_for(self.queue.get(), timeout)
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item


def queue_full(waiting: int, max_waiting: int) -> APIError:
    """The 429 a server answers when `max_waiting` requests already wait for their first token."""
    return APIError(429, f"server over capacity: {waiting} requests are already waiting for "
                    f"their first token (max_waiting={max_waiting}); retry in {RETRY_AFTER_S} s",
                    type="rate_limit_error", code="queue_full",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


class AsyncEngine:
    """Runs `engine.step()` in one background thread whenever there is work.

    `on_finish(output)` is called in the engine thread for every request's last output,
    `on_step()` after every step. `threads`: torch's CPU threads for the steps (None: torch's
    choice; ``"auto"``: the cores other programs leave free, between steps)."""

    id_prefix = "srv-"  # request ids are id_prefix + a count (`EngineReplicas` sets one each)

    def __init__(self, engine: Any, *, max_waiting: int = DEFAULT_MAX_WAITING,
                 on_finish: Callable[[Any], None] | None = None,
                 on_step: Callable[[], None] | None = None,
                 threads: int | str | None = None) -> None:
        check_loop_options(max_waiting, threads)
        self.threads = threads
        self.adjust_threads: Callable[[], int | None] = lambda: None  # `hooks.serving_threads`
        self.threads_in_force: int | None = None  # torch threads of the engine thread
        self.engine, self.max_waiting = engine, max_waiting
        self.on_finish, self.on_step = on_finish, on_step
        self._cv = threading.Condition()
        self._inbox: list[tuple] = []
        self._handles: dict[str, tuple[asyncio.AbstractEventLoop, RequestHandle]] = {}
        self._unstarted: set[str] = set()  # accepted, no token yet (guarded by _cv)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._counter = 0
        self.stats: dict[str, float] = engine_stats(engine)
        self.num_steps = 0
        self.num_step_errors = 0

    # ---- life ----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        self._thread = threading.Thread(target=self._run, name="minifer-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop (requests still in flight are aborted) and wait for the thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- called from the event loop --------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Requests accepted by the server that have not produced a token yet (queued in the
        inbox, waiting in the engine, or in their prefill): what admission control bounds."""
        with self._cv:
            return len(self._unstarted)

    @property
    def num_in_flight(self) -> int:
        """Requests accepted by the server and not finished (queued, waiting or running)."""
        with self._cv:
            return len(self._unstarted.union(self._handles))

    async def add(self, prompt, params, priority: int = 0, *,
                  prompt_logprobs: int | None = None, **options) -> RequestHandle:
        """Queue a request; its handle once the engine accepted it. `options` go to
        `engine.add_request`; `prompt_logprobs`: alternatives per prompt token. Raises `APIError`
        429 when `max_waiting` already wait, 400 when the engine rejects the request, 503 when
        the loop is not running."""
        if not self.alive or self._stopping:
            raise APIError(503, "the engine is not running", type="server_error",
                           code="engine_stopped")
        loop = asyncio.get_running_loop()
        accepted = loop.create_future()
        with self._cv:
            waiting = len(self._unstarted)
            if waiting >= self.max_waiting:
                raise queue_full(waiting, self.max_waiting)
            self._counter += 1
            rid = f"{self.id_prefix}{self._counter}"
            handle = RequestHandle(rid)
            self._unstarted.add(rid)
            self._inbox.append(("add", rid, prompt, params, priority, dict(options),
                                prompt_logprobs, loop, handle, accepted))
            self._cv.notify()
        try:
            await accepted  # raises the engine's rejection as an APIError
        except asyncio.CancelledError:  # the client left before the engine took the request
            self.abort(rid)
            raise
        return handle

    def abort(self, request_id: str) -> None:
        """Abort a request (client gone, timeout); its blocks are freed at the next iteration."""
        with self._cv:
            self._unstarted.discard(request_id)
            self._inbox.append(("abort", request_id))
            self._cv.notify()

    # ---- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        # set in this thread: torch's OpenMP count is per thread
        self.adjust_threads = hooks.serving_threads(self.threads)
        self.threads_in_force = torch.get_num_threads()
        drive(self.engine, self._take, self._stepped, self._step_failed)
        for rid in list(self._handles):  # shutting down: free everything still in flight
            self.engine.abort(rid)
            self._deliver(rid, shutting_down())
        self.stats = engine_stats(self.engine)

    def _take(self, idle: bool) -> bool:
        """`drive`'s intake: apply the inbox (waiting for it while idle); False once stopping."""
        self.stats = engine_stats(self.engine)
        with self._cv:
            while idle and not self._inbox and not self._stopping:
                self._cv.wait()
            if self._stopping:
                return False
            inbox, self._inbox = self._inbox, []
        for cmd in inbox:
            self._apply(cmd)
        if self.engine.has_unfinished() and (n := self.adjust_threads()):
            self.threads_in_force = n
        return True

    def _apply(self, cmd: tuple) -> None:
        if cmd[0] == "abort":
            rid = cmd[1]
            if self._handles.pop(rid, None) is not None:
                self.engine.abort(rid)
            return
        _, rid, prompt, params, priority, options, num_prompt_lp, loop, handle, accepted = cmd
        try:
            handle.prompt_logprobs = add_request(self.engine, rid, prompt, params, priority,
                                                 options, num_prompt_lp)
        except Exception as err:  # ValueError/TypeError: the engine says it can never run
            with self._cv:
                self._unstarted.discard(rid)
            loop.call_soon_threadsafe(settle, accepted, add_failure(err))
            return
        self._handles[rid] = (loop, handle)
        loop.call_soon_threadsafe(settle, accepted, None)

    def _stepped(self, outputs) -> None:
        self.num_steps += 1
        self._deliver_step(outputs)

    def _step_failed(self, err: Exception) -> None:
        """A step raised (no one request's failure): end every request in flight with a 500."""
        self.num_step_errors += 1
        log.error("engine step failed; aborting the requests in flight\n%s",
                  "".join(traceback.format_exception(err)))
        for rid in list(self._handles):
            self.engine.abort(rid)
            self._deliver(rid, step_failure(err))

    def _deliver_step(self, outputs) -> None:
        """A step's outputs to their handles (and the metrics callbacks)."""
        for out in outputs:
            if out.finished and self.on_finish is not None:
                quietly(self.on_finish, out)
            self._deliver(out.request_id, out)
        if self.on_step is not None:
            quietly(self.on_step)

    def _deliver(self, rid: str, item) -> None:
        with self._cv:
            self._unstarted.discard(rid)
        entry = self._handles.get(rid)
        if entry is None:
            return  # aborted by its handler meanwhile
        if not isinstance(item, BaseException) and item.finish_reason == "error":
            item = request_failure(item)
        if isinstance(item, BaseException) or item.finished:
            self._handles.pop(rid, None)
        loop, handle = entry
        try:
            loop.call_soon_threadsafe(handle.queue.put_nowait, item)
        except RuntimeError:  # its event loop is closed: nobody is listening any more
            self._handles.pop(rid, None)


def check_loop_options(max_waiting: int, threads: int | str | None) -> None:
    """`max_waiting` a positive integer; `threads` None, ``"auto"`` or a positive integer."""
    check_int("max_waiting", max_waiting, 1)
    check_threads(threads)


def add_request(engine: Any, rid: str, prompt, params, priority: int, options: dict,
                num_prompt_lp: int | None) -> list | None:
    """`engine.add_request`, then the prompt's logprobs if asked for (None if not); a request
    whose prompt cannot be scored is aborted again, with a RuntimeError."""
    engine.add_request(prompt, params, request_id=rid, priority=priority, **options)
    if num_prompt_lp is None:
        return None
    try:
        return score_prompt(engine, prompt, num_prompt_lp)
    except Exception:
        engine.abort(rid)
        raise RuntimeError("scoring the prompt failed") from None


def step_failure(err: Exception) -> APIError:
    """What the requests in flight hear when a step raised (they are aborted)."""
    return APIError(500, f"the engine failed: {type(err).__name__}: {err}", type="server_error",
                    code="engine_error")


def request_failure(out) -> APIError:
    """What a request hears when a step failed for it alone (finish reason "error"): a 500
    whose message names the request and the cause; every other request goes on."""
    return APIError(500, out.error or f"request {out.request_id!r} failed", type="server_error",
                    code="request_failed")


def shutting_down() -> APIError:
    """What the requests still in flight hear when the server stops (they are aborted)."""
    return APIError(503, "the server is shutting down", type="server_error")


# The request's fields whose engine checks a 400 names (the message starts with the name).
REQUEST_FIELDS = frozenset({"logit_bias", "logprobs", "min_tokens", "stop", "max_tokens",
                            "prompt", "priority", "seed", "temperature", "top_k", "top_p"})


def add_failure(err: Exception) -> APIError:
    """What a client hears when `add_request` raised: a 400 for a ValueError or TypeError (naming
    the field its message starts with, else the prompt), else a 500 (the engine's fault)."""
    if isinstance(err, (ValueError, TypeError)):
        first = re.match(r"\w+", str(err))
        param = first.group(0) if first and first.group(0) in REQUEST_FIELDS else "prompt"
        return APIError(400, str(err), param=param, code="request_rejected")
    log.error("add_request failed\n%s", "".join(traceback.format_exception(err)))
    return APIError(500, f"the engine failed to add the request: {type(err).__name__}: {err}",
                    type="server_error", code="engine_error")


def score_prompt(engine: Any, prompt: list[int], num_top: int) -> list:
    """The prompt's logprobs with `num_top` alternatives per token (one forward pass)."""
    from .logprobs import prompt_logprobs

    tok = getattr(engine, "tokenizer", None)
    vocab = min(engine.model.config.vocab_size, tok.vocab_size if tok is not None else math.inf)
    return prompt_logprobs(engine.model, prompt, num_top, vocab, getattr(engine, "device", None))


def quietly(fn: Callable, *args) -> None:
    """Run a metrics callback; a bug there is logged, never allowed to stop the engine loop."""
    try:
        fn(*args)
    except Exception:
        log.error("callback %r failed\n%s", fn, traceback.format_exc())


def settle(fut: asyncio.Future, err: BaseException | None) -> None:
    """Resolve `fut` with None or `err` unless it is already done (cancelled: the client left)."""
    if fut.done():
        return
    if err is None:
        fut.set_result(None)
    else:
        fut.set_exception(err)
