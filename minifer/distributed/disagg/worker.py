"""The two ranks of disaggregated serving: rank 0 prefills, rank 1 decodes.

Both are `LLMEngine`s over paged pools of their own, in processes joined by `torch.distributed`:

- **prefill** (rank 0) takes requests (JSON lines on stdin, or prompts on the command line),
  prefills them in chunks, samples each first token and sends the request to rank 1
  (`export_prefilled`, `send_handoff`). It never decodes.
- **decode** (rank 1) receives handoffs on a thread, inserts each when it fits
  (`add_prefilled`) and decodes with continuous batching (a preempted request recomputes here);
  finished requests leave as JSON lines on stdout, with each rank's final report line.

Only the protocol lines go to stdout; a failure raises in the rank, which exits non-zero."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

from ...engine.driver import drive
from ...sampling import SamplingParams
from ..handoff import (
    Handoff,
    add_prefilled,
    export_prefilled,
    finished_handoff,
    params_from_dict,
    recv_handoff,
    send_alive,
    send_done,
    send_handoff,
)

PREFILL, DECODE = 0, 1
FAULT_ENV = "MINIFER_DISAGG_FAULT"
"""Fault injection for tests: ``"prefill:N"`` or ``"decode:N"`` makes that rank raise at step N."""


@dataclass
class Span:
    """One interval of a worker's timeline (``time.perf_counter()`` seconds)."""

    start: float
    end: float
    kind: str  # "prefill" | "decode" | "send" | "recv"
    tokens: int = 0  # tokens fed to the model (steps) or whose K/V moved (transfers)
    nbytes: int = 0  # K/V bytes moved (transfers)
    requests: list[str] = field(default_factory=list)


class Lines:
    """JSON lines on the original stdout (flushed at once), whatever else the process prints."""

    def __init__(self) -> None:
        self.out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)  # print() and C-level writes to fd 1 now land in the log
        sys.stdout = sys.stderr
        self.lock = threading.Lock()

    def write(self, obj: dict) -> None:
        with self.lock:
            self.out.write(json.dumps(obj) + "\n")
            self.out.flush()


def _drain(q: queue.Queue, block: bool) -> list:
    """Everything in `q` now; with `block`, first wait up to 50 ms for one item."""
    items = []
    with contextlib.suppress(queue.Empty):
        items.append(q.get(timeout=0.05) if block else q.get_nowait())
        while True:
            items.append(q.get_nowait())
    return items


class StdinRequests:
    """Requests from the front, JSON lines on stdin read by a thread: ``{"op": "add", ...}``, then
    ``{"op": "close"}`` (or the end of stdin)."""

    def __init__(self) -> None:
        self.q: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in sys.stdin:
            line = line.strip()
            if line:
                self.q.put(json.loads(line))
                if self.q.queue[-1].get("op") == "close":
                    return
        self.q.put({"op": "close"})

    def poll(self, block: bool) -> list[dict]:
        return _drain(self.q, block)


class ListRequests:
    """A fixed list of requests (``torchrun`` runs): all arrive at once, then close."""

    def __init__(self, requests: list[dict]) -> None:
        self.msgs = [*requests, {"op": "close"}]

    def poll(self, block: bool) -> list[dict]:
        msgs, self.msgs = self.msgs, []
        return msgs


class _Loop:
    """What both ranks' loops keep: engine, step timeline, step count, injected fault."""

    def __init__(self, engine, device) -> None:
        self.engine, self.device = engine, device
        self.timeline: list[Span] = []
        self.steps = 0
        spec = os.environ.get(FAULT_ENV, "")
        self.crash_at = int(spec.split(":", 1)[1]) if spec.startswith(self.role + ":") else None

    def count_step(self) -> None:
        self.steps += 1
        if self.crash_at is not None and self.steps >= self.crash_at:
            raise RuntimeError(f"fault injection: the {self.role} worker fails at step "
                               f"{self.steps}")

    def step_span(self) -> Span:
        """The last step's span on the timeline: kind "prefill" on the prefill rank, "decode" or
        "recompute" (a preempted request's prompt fed again) on the decode rank."""
        st = self.engine.last_step
        end = time.perf_counter()
        kind = "prefill" if self.role == "prefill" else "recompute" if st.prefill else "decode"
        return Span(end - st.duration_s, end, kind, st.num_tokens,
                    requests=list(st.decode) + [r for r, _ in st.prefill])


