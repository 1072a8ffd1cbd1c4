"""Lesson: more than one device, tensor parallelism (claims PAR-1, PAR-2).

Two halves. *Measured*: per-rank tables and a figure of what `minifer.distributed.parallel.run_local` reports
(each rank's weights, KV cache, all-reduce traffic, compute vs communication time). *Analytic*:
figures over :func:`minifer_course.roofline.tp_decode` for a large model on real interconnects, with a
TP-degree slider and an interconnect-bandwidth slider (:func:`panel`).
"""

from __future__ import annotations

import math

import ipywidgets as widgets
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .. import roofline as rl
from .common import control, log_axis, reference_line, sig, style, table
from .common import panel as _panel

DEGREES = [1, 2, 4, 8]
BANDWIDTHS_GBS = [8, 16, 32, 64, 128, 256, 450, 900]  # per direction, GB/s
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128]
LATENCY_US = 1.0  # per ring step; NVLink-like (PCIe presets use 5 µs)
LATENCIES_US = [0.5, 1, 2, 5, 10, 20]


# --------------------------------------------------------------------------------------------
# Measured: what each rank held and did
# --------------------------------------------------------------------------------------------

def memory_rows(results: dict) -> list[dict]:
    """One row per (world size, rank) from ``{world_size: TPResult}``: heads, bytes of sharded
    and replicated weights, KV-cache bytes, all-reduces and bytes all-reduced per decode step."""
    rows = []
    for world, res in sorted(results.items()):
        for r in res.reports:
            rows.append({"ranks": world, "rank": r.rank,
                         "heads": f"{r.q_heads[0]}-{r.q_heads[1] - 1}",
                         "MLP units": f"{r.mlp_units[0]}-{r.mlp_units[1] - 1}",
                         "sharded weights B": r.weight_bytes["sharded"],
                         "replicated B": r.weight_bytes["replicated"],
                         "KV cache B": r.kv_bytes,
                         "all-reduces/token": r.allreduce_calls_per_step,
                         "all-reduced B/token": r.allreduce_bytes_per_step})
    return rows


def memory_text(results: dict) -> str:
    """:func:`memory_rows` as an aligned plain-text table (deterministic: bytes and counts)."""
    return table(memory_rows(results))


def timing_rows(results: dict) -> list[dict]:
    """Per rank: milliseconds per decode step in computation and inside collectives (measured;
    on one CPU the ranks share cores, so this shows the mechanism, not a speed-up)."""
    rows = []
    for world, res in sorted(results.items()):
        for r in res.reports:
            steps = max(r.decode_steps, 1)
            rows.append({"ranks": world, "rank": r.rank,
                         "compute ms/token": r.decode_compute_s / steps * 1e3,
                         "communication ms/token": r.decode_comm_s / steps * 1e3,
                         "share in communication": r.decode_comm_s / max(r.decode_s, 1e-12)})
    return rows


def memory_figure(results: dict, unit: float = rl.MB) -> go.Figure:
    """Stacked bars per (world size, rank): sharded weights, replicated weights, KV cache (MB)."""
    rows = memory_rows(results)
    x = [f"{r['ranks']} rank{'s' if r['ranks'] > 1 else ''}: rank {r['rank']}" for r in rows]
    fig = go.Figure()
    for key, name in (("sharded weights B", "sharded weights (blocks)"),
                      ("replicated B", "replicated (embeddings, norms, head)"),
                      ("KV cache B", "KV cache")):
        fig.add_trace(go.Bar(x=x, y=[sig(r[key] / unit) for r in rows], name=name))
    fig.update_layout(barmode="stack")
    return style(fig, "What each process holds (MB = 10⁶ bytes)", y="MB", width=720, height=380)


# --------------------------------------------------------------------------------------------
# Analytic: a big model on real interconnects (PAR-1, PAR-2)
# --------------------------------------------------------------------------------------------

def link(bandwidth_gbs: float, latency_us: float = LATENCY_US) -> rl.Interconnect:
    """An interconnect of ``bandwidth_gbs`` GB/s per direction and ``latency_us`` per ring step."""
    return rl.Interconnect(f"{bandwidth_gbs:g} GB/s, {latency_us:g} µs", bandwidth_gbs * rl.GB,
                           latency_us * 1e-6)


