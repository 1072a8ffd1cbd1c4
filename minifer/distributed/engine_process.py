"""`EngineProcess`: the engine steps in a process of its own; the server's handlers stay here.

The step's Python (scheduling, sampling, detokenizing) and the event loop then never take turns
for the interpreter lock, at the price of each step's outputs sent through a pipe. As vLLM's:

    server process                                 engine process
    handlers -> add / abort (AsyncEngine's API)    LLMEngine(model, tokenizer, **options)
    forwarder thread: inbox -> pipe  ───────────>  `drive`: take commands; step; send outputs
    reader thread: pipe -> each handle's queue <──  ("accepted", ...), ("outputs", ...), ...

The weights go over in shared memory, the engine there is built with the given one's options
(which is never stepped); the process is spawned (a fork after OpenMP threads can hang) and
exits when the server's end of the pipe closes; `EngineReplicas` restarts it when it dies."""

from __future__ import annotations

import contextlib
import copy
import logging
import signal
import threading
import traceback
from typing import Any

from ..engine.async_engine import (
    DEFAULT_MAX_WAITING,
    AsyncEngine,
    add_failure,
    add_request,
    engine_stats,
    settle,
    shutting_down,
    step_failure,
)
from ..engine.driver import drive
from ..engine.errors import APIError

__all__ = ["EngineProcess", "ENGINES", "engine_main"]

log = logging.getLogger("minifer.serve")

ENGINES = ("thread", "process")  # where a server's engine steps (create_app's `engine_in`)
START_TIMEOUT_S = 300.0  # the engine process must be ready by then (imports, a kernel build)


