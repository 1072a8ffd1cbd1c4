"""`EngineReplicas`: engine processes behind one server, each with a share of the seats.

A step goes at the pace of its slowest thread; replicas never wait for each other: each is a
whole `LLMEngine` in its own process (`EngineProcess`) with a share of `max_num_seqs` and of the
KV pool (vLLM's data parallelism). A new request goes to the live replica with the fewest in
flight. One that dies leaves the routing at once: its requests end with a 503, ``/health`` says
"degraded" (503 when none is left), and it is restarted (at most `MAX_RESTARTS` times). The
weights are shared; prefix caching is per replica."""

from __future__ import annotations

import logging
import math
import os
import threading
from types import SimpleNamespace
from typing import Any

from ..checks import check_int
from ..engine import async_engine
from ..engine.async_engine import DEFAULT_MAX_WAITING, engine_stats, queue_full
from ..engine.errors import APIError
from .engine_process import EngineProcess

__all__ = ["EngineReplicas", "split", "replica_options", "MAX_RESTARTS"]

log = logging.getLogger("minifer.serve")

MAX_RESTARTS = 3  # a replica that keeps dying is left dead after this many restarts
WATCH_S = 0.2  # how often the replicas are looked at


def split(total: int, parts: int) -> list[int]:
    """`total` in `parts` shares that differ by at most one, the larger ones first."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def replica_options(options: dict, replicas: int, blocks_needed: int) -> list[dict]:
    """Each replica's `LLMEngine` options: `options` with ``max_num_seqs`` and ``num_blocks``
    split between `replicas`. ValueError when a share would hold no seat, or fewer blocks than
    the longest request the server admits (`blocks_needed`)."""
    check_int("replicas", replicas, 1)
    seats, blocks = options["max_num_seqs"], options["num_blocks"]
    if replicas > seats:
        raise ValueError(f"replicas must be at most max_num_seqs ({seats}): every replica "
                         f"needs a seat, got {replicas}")
    if blocks // replicas < blocks_needed:
        raise ValueError(f"num_blocks={blocks} split over {replicas} replicas leaves "
                         f"{blocks // replicas} blocks each, fewer than the {blocks_needed} the "
                         f"longest request needs; use fewer replicas or more blocks")
    return [dict(options, max_num_seqs=s, num_blocks=b)
            for s, b in zip(split(seats, replicas), split(blocks, replicas))]


class EngineReplicas:
    """`AsyncEngine`'s interface and admission control over `replicas` engine processes built
    from `engine`'s model and options. `threads` applies in each; ``"auto"`` gives each its
    share of the cores (following the idle cores, replicas would each take them all).
    `fallback`: where a replica cannot start, one with every seat, with a warning (where that
    one cannot start, a thread steps it). `restart`: start a replica again when it dies."""

    def __init__(self, engine: Any, replicas: int, *, max_waiting: int = DEFAULT_MAX_WAITING,
                 on_finish=None, on_step=None, threads: int | str | None = None,
                 blocks_needed: int = 1, fallback: bool = False, restart: bool = True) -> None:
        options = getattr(engine, "options", None)
        if not isinstance(options, dict):
            raise TypeError(f"replicas are built from an engine's options; a "
                            f"{type(engine).__name__} has none (an LLMEngine has)")
        # as given: what a fallback to one engine process uses
        self.engine, self.max_waiting, self.threads = engine, max_waiting, threads
        if threads == "auto" and replicas > 1:  # one replica follows the idle cores
            threads = max(1, (os.cpu_count() or 1) // replicas)
        self.replica_threads = threads
        self.fallback, self.restart = fallback, restart
        self.on_finish, self.on_step = on_finish, on_step
        self._shards = [SimpleNamespace(model=engine.model, tokenizer=engine.tokenizer,
                                        options=opts)
                        for opts in replica_options(options, replicas, blocks_needed)]
        self.children: list[EngineProcess] = [self._child(i, 0) for i in range(replicas)]
        self.restarts = [0] * replicas
        self._reported: set[int] = set()  # replicas whose death was logged
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    def _child(self, i: int, generation: int) -> EngineProcess:
        """Replica `i`'s engine process, its `generation`-th start (with request ids of its own)."""
        shard = self.engine if len(self._shards) == 1 else self._shards[i]
        child = EngineProcess(shard, max_waiting=self.max_waiting, on_finish=self.on_finish,
                              on_step=self.on_step, threads=self.replica_threads)
        child.id_prefix = f"srv-r{i}-" if not generation else f"srv-r{i}.{generation}-"
        # its gauges until the replica reports: the given engine's (never stepped, so empty),
        # with this replica's share of the blocks
        child.stats = dict(engine_stats(self.engine), blocks_total=shard.options["num_blocks"])
        return child

    def __setattr__(self, name: str, value: Any) -> None:
        """``on_finish`` and ``on_step`` are set on every replica too."""
        super().__setattr__(name, value)
        if name in ("on_finish", "on_step"):
            for c in getattr(self, "children", ()):
                setattr(c, name, value)

    # ---- life ------------------------------------------------------------------------------
    def start(self) -> None:
        started = []
        try:
            for c in self.children:
                c.start()
                started.append(c)
        except RuntimeError as err:
            for c in started:
                c.stop()
            if not self.fallback:
                raise
            if len(self._shards) > 1:  # one engine process with every seat
                log.warning("%s; serving with one engine process instead of %d replicas", err,
                            len(self.children))
                self._shards, self.restarts, self.replica_threads = [self.engine], [0], self.threads
                self.children = [self._child(0, 0)]
                return self.start()
            log.warning("%s; the engine steps in a thread of the server's process instead", err)
            self.children = [async_engine.AsyncEngine(
                self.engine, max_waiting=self.max_waiting, on_finish=self.on_finish,
                on_step=self.on_step, threads=self.threads)]
            return self.children[0].start()
        self._watcher = threading.Thread(target=self._watch, name="minifer-replicas", daemon=True)
        self._watcher.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        if self._watcher is not None:
            self._watcher.join(timeout)
        for c in self.children:
            c.stop(timeout)

    def _watch(self) -> None:
        """Log each replica's death; start it again, up to `MAX_RESTARTS` times."""
        while not self._stopping.wait(WATCH_S):
            for i, c in enumerate(self.children):
                if c.alive or self._stopping.is_set():
                    continue
                if i not in self._reported:
                    self._reported.add(i)
                    live, total = self.replicas_alive
                    log.warning("engine replica %d stopped; serving with %d of %d replicas",
                                i, live, total)
                if not self.restart or self.restarts[i] >= MAX_RESTARTS:
                    continue
                self.restarts[i] += 1
                child = self._child(i, self.restarts[i])
                try:
                    child.start()
                except RuntimeError as err:
                    log.warning("engine replica %d could not be restarted: %s", i, err)
                    continue
                if self._stopping.is_set():
                    child.stop()
                    return
                c.stop(1.0)  # its threads, if any are left
                self.children[i] = child
                self._reported.discard(i)
                log.warning("engine replica %d restarted (%d of %d restarts)", i,
                            self.restarts[i], MAX_RESTARTS)

    @property
    def alive(self) -> bool:
        """While any replica serves (`replicas_alive` says how many)."""
        return any(c.alive for c in self.children)

    @property
    def replicas_alive(self) -> tuple[int, int]:
        """(replicas serving, replicas in all)."""
        return sum(c.alive for c in self.children), len(self.children)

    # ---- requests ---------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return sum(c.num_waiting for c in self.children)

    async def add(self, prompt, params, priority: int = 0, **options):
        """Queue a request on the replica with the fewest in flight (see `AsyncEngine.add`)."""
        waiting = self.num_waiting
        if waiting >= self.max_waiting:
            raise queue_full(waiting, self.max_waiting)
        live = [c for c in self.children if c.alive]  # a dead replica takes nothing
        if not live:
            again = self.restart and min(self.restarts) < MAX_RESTARTS
            raise APIError(503, "no engine process is running" + (
                "; a dead one is restarted within seconds: retry" if again else ""),
                type="server_error", code="engine_stopped")
        child = min(live, key=lambda c: c.num_in_flight)
        return await child.add(prompt, params, priority, **options)

    def abort(self, request_id: str) -> None:
        for c in self.children:  # the replica holding it (after a fallback: the only one)
            if request_id.startswith(c.id_prefix) or len(self.children) == 1:
                c.abort(request_id)
                return

    # ---- what the metrics read ---------------------------------------------------------------
    @property
    def stats(self) -> dict[str, float]:
        """The live replicas' gauges added up (the KV usage and prefix hit rate over their
        blocks; a dead replica's last values are left out), and how many are live."""
        parts = [dict(c.stats) for c in self.children if c.alive]
        total: dict[str, float] = {"replicas": len(self.children), "replicas_alive": len(parts),
                                   "replica_restarts": sum(self.restarts)}
        for key in ("running", "waiting", "preemptions", "blocks_total", "blocks_used"):
            if all(key in p for p in parts):
                total[key] = sum(p[key] for p in parts)
        if total.get("blocks_total"):
            total["kv_usage"] = total["blocks_used"] / total["blocks_total"]
        rates = [p["prefix_cache_hit_rate"] for p in parts if "prefix_cache_hit_rate" in p]
        if rates:
            total["prefix_cache_hit_rate"] = math.fsum(rates) / len(rates)
        return total

    @property
    def num_steps(self) -> int:
        return sum(c.num_steps for c in self.children)

    @property
    def num_step_errors(self) -> int:
        return sum(c.num_step_errors for c in self.children)

    @property
    def threads_in_force(self) -> list[int | None]:
        """Each replica's torch threads."""
        return [c.threads_in_force for c in self.children]
