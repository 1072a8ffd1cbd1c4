"""Lesson 08, part 5: latency against load (BATCH-6, BATCH-7) — simulated load sweeps, the
batch limit a latency target allows, and their figures and panel.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Sequence

import ipywidgets as widgets
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..workload import Arrival
from .common import control, log_axis, panel, reference_line, sig, wide_layout
from .simulation import REFERENCE_COSTS, StepCosts, simulate
from .traces import DECODE, PREFILL

# =============================================================================================
# 5. Latency against load (BATCH-6, BATCH-7)
# =============================================================================================

RATES = (0.5, 1, 2, 3, 4, 6, 8, 10, 12, 14, 16, 20)  # requests/s
SEQ_LIMITS = (1, 4, 8, 16, 32, 64)
LIMIT_COLORS = ("#17becf", "#1f77b4", "#2ca02c", "#d62728", "#9467bd", "#ff7f0e")  # by SEQ_LIMITS


@functools.lru_cache(maxsize=16)
def load_workload(n: int = 200, seed: int = 0) -> tuple[Arrival, ...]:
    """The load sweep's requests at rate 1/s (a faster rate only rescales the arrivals):
    prompts of 16–128 tokens, answers of 16–96 tokens (random ids: the simulation only needs
    lengths)."""
    from ..workload import poisson_workload

    return tuple(poisson_workload(n, 1.0, prompt_len=(16, 128), output_len=(16, 96), seed=seed,
                                  source="random", vocab_size=2))


def at_rate(requests: Sequence[Arrival], rate: float) -> list[Arrival]:
    """``requests`` (made at 1 request/s) arriving ``rate`` times as fast."""
    import dataclasses

    return [dataclasses.replace(r, arrival_s=r.arrival_s / rate) for r in requests]


@functools.lru_cache(maxsize=256)
def load_point(costs: StepCosts, rate: float, max_num_seqs: int, policy: str = "continuous",
               n: int = 200, seed: int = 0) -> dict:
    """One simulated run of the load workload at ``rate`` requests/s: a flat dict of the
    numbers the figures plot (seconds, tokens/s).

    The simulation is deterministic, so each point is computed once and remembered: the
    table, the asserts, the figure and every slider position of the panel share it."""
    return dict(_load_point(costs, rate, max_num_seqs, policy, n, seed))


@functools.lru_cache(maxsize=1024)
def _load_point(costs: StepCosts, rate: float, max_num_seqs: int, policy: str, n: int,
                seed: int) -> dict:
    tr = simulate(at_rate(load_workload(n, seed), rate), costs, policy, max_num_seqs)
    s = tr.summary()
    return {"rate": rate, "max_num_seqs": max_num_seqs, "policy": policy,
            "output_throughput": s["output_throughput"],
            "request_throughput": s["request_throughput"],
            "ttft_p50": s["ttft"]["median"], "ttft_p99": s["ttft"]["p99"],
            "queue_p50": s["queue_time"]["median"], "queue_p99": s["queue_time"]["p99"],
            "tpot_p50": s["tpot"]["median"], "tpot_p99": s["tpot"]["p99"],
            "e2el_p50": s["e2el"]["median"],
            "mean_batch": statistics.fmean(
                sum(v in (PREFILL, DECODE) for v in st.values()) for st in tr.steps)}


def load_rows(costs: StepCosts, max_num_seqs: int = 16, rates: Sequence[float] = RATES,
              policy: str = "continuous") -> list[dict]:
    """:func:`load_point` at each rate, rounded for a table (ms, tokens/s)."""
    rows = []
    for rate in rates:
        p = load_point(costs, rate, max_num_seqs, policy)
        rows.append({"req/s offered": rate, "req/s served": round(p["request_throughput"], 2),
                     "out tok/s": round(p["output_throughput"]),
                     "mean batch": round(p["mean_batch"], 1),
                     "queue p50 ms": round(p["queue_p50"] * 1e3),
                     "TTFT p50 ms": round(p["ttft_p50"] * 1e3),
                     "TTFT p99 ms": round(p["ttft_p99"] * 1e3),
                     "TPOT p50 ms": round(p["tpot_p50"] * 1e3, 1)})
    return rows


def rates_for(costs: StepCosts) -> tuple[float, ...]:
    """:data:`RATES` scaled by how much faster than the reference CPU ``costs`` step (at 16
    sequences), rounded to 3 digits: the same range of load, from idle to overloaded, on a
    faster or slower machine."""
    scale = REFERENCE_COSTS.step(16, 0) / costs.step(16, 0)
    return tuple(sig(r * scale, 3) for r in RATES)


def load_figure(costs: StepCosts, max_num_seqs: int = 16, rate: float = 8.0,
                limits: Sequence[int] = (4, 16, 64),
                rates: Sequence[float] = RATES, tpot_target_s: float | None = None) -> go.Figure:
    """As the offered load (requests/s) rises: left, the server's output tokens/s; middle, TTFT
    (median and p99) with the part spent queueing; right, TPOT. One line per batch limit in
    ``limits`` plus ``max_num_seqs`` (bold), at each of ``rates``; ``rate`` marked.
    ``tpot_target_s`` draws that latency target across the TPOT panel (BATCH-6's choice)."""
    limits = sorted(set(limits) | {max_num_seqs})
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.1, subplot_titles=(
        "server output tokens/s", "TTFT (dotted: queue time), median", "TPOT, median"))
    for m in limits:
        pts = [load_point(costs, r, m) for r in rates]
        width = 4 if m == max_num_seqs else 1.5
        name = f"max {m} seqs"
        # one color per batch limit in all three panels, so the legend reads for each of them
        color = LIMIT_COLORS[SEQ_LIMITS.index(m) % len(LIMIT_COLORS)] if m in SEQ_LIMITS \
            else "#7f7f7f"
        line = dict(width=width, color=color)
        fig.add_trace(go.Scatter(x=list(rates), y=[sig(p["output_throughput"], 4) for p in pts],
                                 mode="lines", name=name, legendgroup=name, line=line), 1, 1)
        fig.add_trace(go.Scatter(x=list(rates), y=[sig(p["ttft_p50"] * 1e3, 4) for p in pts],
                                 mode="lines", name=name, legendgroup=name, showlegend=False,
                                 line=line), 1, 2)
        if m == max_num_seqs:
            fig.add_trace(go.Scatter(x=list(rates), y=[sig(p["queue_p50"] * 1e3, 4) for p in pts],
                                     mode="lines", name=f"queue time, max {m} seqs",
                                     line=dict(dash="dot", width=2.5, color=color)), 1, 2)
        fig.add_trace(go.Scatter(x=list(rates), y=[sig(p["tpot_p50"] * 1e3, 4) for p in pts],
                                 mode="lines", name=name, legendgroup=name, showlegend=False,
                                 line=line), 1, 3)
    p = load_point(costs, rate, max_num_seqs)
    for col, y in ((1, p["output_throughput"]), (2, p["ttft_p50"] * 1e3),
                   (3, p["tpot_p50"] * 1e3)):
        fig.add_trace(go.Scatter(x=[rate], y=[sig(y, 4)], mode="markers", showlegend=False,
                                 marker=dict(size=12, color="crimson")), 1, col)
    fig.update_xaxes(title_text="offered load (requests/s)", rangemode="tozero")
    fig.update_yaxes(rangemode="tozero", row=1, col=1)
    fig.update_yaxes(rangemode="tozero", row=1, col=3)
    log_axis(fig, "y", row=1, col=2)
    fig.update_yaxes(title_text="ms", row=1, col=2)
    fig.update_yaxes(title_text="ms", row=1, col=3)
    if tpot_target_s is not None:
        reference_line(fig, y=tpot_target_s * 1e3, color="red", row=1, col=3,
                       text=f"target {tpot_target_s * 1e3:g} ms")
    title = (f"{costs.label}, at most {max_num_seqs} sequences per step, {rate:g} requests/s: "
             f"{p['output_throughput']:,.0f} output tok/s, TTFT p50 "
             f"{p['ttft_p50'] * 1e3:,.0f} ms (queueing {p['queue_p50'] * 1e3:,.0f} ms), "
             f"TPOT p50 {p['tpot_p50'] * 1e3:,.1f} ms")
    return wide_layout(fig, title, width=1050, height=420)


