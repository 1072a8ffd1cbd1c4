"""Lesson 11's client side: the course talks to its server over HTTP as any client would
(httpx, server-sent events). One request, streamed or not (REQ-1, REQ-3, REQ-5), the metrics
endpoint (MET-1), a burst and a client that hangs up (MET-5), and running a coroutine from a
notebook cell. Used by :mod:`.serving` (the load sweep) and :mod:`.contention`.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

MODEL_NAME = "shakespeare"


def poisson_workload(*args, **kwargs):
    """`minifer_course.workload.poisson_workload` (imported when first used)."""
    from ..workload import poisson_workload as make

    return make(*args, **kwargs)


def run_coroutine(coro):
    """Run a coroutine from a notebook cell (whose own event loop is already running)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


# ---- one request, streamed or not (REQ-1, REQ-3, REQ-5) ------------------------------------
@dataclass
class Streamed:
    """A streamed completion as the client saw it: each event's text and arrival time."""

    events: list[dict]  # the parsed `data:` events, [DONE] excluded
    times: list[float]  # seconds after the request was sent, one per event
    total_s: float

    @property
    def text(self) -> str:
        return "".join(e["choices"][0]["text"] for e in self.events if e.get("choices"))

    @property
    def token_events(self) -> list[dict]:
        return [e for e in self.events if e.get("choices")]

    @property
    def first_text_s(self) -> float:
        """When the reader saw the first character (the first event with text)."""
        return next((t for e, t in zip(self.events, self.times)
                     if e.get("choices") and e["choices"][0]["text"]), math.nan)

    @property
    def usage(self) -> dict | None:
        return next((e["usage"] for e in reversed(self.events) if e.get("usage")), None)


def complete(url: str, prompt, *, stream: bool = False, **fields) -> dict | Streamed:
    """POST /v1/completions; the JSON answer, or a `Streamed` record of the event stream."""
    body = {"model": MODEL_NAME, "prompt": prompt, **fields}
    t0 = time.perf_counter()
    if not stream:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        return {"status": r.status_code, "seconds": time.perf_counter() - t0, **r.json()}
    body.update(stream=True, stream_options={"include_usage": True})
    events, times = [], []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
                times.append(time.perf_counter() - t0)
    return Streamed(events, times, time.perf_counter() - t0)


def metric_lines(url: str, names: Sequence[str]) -> dict[str, float]:
    """Values of unlabelled Prometheus series from ``GET /metrics``."""
    values = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            values[name] = float(value)
    return values


def warm_up(url: str) -> None:
    """One short request: the first forward passes of a fresh process are slower."""
    complete(url, "ROMEO:", max_tokens=4, temperature=0)


# ---- limits (MET-5) ------------------------------------------------------------------------
def burst(url: str, n: int, **fields) -> list[int]:
    """``n`` requests sent at the same moment; their HTTP status codes."""
    body = {"model": MODEL_NAME, **fields}

    async def go_all():
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            rs = await asyncio.gather(*(http.post("/v1/completions", json=body)
                                        for _ in range(n)))
            return [r.status_code for r in rs]

    return run_coroutine(go_all())


def leave_early(url: str, prompt, after: int, **fields) -> int:
    """Stream a request, read `after` token events, hang up; how many events were read."""
    body = {"model": MODEL_NAME, "prompt": prompt, "stream": True, **fields}
    got = 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            got += line.startswith("data: ")
            if got == after:
                break
    return got


def wait_idle(engine, timeout_s: float = 10.0) -> bool:
    """Wait until the engine has nothing in flight (aborts apply at its next iteration)."""
    t0 = time.monotonic()
    while engine.has_unfinished() and time.monotonic() - t0 < timeout_s:
        time.sleep(0.01)
    return not engine.has_unfinished()
