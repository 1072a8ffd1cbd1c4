"""Lesson: a real server under load (claims REQ-1, REQ-3, REQ-5, MET-1, MET-3, MET-5, BATCH-8,
BATCH-9, PD-11).

Every experiment starts the OpenAI-compatible server in-process (`running_server`, loopback
only), talks to it over HTTP like any client would (httpx, streaming server-sent events), and
stops it — also when something fails. Measurements are taken by the client: what a user sees.
Figures are plain functions of the measured numbers; the rate slider reads a sweep measured once.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx
import ipywidgets as widgets
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..bench.serve_load import LoadResult, run_load
from ..serve.api import running_server
from .common import control, log_axis, panel, reference_line, sig, style

CHAT_SLO = {"ttft": 0.5, "tpot": 0.05}  # claim MET-3: TTFT < 500 ms, TPOT < 50 ms
MODEL_NAME = "shakespeare"


def _gap(x: float | None, digits: int = 4) -> float | None:
    """Rounded for stable figure JSON; nan → None (a gap in the line)."""
    return None if x is None or math.isnan(x) else sig(x, digits)


def poisson_workload(*args, **kwargs):
    """`minifer.serve.workload.poisson_workload` (imported when first used)."""
    from ..serve.workload import poisson_workload as make

    return make(*args, **kwargs)


def _run(coro):
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


# ---- load at several arrival rates (MET-1, MET-3, PD-11) -----------------------------------
@dataclass
class Sweep:
    """One load test per arrival rate on the same workload shape (measured once; sliders read it).

    `capacity`: requests/s the server managed with every request arriving at once; `loads`: each
    rate as a multiple of it (when the rates were chosen that way).
    """

    rates: list[float]
    results: list[LoadResult]
    slo: dict[str, float] = field(default_factory=lambda: dict(CHAT_SLO))
    capacity: float | None = None
    loads: list[float] | None = None

    def at(self, rate: float) -> LoadResult:
        return self.results[self.rates.index(rate)]

    def label(self, rate: float) -> str:
        if self.loads is None:
            return f"{rate:.3g} req/s"
        return f"{self.loads[self.rates.index(rate)]:g}× capacity"

    def rows(self) -> list[dict]:
        rows = []
        for i, (rate, res) in enumerate(zip(self.rates, self.results)):
            s = res.summary
            rows.append({**({"load": self.loads[i]} if self.loads else {}),
                         "rate req/s": rate, "done": s["completed"],
                         "req/s": s["request_throughput"], "out tok/s": s["output_throughput"],
                         "TTFT p50 ms": s["ttft"]["median"] * 1e3,
                         "TTFT p99 ms": s["ttft"]["p99"] * 1e3,
                         "TPOT p50 ms": s["tpot"]["median"] * 1e3,
                         "ITL p99 ms": s["itl"]["p99"] * 1e3,
                         "E2EL p50 s": s["e2el"]["median"],
                         "goodput req/s": s.get("goodput", math.nan)})
        return rows


def workload(n: int, rate: float, *, prompt_len=(16, 64), output_len=(16, 48), seed: int = 0
             ) -> list[tuple[list[int], int, float]]:
    """``(prompt ids, max_tokens, arrival_s)`` per request: Poisson arrivals, corpus prompts.
    The same seed at another rate gives the same requests, arriving faster."""
    return [(list(r.prompt), r.max_new_tokens, r.arrival_s)
            for r in poisson_workload(n, rate, prompt_len, output_len, seed=seed)]


def warm_up(url: str) -> None:
    """One short request: the first forward passes of a fresh process are slower."""
    complete(url, "ROMEO:", max_tokens=4, temperature=0)


def rate_sweep(model, tokenizer, loads: Sequence[float] = (0.5, 1, 2, 4, 8), *,
               rates: Sequence[float] | None = None, n: int = 12, seed: int = 0,
               slo: dict[str, float] | None = None, **engine_options) -> Sweep:
    """The same `n` requests at several arrival rates, against one server, one rate after the
    other. By default the rates are `loads` × this server's **capacity** on this machine (the
    request throughput when all `n` arrive at once, measured first), so "2×" overloads any
    machine, fast or slow, by the same factor. Pass `rates` (requests/s) to choose them."""
    slo = dict(CHAT_SLO) if slo is None else slo
    with running_server(model, tokenizer, model_name=MODEL_NAME, **engine_options) as url:
        warm_up(url)
        capacity = None
        if rates is None:
            capacity = run_load(url, workload(n, math.inf, seed=seed)).summary[
                "request_throughput"]
            rates = [float(f"{f * capacity:.3g}") for f in loads]
        results = [run_load(url, workload(n, rate, seed=seed), slo=slo) for rate in rates]
    return Sweep(list(rates), results, slo, capacity, list(loads) if capacity else None)


def latency_figure(sweep: Sweep, rate: float) -> go.Figure:
    """Left: each request's TTFT, TPOT and E2EL at ``rate`` (the chat SLOs as lines). Right:
    throughput and TTFT against the arrival rate, ``rate`` marked."""
    res = sweep.at(rate)
    done = [m for m in res.metrics if m.completed]
    fig = make_subplots(rows=1, cols=3, column_widths=[0.25, 0.25, 0.5], subplot_titles=(
        "TTFT and E2EL (ms)", "TPOT and ITL (ms)", "against the arrival rate"),
        specs=[[{}, {}, {"secondary_y": True}]])
    series = {"ttft": [m.ttft for m in done], "e2el": [m.e2el for m in done],
              "tpot": [m.tpot for m in done], "itl": [g for m in done for g in m.itl]}
    for col, keys in ((1, ("ttft", "e2el")), (2, ("tpot", "itl"))):
        for key in keys:
            vals = [_gap(v * 1e3) for v in series[key]]
            fig.add_trace(go.Box(y=vals, name=key.upper(), showlegend=False,
                                 boxpoints="all" if key != "itl" else "outliers", jitter=0.4,
                                 marker=dict(size=3)), 1, col)
        slo_key = keys[0]
        if slo_key in sweep.slo:
            slo_ms = sweep.slo[slo_key] * 1e3
            reference_line(fig, y=slo_ms, color="red", row=1, col=col)
            # labelled by hand: plotly puts an hline's own label at 10**y on a log axis
            axis = "" if col == 1 else str(col)
            fig.add_annotation(x=1, xref=f"x{axis} domain", y=math.log10(slo_ms), yref=f"y{axis}",
                               text=f"{slo_key.upper()} SLO {slo_ms:g} ms", showarrow=False,
                               xanchor="right", yanchor="bottom", font=dict(color="red"))
        log_axis(fig, "y", row=1, col=col)  # ticks cover the boxes and the SLO line
    rows = sweep.rows()
    x = [r["rate req/s"] for r in rows]
    fig.add_trace(go.Scatter(x=x, y=[_gap(r["out tok/s"]) for r in rows], name="output tok/s "
                             "(whole server)", mode="lines+markers"), 1, 3, secondary_y=False)
    for key, dash in (("TTFT p50 ms", "solid"), ("TTFT p99 ms", "dot")):
        fig.add_trace(go.Scatter(x=x, y=[_gap(r[key]) for r in rows], name=key, mode="lines+markers",
                                 line=dict(dash=dash)), 1, 3, secondary_y=True)
    i = sweep.rates.index(rate)
    reference_line(fig, x=rate, dash="solid", row=1, col=3)
    s = res.summary
    log_axis(fig, "x", row=1, col=3)
    log_axis(fig, "y", row=1, col=3, secondary_y=True)
    fig.update_xaxes(title_text="arrival rate (requests/s)", row=1, col=3)
    fig.update_yaxes(title_text="output tokens/s", rangemode="tozero", row=1, col=3,
                     secondary_y=False)
    fig.update_yaxes(title_text="TTFT (ms)", row=1, col=3, secondary_y=True)
    good = s.get("good", 0)
    title = (f"{rate:g} requests/s ({sweep.label(rate)}): {s['completed']} done, {good} within "
             f"the chat SLO (goodput {s.get('goodput', 0):.2f} req/s of "
             f"{s['request_throughput']:.2f}); {rows[i]['out tok/s']:.0f} output tok/s")
    return style(fig, title, width=1000, height=400, title_size=13, top=80)


def rate_panel(sweep: Sweep, rate: float | None = None) -> widgets.interactive:
    """An arrival-rate slider over a measured :class:`Sweep` (instant: nothing is re-run)."""
    rate = sweep.rates[0] if rate is None else rate

    def figure(rate: float = rate) -> go.Figure:
        return latency_figure(sweep, rate)

    return panel(figure, rate=control("select", "load",
                                      options=[(sweep.label(r), r) for r in sweep.rates],
                                      value=rate))


# ---- limits (MET-5) ------------------------------------------------------------------------
def burst(url: str, n: int, **fields) -> list[int]:
    """``n`` requests sent at the same moment; their HTTP status codes."""
    body = {"model": MODEL_NAME, **fields}

    async def go_all():
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            rs = await asyncio.gather(*(http.post("/v1/completions", json=body)
                                        for _ in range(n)))
            return [r.status_code for r in rs]

    return _run(go_all())


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


# ---- streams of timed events, driven by events (BATCH-8, BATCH-9) ---------------------------
async def _stream(http, body: dict, log: list, tag) -> None:
    """Stream one request; append ``(tag, time)`` to `log` for every token event."""
    async with http.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:]).get("choices"):
                    log.append((tag, time.perf_counter()))


@dataclass
class InterferenceRun:
    """Short requests decoding while one long prompt arrives (BATCH-8, PD-11)."""

    chunked: bool
    short_times: list[list[float]]  # per short request: its token times (s from start)
    long_sent_s: float
    long_first_token_s: float

    @property
    def itls(self) -> list[tuple[float, float]]:
        """(time, gap) of every inter-token gap of the short requests."""
        return [(b, b - a) for ts in self.short_times for a, b in zip(ts, ts[1:])]

    @property
    def stall_ms(self) -> float:
        """The largest gap any short request saw while the long prompt was being prefilled."""
        gaps = [g for t, g in self.itls if t >= self.long_sent_s]
        return max(gaps) * 1e3

    @property
    def typical_ms(self) -> float:
        """The median gap of the short requests before the long prompt came."""
        gaps = sorted(g for t, g in self.itls if t < self.long_sent_s)
        return gaps[len(gaps) // 2] * 1e3


def interference(model, tokenizer, *, chunked: bool, n_short: int = 3, short_tokens: int = 48,
                 long_prompt: int = 240, chunk_budget: int = 32, long_after: int = 6,
                 seed: int = 0) -> InterferenceRun:
    """`n_short` requests decode; once the first has streamed `long_after` tokens, a prompt of
    `long_prompt` tokens arrives. With ``chunked`` its prefill is split into chunks that fit a
    `chunk_budget`-token step beside the decodes; without, it runs whole in one step."""
    reqs = poisson_workload(n_short + 1, math.inf, (8, 8), short_tokens, seed=seed)
    long_ids = list(poisson_workload(1, math.inf, long_prompt, 1, seed=seed + 1)[0].prompt)
    opts = dict(enable_chunked_prefill=True, max_num_batched_tokens=chunk_budget) if chunked \
        else {}
    with running_server(model, tokenizer, model_name=MODEL_NAME, max_num_seqs=n_short + 1,
                        **opts) as url:
        warm_up(url)

        async def scenario():
            log: list = []
            async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                t0 = time.perf_counter()
                shorts = [asyncio.create_task(_stream(http, {
                    "model": MODEL_NAME, "prompt": list(r.prompt), "max_tokens": short_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True}, log, i))
                    for i, r in enumerate(reqs[:n_short])]
                give_up = time.perf_counter() + 60
                while sum(1 for tag, _ in log if tag == 0) < long_after:
                    if time.perf_counter() > give_up or all(t.done() for t in shorts):
                        raise RuntimeError("the short requests did not start streaming")
                    await asyncio.sleep(0.001)
                sent = time.perf_counter()
                await _stream(http, {"model": MODEL_NAME, "prompt": long_ids, "max_tokens": 2,
                                     "temperature": 0, "stream": True}, log, "long")
                await asyncio.gather(*shorts)
            return log, t0, sent

        log, t0, sent = _run(scenario())
    times = [[t - t0 for tag, t in log if tag == i] for i in range(n_short)]
    first_long = next(t for tag, t in log if tag == "long") - t0
    return InterferenceRun(chunked, times, sent - t0, first_long)


def interference_figure(runs: Sequence[InterferenceRun]) -> go.Figure:
    """The short requests' inter-token gaps over time, with and without chunked prefill."""
    fig = go.Figure()
    for run in runs:
        name = "chunked prefill" if run.chunked else "whole prefill"
        pts = sorted(run.itls)
        fig.add_trace(go.Scatter(x=[_gap(t - run.long_sent_s) for t, _ in pts],
                                 y=[_gap(g * 1e3) for _, g in pts], mode="markers", name=name))
    reference_line(fig, x=0, text="long prompt arrives")
    return style(fig, "Short requests' inter-token latency as a long prompt arrives",
                 "seconds after the long prompt was sent", "gap before this token (ms)",
                 width=760, height=360)