def tp_rows(model: str = "llama-2-70b", hardware: str = "h100", link_name: str = "nvlink-h100",
            batch: int = 1, context: int = 4096, degrees: tuple[int, ...] = tuple(DEGREES),
            precision: str = "bf16") -> list[dict]:
    """:func:`minifer_course.roofline.tp_table` as rows: per-device GB, ms per token split into reading
    and all-reducing, tokens/s of the group and per device."""
    rows = []
    for t in rl.tp_table(model, hardware, degrees, link_name, batch, context, precision):
        rows.append({"degree": t.degree, "GB per device": round(t.memory_per_device / rl.GB, 1),
                     "fits": t.fits, "read ms": round(max(t.read_s, t.compute_s) * 1e3, 2),
                     "all-reduce ms": round(t.comm_s * 1e3, 2), "ms/token": round(t.tpot_ms, 2),
                     "tok/s per device": round(t.tokens_per_s_per_device, 1)})
    return rows


def tp_text(**kwargs) -> str:
    """:func:`tp_rows` as plain text."""
    return table(tp_rows(**kwargs), floatfmt="{:,.2f}")


def tp_figure(degree: int = 8, bandwidth_gbs: float = 450, batch: int = 1,
              model: str = "llama-2-70b", hardware: str = "h100", context: int = 4096,
              latency_us: float = LATENCY_US, precision: str = "bf16") -> go.Figure:
    """Tensor parallelism on `hardware` joined by a ``bandwidth_gbs`` link, three panels.

    1. Per-device memory (weights + KV cache of ``batch × context`` tokens) for each degree,
       against the device's memory: the model must be split to fit (PAR-1).
    2. Time per output token for each degree: reading the device's share (falls as 1/N) plus
       the all-reduces (grow with N, fall with bandwidth): communication is on the critical path.
    3. The latency/throughput trade-off (PAR-2): for each degree, batch 1 ... 128, time per token
       (latency) against tokens/s per device (throughput, what a fixed fleet of devices serves).
    The selected ``degree`` is highlighted and summarised in the title.
    """
    if degree not in DEGREES:
        raise ValueError(f"degree must be one of {DEGREES}, got {degree!r}")
    if not bandwidth_gbs > 0:
        raise ValueError(f"bandwidth_gbs must be > 0, got {bandwidth_gbs!r}")
    lk = link(bandwidth_gbs, latency_us)
    hw = rl.Hardware.preset(hardware)
    runs = rl.tp_table(model, hardware, DEGREES, lk, batch, context, precision)
    sel = runs[DEGREES.index(degree)]
    names = [str(d) for d in DEGREES]
    colors = ["crimson" if d == degree else "steelblue" for d in DEGREES]

    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.09,
                        subplot_titles=("memory per device (GB)", "time per token (ms)",
                                        "latency vs throughput, batch 1–128"))
    fig.add_trace(go.Bar(x=names, y=[sig(t.weight_bytes_per_device / rl.GB) for t in runs],
                         name="weights", marker_color="steelblue"), 1, 1)
    fig.add_trace(go.Bar(x=names, y=[sig(t.kv_bytes_per_device / rl.GB) for t in runs],
                         name="KV cache", marker_color="lightsteelblue"), 1, 1)
    reference_line(fig, y=sig(hw.memory_bytes / rl.GB), row=1, col=1,
                   text=f"{hw.memory_bytes / rl.GB:.0f} GB per device", position="top right")
    fig.add_trace(go.Bar(x=names, y=[sig(max(t.read_s, t.compute_s) * 1e3) for t in runs],
                         name="read/compute share", marker_color="seagreen"), 1, 2)
    fig.add_trace(go.Bar(x=names, y=[sig(t.comm_s * 1e3) for t in runs], name="all-reduce",
                         marker_color="darkorange"), 1, 2)
    for d, c in zip(DEGREES, colors, strict=True):
        pts = [rl.tp_decode(model, hardware, d, lk, b, context, precision) for b in BATCHES]
        pts = [p for p in pts if p.fits]
        fig.add_trace(go.Scatter(
            x=[sig(p.tpot_ms) for p in pts], y=[sig(p.tokens_per_s_per_device) for p in pts],
            mode="lines+markers", name=f"degree {d}", line=dict(color=c, width=3 if d == degree else 1),
            text=[f"batch {p.batch}" for p in pts], showlegend=False), 1, 3)
        if pts:  # on log axes an annotation's position is log10 of the value
            fig.add_annotation(x=sig(math.log10(pts[0].tpot_ms)),
                               y=sig(math.log10(pts[0].tokens_per_s_per_device)),
                               text=f"TP{d}", showarrow=False, xshift=-16, row=1, col=3)
    fig.update_layout(barmode="stack")
    for col in (1, 2):  # categories: a bar and a label for each of 1, 2, 4, 8 (no empty "6")
        fig.update_xaxes(title_text="TP degree", type="category", row=1, col=col)
    fig.update_xaxes(title_text="ms per token (latency)", row=1, col=3)
    fig.update_yaxes(title_text="tokens/s per device", row=1, col=3)
    log_axis(fig, "x", row=1, col=3)
    log_axis(fig, "y", row=1, col=3)
    fit = "fits" if sel.fits else "does NOT fit"
    title = (f"{sel.model} on {hw.name} × {degree}, link {lk.name}, batch {batch}, "
             f"{context:,}-token context<br>degree {degree}: {sel.memory_per_device / rl.GB:.1f} "
             f"GB per device ({fit}), {sel.tpot_ms:.2f} ms/token of which all-reduce "
             f"{sel.comm_s * 1e3:.2f} ms ({sel.comm_fraction:.0%}), "
             f"{sel.tokens_per_s_per_device:,.1f} tok/s per device")
    return style(fig, title, width=1050, height=420, title_size=12, top=100)


