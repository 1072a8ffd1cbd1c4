"""Load-test an OpenAI-compatible completions server: ``python -m minifer_course.bench serve-load``.

    python -m minifer.serve --model shakespeare &           # or any OpenAI-compatible server
    python -m minifer_course.bench serve-load --url http://127.0.0.1:8000 --rate 4 --num-requests 100 \\
        --slo ttft=0.5,tpot=0.05 --out load.json

Requests arrive as a Poisson process at ``--rate`` requests/s (`minifer_course.workload`: seeded
prompt and output lengths, prompts cut from the shipped corpus's held-out text). Each is a
*streaming* ``POST /v1/completions`` (httpx, asynchronous), at most ``--max-concurrency`` in
flight. The client times every streamed token and reports the metrics of vLLM's serving
benchmark with its definitions (`minifer_course.summary.summarize`): TTFT, TPOT, ITL and E2EL
(mean, median, p99), request and output-token throughput, and goodput under ``--slo``.

Everything is measured by the client, as a user would see it: TTFT includes the network and
the server's queue. A server that sends one event per token (minifer's does) gives per-token
ITLs; one that batches tokens into events gives per-event gaps, as in vLLM's benchmark.
Requests ask for exactly their output length (``ignore_eos``, a vLLM extension, unless
``--no-ignore-eos``). The functions are importable: the serving lesson measures with them.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LoadResult", "run_load", "make_requests", "parse_slo", "format_report"]


@dataclass
class LoadResult:
    """What one load test saw: per-request metrics (client clock), the summary, the failures."""

    metrics: list  # minifer.engine.metrics.RequestMetrics, one per request
    duration_s: float
    summary: dict
    errors: list[str] = field(default_factory=list)
    texts: list[str | None] = field(default_factory=list)

    def to_json(self) -> dict:
        """Plain JSON (nan → null)."""
        return {"summary": _clean(self.summary), "errors": self.errors,
                "requests": [{"request_id": m.request_id, "prompt_tokens": m.prompt_tokens,
                              "output_tokens": m.output_tokens, "ttft": _num(m.ttft),
                              "tpot": _num(m.tpot), "e2el": _num(m.e2el),
                              "finish_reason": m.finish_reason} for m in self.metrics]}


def _clean(obj):
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, float):
        return _num(obj)
    return obj


def _num(x: float) -> float | None:
    return None if x is None or math.isnan(x) else x


def parse_slo(text: str | None) -> dict[str, float] | None:
    """``"ttft=0.5,tpot=0.05"`` (seconds; ``ms`` suffix allowed) → ``{"ttft": 0.5, ...}``."""
    if not text:
        return None
    slo = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"slo must look like ttft=0.5,tpot=0.05 (keys ttft, tpot, e2el; "
                             f"seconds or e.g. 50ms), got {part!r}")
        scale = 1e-3 if value.endswith("ms") else 1.0
        try:
            slo[key] = float(value.removesuffix("ms").removesuffix("s")) * scale
        except ValueError:
            raise ValueError(f"slo {key}: not a number: {value!r}") from None
    return slo


def make_requests(num_requests: int, rate: float, *, prompt_len=(16, 64), output_len=(16, 64),
                  seed: int = 0, prompt_format: str = "text") -> list[tuple[Any, int, float]]:
    """``(prompt, max_tokens, arrival_s)`` per request, from `poisson_workload`; prompts as text
    (decoded with the shipped tokenizer: any server can take it) or as token ids."""
    from minifer.pretrained import model_files
    from minifer.tokenizer import Tokenizer

    from ..workload import poisson_workload

    if prompt_format not in ("text", "ids"):
        raise ValueError(f"prompt_format must be 'text' or 'ids', got {prompt_format!r}")
    tok = Tokenizer.from_file(model_files("shakespeare")[2])
    reqs = poisson_workload(num_requests, rate, prompt_len, output_len, seed=seed, tokenizer=tok)
    return [(tok.decode(r.prompt) if prompt_format == "text" else list(r.prompt),
             r.max_new_tokens, r.arrival_s) for r in reqs]


async def _one(http, url: str, body: dict, i: int, metrics, errors: list, texts: list) -> None:
    from minifer.engine.metrics import RequestMetrics

    m = RequestMetrics(request_id=f"load-{i}", prompt_tokens=0, arrival_time=time.perf_counter())
    metrics[i] = m
    text = []
    try:
        async with http.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                detail = (await r.aread()).decode(errors="replace")[:200]
                errors.append(f"request {i}: HTTP {r.status_code}: {detail}")
                return
            reason = None
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    errors.append(f"request {i}: {chunk['error'].get('message')}")
                    return
                now = time.perf_counter()
                if chunk.get("choices"):
                    choice = chunk["choices"][0]
                    m.on_token(now)
                    text.append(choice.get("text") or "")
                    reason = choice.get("finish_reason") or reason
                if chunk.get("usage"):
                    m.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
            m.on_finish(time.perf_counter(), reason if reason in ("stop", "length") else "stop")
            texts[i] = "".join(text)
    except Exception as err:  # a load test reports failures, it does not stop at the first
        errors.append(f"request {i}: {type(err).__name__}: {err}")


async def run_load_async(url: str, requests: Sequence[tuple[Any, int, float]], *,
                         model: str | None = None, max_concurrency: int | None = None,
                         slo: dict[str, float] | None = None, temperature: float = 0.0,
                         ignore_eos: bool = True, extra: dict | None = None,
                         timeout_s: float = 600.0, api_key: str | None = None) -> LoadResult:
    """Send `requests` (``(prompt, max_tokens, arrival_s)``) at their arrival times
    (`api_key`: sent as ``Authorization: Bearer`` to a server started with ``--api-key``)."""
    import httpx

    from minifer_course.summary import summarize

    base = url.rstrip("/")
    limits = httpx.Limits(max_connections=max_concurrency or 1000,
                          max_keepalive_connections=max_concurrency or 1000)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits, headers=headers) as http:
        if model is None:
            r = await http.get(f"{base}/v1/models")
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        metrics: list = [None] * len(requests)
        texts: list = [None] * len(requests)
        errors: list[str] = []

        async def send(i: int, prompt, max_tokens: int, at: float, t0: float) -> None:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                    "temperature": temperature, "stream": True,
                    "stream_options": {"include_usage": True}, **(extra or {})}
            if ignore_eos:
                body["ignore_eos"] = True
            if sem is None:
                await _one(http, f"{base}/v1/completions", body, i, metrics, errors, texts)
            else:
                async with sem:
                    await _one(http, f"{base}/v1/completions", body, i, metrics, errors, texts)

        t0 = time.perf_counter()
        await asyncio.gather(*(send(i, p, n, a, t0) for i, (p, n, a) in enumerate(requests)))
        duration = time.perf_counter() - t0
    metrics = [m for m in metrics if m is not None]
    summary = summarize(metrics, duration, slo)
    summary["failed"] = len(errors)
    return LoadResult(metrics, duration, summary, errors, texts)


def run_load(url: str, requests: Sequence[tuple[Any, int, float]], **kwargs) -> LoadResult:
    """`run_load_async` from synchronous code (in a thread of its own if an event loop already
    runs here, as in a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run_load_async(url, requests, **kwargs))
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, run_load_async(url, requests, **kwargs)).result()