def run_prefill(engine, source, device, *, dst: int = DECODE, keepalive_s: float = 10.0) -> dict:
    """Rank 0's loop (`drive`): admit requests, step, hand every prefilled request to rank `dst`
    (a refused or failed one as a finished handoff, reason "error"); while idle, a keep-alive
    every `keepalive_s` seconds, so the decode worker's ``recv`` never times out."""
    loop = _Prefill(engine, device, source, dst, keepalive_s)
    drive(engine, loop.take, loop.deliver)
    send_done(dst, device=device)
    return {"role": "prefill", "timeline": [asdict(s) for s in loop.timeline],
            "transfers": loop.transfers, "bytes_per_token": engine.pool.bytes_per_token,
            "steps": loop.steps, "prefill_tokens": engine.num_prefill_tokens}


class _Prefill(_Loop):
    """`run_prefill`'s state between the steps: the requests' sampling parameters, the
    transfers sent, whether the front closed, when rank `dst` last heard from this one."""

    role = "prefill"

    def __init__(self, engine, device, source, dst: int, keepalive_s: float) -> None:
        super().__init__(engine, device)
        self.source, self.dst, self.keepalive_s = source, dst, keepalive_s
        self.transfers: list[dict] = []
        self.params_of: dict[str, SamplingParams] = {}
        self.closing, self.last_sent = False, time.monotonic()

    def send(self, h: Handoff) -> None:
        t0 = time.perf_counter()
        send_handoff(h, self.dst, device=self.device)
        tokens = h.num_prompt_tokens if h.kv is not None else 0
        self.timeline.append(Span(t0, time.perf_counter(), "send", tokens, h.kv_bytes,
                                  [h.request_id]))
        self.transfers.append({"request_id": h.request_id, "prompt_tokens": h.num_prompt_tokens,
                               "kv_bytes": h.kv_bytes, "send_s": h.transfer_s})
        self.last_sent = time.monotonic()

    def add(self, msg: dict) -> None:
        params = params_from_dict(msg["params"])
        try:
            rid = self.engine.add_request(msg["prompt_ids"], params, request_id=msg["request_id"],
                                          arrival_time=msg.get("arrival_time"),
                                          priority=msg.get("priority", 0))
            self.params_of[rid] = params
        except (ValueError, TypeError) as err:  # the front checks first: a safety net
            self.send(_refused(msg, params, err))

    def take(self, idle: bool) -> bool:
        for msg in self.source.poll(block=idle and not self.closing):
            if msg["op"] == "close":
                self.closing = True
            elif msg["op"] == "add":
                self.add(msg)
        idle = not self.engine.has_unfinished()
        if idle and self.closing:
            return False
        if idle and time.monotonic() - self.last_sent > self.keepalive_s:
            send_alive(self.dst, device=self.device)
            self.last_sent = time.monotonic()
        if not idle:
            self.count_step()
        return True

    def deliver(self, outputs: list) -> None:
        self.timeline.append(self.step_span())
        for out in outputs:
            params = self.params_of.pop(out.request_id)
            self.send(finished_handoff(out, params) if out.finished
                      else export_prefilled(self.engine, out.request_id))


def _refused(msg: dict, params: SamplingParams, err: Exception) -> Handoff:
    now = time.perf_counter()
    arrival = msg.get("arrival_time") or now
    return Handoff(msg["request_id"], list(msg["prompt_ids"]), None, params, None, arrival, now,
                   now, finish_reason="error",
                   error=f"request {msg['request_id']!r} refused: {type(err).__name__}: {err}")


def run_decode(engine, lines: Lines, device, *, src: int = PREFILL) -> dict:
    """Rank 1's loop (`drive`): insert received handoffs when they fit, decode,
    emit finished requests (a request that fails here alone ends with reason "error")."""
    # The receiver thread needs the interpreter lock between its recv calls; Python's default
    # 5 ms switch interval would add up to that much to every message while a step runs.
    sys.setswitchinterval(0.0005)
    loop = _Decode(engine, device, lines, src)
    threading.Thread(target=loop.receive, daemon=True).start()
    drive(engine, loop.take, loop.deliver)
    pool = engine.pool
    return {"role": "decode", "timeline": [asdict(s) for s in loop.timeline],
            "recv": [asdict(s) for s in loop.recv_spans], "bytes_per_token": pool.bytes_per_token,
            "steps": loop.steps, "preemptions": engine.scheduler.num_preemptions,
            "recompute_tokens": engine.num_prefill_tokens, "num_blocks": pool.num_blocks}