def load_panel(costs: StepCosts, max_num_seqs: int = 16, rate: float | None = None,
               rates: Sequence[float] | None = None) -> widgets.interactive:
    """Sliders over the load simulation: the batch limit and the offered load (``rates``:
    default :func:`rates_for` ``costs``; ``rate``: default the 7th of them, 8/s on the
    reference CPU)."""
    rates = tuple(rates) if rates is not None else rates_for(costs)
    rate = rates[6] if rate is None else rate

    def figure(max_num_seqs: int = max_num_seqs, rate: float = rate) -> go.Figure:
        return load_figure(costs, max_num_seqs, rate, rates=rates)

    return panel(figure,
                 max_num_seqs=control("select", "max seqs", options=list(SEQ_LIMITS),
                                      value=max_num_seqs),
                 rate=control("select", "req/s", options=list(rates), value=rate))


def pick_batch_limit(costs: StepCosts, tpot_target_s: float,
                     limits: Sequence[int] = SEQ_LIMITS, rate: float = max(RATES)) -> dict:
    """BATCH-6: under heavy load (``rate``), the batch limit with the most output tokens/s whose
    median TPOT stays within ``tpot_target_s``; with every limit's numbers."""
    pts = [load_point(costs, rate, m) for m in limits]
    ok = [p for p in pts if p["tpot_p50"] <= tpot_target_s]
    best = max(ok, key=lambda p: p["output_throughput"]) if ok else None
    return {"best": best, "points": pts}