def format_report(result: LoadResult, rate: float | None = None) -> str:
    """A table like vLLM's serving benchmark prints."""
    s = result.summary
    lines = [f"{' Serving Benchmark Result ':=^50}"]

    def row(name: str, value) -> None:
        lines.append(f"{name:<40}{value:>10}")

    if rate is not None:
        row("Request rate (req/s):", f"{rate:g}")
    row("Successful requests:", s["completed"])
    row("Failed requests:", s["failed"])
    row("Benchmark duration (s):", f"{s['duration_s']:.2f}")
    row("Total input tokens:", s["input_tokens"])
    row("Total generated tokens:", s["output_tokens"])
    row("Request throughput (req/s):", f"{s['request_throughput']:.2f}")
    row("Output token throughput (tok/s):", f"{s['output_throughput']:.1f}")
    row("Total token throughput (tok/s):", f"{s['total_token_throughput']:.1f}")
    if "goodput" in s:
        row("SLO:", ", ".join(f"{k} ≤ {v * 1e3:g} ms" for k, v in s["slo"].items()))
        row("Goodput (req/s):", f"{s['goodput']:.2f}")
    for key, title in (("ttft", "Time to First Token"),
                       ("tpot", "Time per Output Token (excl. 1st)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{title:-^50}")
        for stat in ("mean", "median", "p99"):
            label = "P99" if stat == "p99" else stat.capitalize()
            row(f"{label} {key.upper()} (ms):", f"{s[key][stat] * 1e3:.2f}")
    lines.append("=" * 50)
    for err in result.errors[:5]:
        lines.append(f"error: {err}")
    return "\n".join(lines)