class EngineProcess(AsyncEngine):
    """`AsyncEngine`'s interface and admission control with `engine.step()` in a child process.
    `threads` applies there; `on_finish` and `on_step` run here, in the reader thread."""

    def __init__(self, engine: Any, *, max_waiting: int = DEFAULT_MAX_WAITING,
                 on_finish=None, on_step=None, threads: int | str | None = None,
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        super().__init__(engine, max_waiting=max_waiting, on_finish=on_finish, on_step=on_step,
                         threads=threads)
        self.start_timeout_s = start_timeout_s
        self._pending: dict[str, tuple] = {}  # sent to the engine, not yet accepted
        self._lock = threading.Lock()  # _pending and _handles: forwarder and reader share them
        self._process = None
        self._conn = None
        self._reader: threading.Thread | None = None

    # ---- life ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine process and, once its engine is built, the two threads (where it
        cannot, a RuntimeError naming why: `EngineReplicas` then steps in a thread)."""
        if self._thread is not None:
            raise RuntimeError("EngineProcess already started")
        self._start_process()
        self._reader = threading.Thread(target=self._read, name="minifer-engine-reader",
                                        daemon=True)
        self._reader.start()
        super().start()  # the forwarder: AsyncEngine's thread, running `_run` below

    def _start_process(self) -> None:
        import torch.multiprocessing as tmp

        e = self.engine
        options = getattr(e, "options", None)
        if not isinstance(options, dict):
            raise RuntimeError(f"the engine process failed to start: a {type(e).__name__} has "
                               f"no `options` to rebuild it from there (an LLMEngine has)")
        ctx = tmp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=engine_main, name="minifer-engine", daemon=True,
                                    args=(child, e.model, e.tokenizer, options, self.threads))
        try:
            try:
                self._process.start()  # pickles the arguments: the weights go to shared memory
            finally:
                child.close()
            if not self._conn.poll(self.start_timeout_s):
                raise RuntimeError(f"it was not ready within {self.start_timeout_s:g} s")
            kind, detail = self._conn.recv()
        except (EOFError, OSError):
            self._process.join(5)
            kind, detail = "error", f"it exited with code {self._process.exitcode}"
        except Exception as err:  # the weights could not be shared, the start timed out, ...
            kind, detail = "error", f"{type(err).__name__}: {err}"
        if kind != "ready":
            self._kill()
            raise RuntimeError(f"the engine process failed to start: {detail}")
        self.threads_in_force = detail

    def stop(self, timeout: float = 10.0) -> None:
        super().stop(timeout)  # the forwarder sends "stop" on its way out
        if self._reader is not None:
            self._reader.join(timeout)
        if self._process is not None:
            self._process.join(timeout)
            self._kill()

    def _kill(self) -> None:
        if self._process is not None and self._process.pid is not None \
                and self._process.is_alive():
            self._process.kill()
            self._process.join(5)

    @property
    def alive(self) -> bool:
        return (super().alive and self._process is not None and self._process.is_alive()
                and self._reader is not None and self._reader.is_alive())

    # ---- the forwarder thread: the inbox goes down the pipe ---------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._inbox and not self._stopping:
                    self._cv.wait()
                inbox, self._inbox, stopping = self._inbox, [], self._stopping
            try:
                for cmd in inbox:
                    self._forward(cmd)
                if stopping:
                    self._conn.send(("stop",))
                    return
            except (OSError, ValueError):  # the engine process is gone: the reader says so
                return

    def _forward(self, cmd: tuple) -> None:
        if cmd[0] == "abort":
            rid = cmd[1]
            with self._lock:
                known = self._handles.pop(rid, None) or self._pending.pop(rid, None)
            if known is not None:
                self._conn.send(("abort", rid))
            return
        _, rid, prompt, params, priority, options, num_prompt_lp, loop, handle, accepted = cmd
        with self._lock:
            self._pending[rid] = (loop, handle, accepted)
        self._conn.send(("add", rid, prompt, params, priority, options, num_prompt_lp))

    # ---- the reader thread: what the engine process says -------------------------------------
    def _read(self) -> None:
        reason = "the engine process exited"
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                break
            except Exception as err:  # an output that cannot be unpickled here
                log.error("a message from the engine process was lost\n%s", traceback.format_exc())
                reason = f"a message from the engine process was lost: {err}"
                break
            kind = msg[0]
            if kind == "outputs":
                _, outputs, self.stats, self.num_steps, self.num_step_errors = msg
                self._deliver_step(outputs)
            elif kind in ("accepted", "rejected"):
                self._settle_add(*msg)
            elif kind == "failed":  # a step failed (or the engine stopped): these are aborted
                _, rids, err, self.num_step_errors = msg
                for rid in rids:
                    self._deliver(rid, copy.copy(err))  # an exception of its own each
            elif kind == "stats":
                self.stats = msg[1]
            elif kind == "threads":
                self.threads_in_force = msg[1]
            elif kind == "stopped":
                reason = "the server is shutting down"
                break
        self._fail_all(reason)

    def _settle_add(self, kind: str, rid: str, detail) -> None:
        with self._lock:
            entry = self._pending.pop(rid, None)
            if entry is not None and kind == "accepted":
                self._handles[rid] = entry[:2]
        if entry is None:  # aborted while the engine took it: the abort follows it there
            return
        loop, handle, accepted = entry
        if kind == "accepted":
            handle.prompt_logprobs = detail
            err = None
        else:
            with self._cv:
                self._unstarted.discard(rid)
            err = detail
        with contextlib.suppress(RuntimeError):  # its event loop is closed
            loop.call_soon_threadsafe(settle, accepted, err)

    def _fail_all(self, reason: str) -> None:
        """The engine process is gone: every request in flight ends with a 503."""
        err = APIError(503, reason, type="server_error", code="engine_stopped")
        with self._lock:
            pending, self._pending = self._pending, {}
        for rid, (loop, _, accepted) in pending.items():
            with self._cv:
                self._unstarted.discard(rid)
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(settle, accepted, err)
        for rid in list(self._handles):
            self._deliver(rid, copy.copy(err))


def engine_main(conn, model, tokenizer, options: dict, threads) -> None:
    """The engine process: build the engine, then take commands and step until told to stop."""
    import torch

    from .. import hooks
    from ..engine.llm_engine import LLMEngine

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the server, which stops us
    try:
        engine = LLMEngine(model, tokenizer, **options)
        _ = engine.pool.k + engine.pool.v  # allocated now: a pool too large fails here
        adjust_threads = hooks.serving_threads(threads)
        conn.send(("ready", torch.get_num_threads()))
    except BaseException as err:  # noqa: BLE001 - the server reports it and does not start
        conn.send(("error", f"{type(err).__name__}: {err}"))
        return
    count = {"steps": 0, "errors": 0}

    def take(idle: bool) -> bool:
        commands = [conn.recv()] if idle else []
        while conn.poll():
            commands.append(conn.recv())
        for cmd in commands:
            if cmd[0] == "stop":
                _abort_all(engine, conn, shutting_down(), count["errors"])
                conn.send(("stopped",))
                return False
            _apply(engine, conn, cmd)
        if not engine.has_unfinished():  # aborts freed blocks: the gauges should say so
            conn.send(("stats", engine_stats(engine)))
        elif n := adjust_threads():
            conn.send(("threads", n))
        return True

    def deliver(outputs: list) -> None:
        count["steps"] += 1
        conn.send(("outputs", outputs, engine_stats(engine), count["steps"], count["errors"]))

    def fail(err: Exception) -> None:  # a step raised: no one request's failure
        count["errors"] += 1
        log.error("engine step failed; aborting the requests in flight\n%s",
                  "".join(traceback.format_exception(err)))
        _abort_all(engine, conn, step_failure(err), count["errors"])

    try:
        drive(engine, take, deliver, fail)
    except (EOFError, OSError):  # the server is gone
        pass
    finally:
        conn.close()


def _abort_all(engine, conn, err: APIError, step_errors: int) -> None:
    """Abort every request in the engine; the server ends each of them with `err`."""
    rids = list(engine.requests)
    for rid in rids:
        engine.abort(rid)
    conn.send(("failed", rids, err, step_errors))


def _apply(engine, conn, cmd: tuple) -> None:
    if cmd[0] == "abort":
        if cmd[1] in engine.requests:
            engine.abort(cmd[1])
        return
    try:
        scored = add_request(engine, *cmd[1:])
    except Exception as err:
        conn.send(("rejected", cmd[1], add_failure(err)))
        return
    conn.send(("accepted", cmd[1], scored))