_NO_TRANSFER = {"kv_bytes": 0, "recv_s": 0.0, "received_time": None}  # finished at rank 0


class _Decode(_Loop):
    """`run_decode`'s state between the steps: the inbox its receiver thread fills, the
    handoffs received and not yet admitted, each request's transfer, whether rank 0 is done."""

    role = "decode"

    def __init__(self, engine, device, lines: Lines, src: int) -> None:
        super().__init__(engine, device)
        self.lines, self.src = lines, src
        self.inbox: queue.Queue = queue.Queue()
        self.recv_spans: list[Span] = []
        self.transfers: dict[str, dict] = {}
        self.pending: list[Handoff] = []
        self.producer_done = False

    def receive(self) -> None:
        """The receiver thread: every handoff from rank `src` into the inbox, then None (rank
        `src` is done) or the exception that ended it."""
        pool = self.engine.pool
        try:
            while True:
                h = recv_handoff(self.src, (pool.n_layer, pool.n_kv_head, pool.head_dim),
                                 pool.dtype, device=self.device)
                if h is None:
                    self.inbox.put(None)
                    return
                end = time.perf_counter()
                self.recv_spans.append(Span(end - h.transfer_s, end, "recv", h.num_prompt_tokens
                                            if h.kv is not None else 0, h.kv_bytes,
                                            [h.request_id]))
                self.inbox.put(h)
        except BaseException as e:  # noqa: BLE001 - handed to the main loop, which raises it
            self.inbox.put(e)

    def emit(self, rid: str, prompt_ids, token_ids, reason, arrival_time, first_scheduled_time,
             token_times, finished_time, preemptions: int = 0, error: str | None = None) -> None:
        """One finished request, as a line on stdout (with its transfer, if it had one)."""
        self.lines.write({"event": "finished", "request_id": rid, "prompt_ids": list(prompt_ids),
                          "token_ids": list(token_ids), "finish_reason": reason, "error": error,
                          "arrival_time": arrival_time, "first_scheduled_time":
                          first_scheduled_time, "token_times": token_times,
                          "finished_time": finished_time, "preemptions": preemptions,
                          **self.transfers.get(rid, _NO_TRANSFER)})

    def admit(self, h: Handoff) -> bool:
        """Start decoding `h` here (or emit it, finished at its first token); False: no room."""
        reason, finished, error = h.finish_reason, h.first_token_time, h.error
        if reason is None:
            try:
                if add_prefilled(self.engine, h):
                    return True
                if not self.engine.has_unfinished():
                    raise RuntimeError(f"request {h.request_id!r} does not fit the decode "
                                       f"worker's empty pool ({self.engine!r})")
                return False
            except ValueError as err:  # it can never run here: it alone fails
                reason, finished = "error", time.perf_counter()
                error = f"request {h.request_id!r} failed: {err}"
        first = [] if h.first_token is None else [h.first_token]
        self.emit(h.request_id, h.prompt_ids, first, reason, h.arrival_time, h.first_scheduled_time,
                  [h.first_token_time] if first else [], finished, 0, error)
        return True

    def take(self, idle: bool) -> bool:
        for item in _drain(self.inbox, idle and not self.pending and not self.producer_done):
            if item is None:
                self.producer_done = True
            elif isinstance(item, BaseException):
                raise RuntimeError("the decode worker's receiver failed") from item
            else:
                self.transfers[item.request_id] = {"kv_bytes": item.kv_bytes,
                                                   "recv_s": item.transfer_s,
                                                   "received_time": time.perf_counter()}
                self.pending.append(item)
        # Preempted requests (waiting here) go first; new handoffs join in arrival order.
        while self.pending and not self.engine.scheduler.num_waiting and self.admit(self.pending[0]):
            self.pending.pop(0)
        if self.engine.has_unfinished():
            self.count_step()
            return True
        return not (self.producer_done and not self.pending and self.inbox.empty())

    def deliver(self, outputs: list) -> None:
        self.timeline.append(self.step_span())
        for out in outputs:
            if out.finished:
                m = out.metrics
                self.emit(out.request_id, out.prompt_token_ids, out.token_ids, out.finish_reason,
                          m.arrival_time, m.first_scheduled_time, m.token_times,
                          m.finished_time, m.preemptions, out.error)