@dataclass
class PriorityRun:
    """A steady stream of high-priority requests and one low-priority request (BATCH-9)."""

    aging: float
    first_token_order: list  # "high" / "low" in the order their first tokens came
    low_ttft_s: float
    high_ttft_s: list[float]

    @property
    def highs_before_low(self) -> int:
        return self.first_token_order.index("low")


def priorities(model, tokenizer, *, aging: float, n_high: int = 16, clients: int = 5,
               max_num_seqs: int = 2, tokens: int = 12, seed: int = 0) -> PriorityRun:
    """`clients` closed-loop clients send `n_high` priority-0 requests in all (each sends its
    next as soon as its last finished, so high-priority work is always waiting), and one
    priority-1 request arrives just after them. Lower value = served first (vLLM's rule);
    `aging` lowers a waiting request's value per step it waits."""
    prompts = [list(r.prompt) for r in poisson_workload(n_high + 1, math.inf, (8, 16), 1,
                                                        seed=seed)]
    with running_server(model, tokenizer, model_name=MODEL_NAME, max_num_seqs=max_num_seqs,
                        aging=aging) as url:
        warm_up(url)

        async def scenario():
            order: list[str] = []
            ttft: dict[str, list[float]] = {"high": [], "low": []}
            budget = iter(range(n_high))

            async def one(prompt, priority: int, kind: str):
                body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": tokens,
                        "temperature": 0, "ignore_eos": True, "stream": True,
                        "priority": priority}
                t0, first = time.perf_counter(), True
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    r.raise_for_status()
                    async for line in r.aiter_lines():
                        if first and line.startswith("data: {"):
                            first = False
                            order.append(kind)
                            ttft[kind].append(time.perf_counter() - t0)

            async def client():
                for i in budget:
                    await one(prompts[i], 0, "high")

            async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                tasks = [asyncio.create_task(client()) for _ in range(clients)]
                await asyncio.sleep(0.05)  # the high-priority clients are in
                await one(prompts[-1], 1, "low")
                await asyncio.gather(*tasks)
            return order, ttft

        order, ttft = _run(scenario())
    return PriorityRun(aging, order, ttft["low"][0], ttft["high"])