def panel(degree: int = 8, bandwidth_gbs: float = 450, latency_us: float = LATENCY_US,
          batch: int = 1) -> widgets.interactive:
    """Controls for :func:`tp_figure`: TP degree, the interconnect's bandwidth (GB/s per
    direction) and latency (µs per ring step), and the batch."""
    return _panel(
        tp_figure,
        degree=control("select", "TP degree", options=DEGREES, value=degree),
        bandwidth_gbs=control("select", "link GB/s", options=BANDWIDTHS_GBS, value=bandwidth_gbs),
        latency_us=control("select", "link latency µs", options=LATENCIES_US, value=latency_us),
        batch=control("select", "batch", options=BATCHES, value=batch),
    )


def best_degrees(bandwidth_gbs: float, batch: int = 1, model: str = "llama-2-70b",
                 hardware: str = "h100", context: int = 4096,
                 latency_us: float = LATENCY_US) -> dict:
    """Among the degrees where the model fits: the one with the lowest latency and the one with
    the most tokens/s per device (PAR-2: they differ)."""
    runs = [t for t in rl.tp_table(model, hardware, DEGREES, link(bandwidth_gbs, latency_us),
                                   batch, context) if t.fits]
    if not runs:
        raise ValueError(f"{model} does not fit on {DEGREES[-1]} × {hardware} at batch {batch}")
    return {"lowest latency": min(runs, key=lambda t: t.tpot_s).degree,
            "highest throughput per device": max(runs, key=lambda t: t.tokens_per_s_per_device).degree}


def best_throughput_rows(bandwidth_gbs: float = 450, model: str = "llama-2-70b",
                         hardware: str = "h100", context: int = 4096,
                         latency_us: float = LATENCY_US) -> list[dict]:
    """For each degree at which the model fits, its best point on the latency/throughput panel
    of :func:`tp_figure`: the largest batch of ``BATCHES`` whose KV cache still fits beside the
    weights, and the tokens/s per device and ms/token there (PAR-2 read off the figure)."""
    lk = link(bandwidth_gbs, latency_us)
    rows = []
    for d in DEGREES:
        pts = [p for p in (rl.tp_decode(model, hardware, d, lk, b, context) for b in BATCHES)
               if p.fits]
        if not pts:
            continue
        best = max(pts, key=lambda p: p.tokens_per_s_per_device)
        rows.append({"TP degree": d, "largest batch that fits": pts[-1].batch,
                     "best tok/s per device": round(best.tokens_per_s_per_device, 1),
                     "at batch": best.batch, "ms/token there": round(best.tpot_ms, 2)})
    return rows
