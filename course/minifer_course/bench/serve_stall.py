"""Does a huge prompt stall everyone else's stream? The largest gap between two chunks of other
clients' streams while ~1 MB prompts arrive at the server.

A server (`python -m minifer.serve`, a process of its own, as a user runs it) streams long
answers to a few clients; once they are running, some clients send prompts of ~1 MB of text at
once. Each is refused (it cannot fit the context window), but what it costs the server on the
way — reading, parsing, tokenizing — happens on the same machine as everyone's streams, and
anything that holds the event loop (or Python's GIL) holds every stream. Reported: the largest
gap between consecutive chunks of the streams, quiet (before the big prompts) and while they
arrive, and how long ``GET /health`` took meanwhile. Target (issue 45): ≤ 50 ms on 2 cores.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

__all__ = ["StallResult", "big_prompt", "measure_stall", "serve"]


@dataclass
class StallResult:
    streams: int
    big_prompts: int
    big_prompt_chars: int
    quiet_max_gap_ms: float  # the largest gap between chunks before the big prompts
    loaded_max_gap_ms: float  # ... while they arrive and are answered
    health_ms: list[float] = field(default_factory=list)  # GET /health meanwhile
    big_statuses: list[int] = field(default_factory=list)
    big_answer_s: list[float] = field(default_factory=list)  # each big prompt's answer time

    def to_json(self) -> dict:
        return asdict(self)


def big_prompt(chars: int = 1_000_000) -> str:
    """`chars` characters of Shakespeare (the shipped validation plays, repeated), one line."""
    from importlib import resources

    text = (resources.files("minifer.data") / "shakespeare" / "validation.txt").read_text(
        encoding="utf-8").replace("\n", " ")
    return (text * (chars // len(text) + 1))[:chars]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class serve:  # noqa: N801 - a context manager, used like a function
    """``python -m minifer.serve`` in a subprocess on a free loopback port; the base URL."""

    def __init__(self, model: str = "shakespeare", *extra: str, timeout_s: float = 120) -> None:
        self.port = _free_port()
        self.argv = [sys.executable, "-m", "minifer.serve", "--model", model, "--port",
                     str(self.port), "--log-level", "warning", *extra]
        self.timeout_s = timeout_s

    def __enter__(self) -> str:
        import httpx

        self.proc = subprocess.Popen(self.argv, env=dict(os.environ))
        url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.__exit__()
        raise RuntimeError(f"the server did not start within {self.timeout_s:g} s")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def _client(client, url: str, model: str, max_tokens: int, stop: asyncio.Event,
                  runs: list[list[float]]) -> None:
    """Stream answers back to back until `stop`; each answer's chunk times in `runs`."""
    body = {"model": model, "prompt": "ROMEO:", "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    while not stop.is_set():
        stamps: list[float] = []
        runs.append(stamps)
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"a stream got {r.status_code}: {await r.aread()!r:.200}")
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    stamps.append(time.perf_counter())


def _max_gap(runs: list[list[float]], t0: float, t1: float) -> float:
    """The largest gap (ms) between consecutive chunks of one answer, the later in [t0, t1]."""
    gaps = [b - a for stamps in runs for a, b in zip(stamps, stamps[1:]) if t0 <= b <= t1]
    return 1e3 * max(gaps, default=0.0)


async def _measure(url: str, model: str, streams: int, big: int, chars: int,
                   quiet_s: float) -> StallResult:
    import httpx

    prompt = big_prompt(chars)
    payload = json.dumps({"model": model, "prompt": prompt, "max_tokens": 16}).encode()
    async with httpx.AsyncClient(timeout=120) as client:
        card = (await client.get(f"{url}/v1/models")).json()["data"][0]
        max_tokens = card["max_model_len"] - 8  # "ROMEO:" is a few tokens
        stop = asyncio.Event()
        runs: list[list[list[float]]] = [[] for _ in range(streams)]
        tasks = [asyncio.create_task(_client(client, url, model, max_tokens, stop, r))
                 for r in runs]
        t0 = time.monotonic()
        while not all(r and len(r[-1]) > 2 for r in runs):  # every stream is under way
            if time.monotonic() - t0 > 60 or any(t.done() for t in tasks):
                stop.set()
                await asyncio.gather(*tasks)  # raises what went wrong
                raise RuntimeError("the streams did not start within 60 s")
            await asyncio.sleep(0.01)
        t_quiet = time.perf_counter()
        await asyncio.sleep(quiet_s)
        t_big = time.perf_counter()
        statuses: list[int] = []
        answer_s: list[float] = []

        async def send_big() -> None:
            t = time.perf_counter()
            r = await client.post(f"{url}/v1/completions", content=payload,
                                  headers={"Content-Type": "application/json"})
            statuses.append(r.status_code)
            answer_s.append(time.perf_counter() - t)

        health: list[float] = []
        done = asyncio.Event()

        async def poll_health() -> None:
            while not done.is_set():
                t = time.perf_counter()
                await client.get(f"{url}/health")
                health.append(1e3 * (time.perf_counter() - t))
                await asyncio.sleep(0.02)

        poller = asyncio.create_task(poll_health())
        await asyncio.gather(*(send_big() for _ in range(big)))
        await asyncio.sleep(0.2)  # what the big prompts left behind
        done.set()
        await poller
        t_end = time.perf_counter()
        stop.set()
        await asyncio.gather(*tasks)
    quiet = max(_max_gap(r, t_quiet, t_big) for r in runs)
    loaded = max(_max_gap(r, t_big, t_end) for r in runs)
    return StallResult(streams, big, chars, round(quiet, 1), round(loaded, 1),
                       [round(h, 1) for h in health], statuses, [round(a, 3) for a in answer_s])


def measure_stall(url: str, *, model: str = "shakespeare", streams: int = 3, big: int = 3,
                  chars: int = 1_000_000, quiet_s: float = 1.0) -> StallResult:
    """`streams` clients stream answers back to back from the server at `url`; after
    `quiet_s`, `big` prompts of `chars` characters arrive at once. The largest chunk gaps
    before and while they are answered."""
    return asyncio.run(_measure(url, model, streams, big, chars, quiet_s))


def format_report(results: list[StallResult]) -> str:
    lines = ["big prompts  chars      statuses          quiet max gap  loaded max gap  "
             "/health max"]
    for r in results:
        lines.append(f"{r.big_prompts:>11}  {r.big_prompt_chars:>9,}  {str(r.big_statuses):<16}  "
                     f"{r.quiet_max_gap_ms:>10.1f} ms  {r.loaded_max_gap_ms:>11.1f} ms  "
                     f"{max(r.health_ms, default=0):>8.1f} ms")
    return "\n".join(lines)
