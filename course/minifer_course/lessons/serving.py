"""Lesson 11: a real server under load (claims REQ-1, REQ-3, REQ-5, MET-1, MET-3, MET-5, BATCH-8,
BATCH-9, PD-11). This module is the lesson's namespace (``S.*``): the load sweep and its figure
live here; the client side (one request, metrics, limits) in :mod:`.http_client`, requests
competing in one server (a long prefill, priorities) in :mod:`.contention`.

Every experiment starts the OpenAI-compatible server in-process (`running_server`, loopback
only), talks to it over HTTP like any client would (httpx, streaming server-sent events), and
stops it — also when something fails. Measurements are taken by the client: what a user sees.
Figures are plain functions of the measured numbers; the rate slider reads a sweep measured once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import ipywidgets as widgets
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from minifer_course.server import running_server

from ..bench.serve_load import LoadResult, run_load
from .common import REFERENCE, control, log_axis, panel, reference_line, sig_or_none, style
from .contention import (  # noqa: F401 (the lesson's S.*)
    InterferenceRun,
    PriorityRun,
    interference,
    interference_figure,
    priorities,
)
from .http_client import (  # noqa: F401 (the lesson's S.*)
    MODEL_NAME,
    Streamed,
    burst,
    complete,
    leave_early,
    metric_lines,
    poisson_workload,
    run_coroutine,
    wait_idle,
    warm_up,
)

CHAT_SLO = {"ttft": 0.5, "tpot": 0.05}  # claim MET-3: TTFT < 500 ms, TPOT < 50 ms


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


_TPUT, _TTFT = "#2ca02c", "#9467bd"  # the two y axes of the rate panel

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
    every = {key: [v for r in sweep.results for m in r.metrics if m.completed
                   for v in ([getattr(m, key)] if key != "itl" else m.itl)] for key in series}
    for col, keys in ((1, ("ttft", "e2el")), (2, ("tpot", "itl"))):
        for key in keys:
            vals = [sig_or_none(v * 1e3) for v in series[key]]
            fig.add_trace(go.Box(y=vals, name=key.upper(), showlegend=False,
                                 boxpoints="all" if key != "itl" else "outliers", jitter=0.4,
                                 marker=dict(size=3)), 1, col)
        # the same axis at every rate: its range and ticks cover every rate's values and the SLO
        span = [v * 1e3 for key in keys for v in every[key] if v and v > 0]
        if keys[0] in sweep.slo:
            span.append(sweep.slo[keys[0]] * 1e3)
            reference_line(fig, y=sweep.slo[keys[0]] * 1e3, color="red", row=1, col=col)
        if span:
            lo, hi = min(span), max(span)
            fig.add_trace(go.Scatter(x=[keys[0].upper()] * 2, y=[sig_or_none(lo), sig_or_none(hi)],
                                     mode="markers", marker=dict(opacity=0), showlegend=False,
                                     hoverinfo="skip"), 1, col)
            log_axis(fig, "y", row=1, col=col)
            fig.update_yaxes(range=[math.log10(lo) - 0.1, math.log10(hi) + 0.1], autorange=False,
                             row=1, col=col)
    if sweep.slo:
        # the SLO lines are named in the legend, not beside the line, where a box may stand
        slo_text = " and ".join(f"{k.upper()} {v * 1e3:g} ms" for k, v in sweep.slo.items())
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", name=f"red lines: the chat SLO, {slo_text}",
                                 line=dict(color="red", dash="dash", width=2)), 1, 1)
    rows = sweep.rows()
    x = [r["rate req/s"] for r in rows]
    # two y axes, told apart by colour: throughput (left axis) green, TTFT (right axis) purple
    fig.add_trace(go.Scatter(x=x, y=[sig_or_none(r["out tok/s"]) for r in rows], name="output tok/s "
                             "(whole server)", mode="lines+markers", line=dict(color=_TPUT)),
                  1, 3, secondary_y=False)
    for key, dash in (("TTFT p50 ms", "solid"), ("TTFT p99 ms", "dot")):
        fig.add_trace(go.Scatter(x=x, y=[sig_or_none(r[key]) for r in rows], name=key, mode="lines+markers",
                                 line=dict(dash=dash, color=_TTFT)), 1, 3, secondary_y=True)
    i = sweep.rates.index(rate)
    # labelled by hand (on a log axis plotly would put a line's own label at 10**x)
    marks = [(rate, "selected", REFERENCE, "solid", "top")]
    if sweep.capacity:
        marks.append((sweep.capacity, f"capacity {sweep.capacity:.1f} req/s", "red", "dash",
                      "bottom"))
    for x_at, text, color, dash, where in marks:
        reference_line(fig, x=x_at, dash=dash, color=color, row=1, col=3)
        fig.add_annotation(x=math.log10(x_at), xref="x3", y=1 if where == "top" else 0,
                           yref="y3 domain", text=text, showarrow=False, xanchor="left",
                           yanchor=where, font=dict(color=color, size=11),
                           bgcolor="rgba(255,255,255,0.85)")
    s = res.summary
    log_axis(fig, "x", row=1, col=3)
    log_axis(fig, "y", row=1, col=3, secondary_y=True)
    fig.update_xaxes(title_text="arrival rate (requests/s)", row=1, col=3)
    fig.update_yaxes(title_text="output tokens/s", rangemode="tozero", row=1, col=3,
                     secondary_y=False, title_font=dict(color=_TPUT), tickfont=dict(color=_TPUT))
    fig.update_yaxes(title_text="TTFT (ms)", row=1, col=3, secondary_y=True,
                     title_font=dict(color=_TTFT), tickfont=dict(color=_TTFT))
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




# ---- streaming (REQ-5) ----------------------------------------------------------------------
def stream_figure(streamed: Streamed, whole_s: float) -> go.Figure:
    """What a reader has, against time: the streamed answer's tokens as their events arrived,
    and the same answer sent whole, all of it at once when it is done (``whole_s``)."""
    times = [sig_or_none(t * 1e3) for e, t in zip(streamed.events, streamed.times)
             if e.get("choices")]
    n, whole_ms = len(times), sig_or_none(whole_s * 1e3)
    fig = go.Figure([
        go.Scatter(x=[0, *times], y=list(range(n + 1)), mode="lines", line_shape="hv",
                   name="streamed: each token when its event arrives", line=dict(width=2)),
        go.Scatter(x=[0, whole_ms, whole_ms], y=[0, 0, n], mode="lines", line_shape="hv",
                   name="whole: every token when the answer is done", line=dict(width=2, dash="dash")),
    ])
    end = max(whole_ms or 0, *(t for t in times if t is not None), 1)
    fig.update_xaxes(range=[-0.02 * end, 1.06 * end])  # both lines clear of the axes
    fig.update_yaxes(range=[-0.04 * n, 1.06 * n])
    return style(fig, f"The same {n} tokens: streamed, the first after {streamed.first_text_s * 1e3:.0f} ms; "
                      f"whole, all after {whole_s * 1e3:.0f} ms", "ms after the request was sent",
                 "tokens the reader has", width=760)


# ---- priorities (BATCH-9) -------------------------------------------------------------------
def priority_figure(runs: Sequence[PriorityRun]) -> go.Figure:
    """Each run's time to first token: every high-priority request (blue dots) and the one
    low-priority request (red diamond), strict priority beside aging."""
    names = [("strict priority" if r.aging == 0 else f"aging {r.aging:g} per step") for r in runs]
    fig = go.Figure([
        go.Box(x=[n for n, r in zip(names, runs) for _ in r.high_ttft_s],
               y=[sig_or_none(t * 1e3) for r in runs for t in r.high_ttft_s],
               name="high priority (each request)", boxpoints="all", jitter=0.5, pointpos=0,
               fillcolor="rgba(0,0,0,0)", line=dict(color="rgba(0,0,0,0)"),
               marker=dict(color="#1f77b4", size=6)),
        go.Scatter(x=names, y=[sig_or_none(r.low_ttft_s * 1e3) for r in runs], mode="markers",
                   name="the low-priority request",
                   marker=dict(color="#d62728", symbol="diamond", size=13)),
    ])
    waits = " vs ".join(str(r.highs_before_low) for r in runs)
    return style(fig, f"Time to first token; high-priority requests started before the low one: "
                      f"{waits}", None,
                 "TTFT (ms)", width=620)
