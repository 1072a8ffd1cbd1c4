"""Lesson: prefill versus decode on the roofline (claims PD-*, BATCH-2, QUANT-2, QUANT-5).

Pure figure builders (slider values → ``go.Figure``) over :mod:`minifer_course.roofline`, and
:func:`panel`, the controls of the notebook that call them. All numbers come from the
analytic model, rounded to 6 significant digits so a stored figure compares equal on re-run.
"""

from __future__ import annotations

import math

import ipywidgets as widgets
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .. import roofline as rl
from ..bench.probes import this_machine
from ..bench.reference import DECODE
from .common import control, log_axis, precision_options, sig, style, table
from .common import panel as _panel

MODEL_CHOICES = ["llama-3-8b", "llama-7b", "6.74b", "llama-2-70b", "reference"]
HARDWARE_CHOICES = list(rl.HARDWARE)
PRECISIONS = list(rl.BYTES_PER_VALUE)
BATCHES = [2**i for i in range(12)]  # 1 ... 2048
CONTEXTS = [0, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
PROMPTS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000]  # tokens
PD8_BATCHES = (1, 8, 32, 128, 256, 512, 1024)


def _hardware(name: str) -> rl.Hardware:
    """A preset accelerator, or "this-machine": this CPU, measured once (about a second)."""
    return this_machine() if name == "this-machine" else rl.Hardware.preset(name)


def _step(model: str, hardware: rl.Hardware, precision: str, batch: int,
          context: int) -> rl.DecodeEstimate:
    # KV reads and attention FLOPs are on: at context 0 they are zero, so the simple model's
    # numbers (PD-8) come out exactly; slide the context up to see what it leaves out (PD-11).
    return rl.decode_time(model, hardware, batch=batch, context=context, precision=precision,
                          include_kv=True, include_attention=True)


def _title(s: rl.DecodeEstimate) -> str:
    return (f"{s.model}, {s.precision}, batch {s.batch:,}, context {s.context:,}: "
            f"TPOT {s.tpot_s * 1e3:.2f} ms, {s.bound}-bound, "
            f"{s.tokens_per_s_total:,.0f} tok/s total ({s.tokens_per_s_per_user:,.0f} per user)")


_MAX_LINE = dict(width=8, color="rgba(214,39,40,0.3)")  # max(read, compute): wide, pale, underneath

def decode_figure(model: str = "llama-3-8b", precision: str = "bf16", batch: int = 1,
                  hardware: str = "illustrative", context: int = 0) -> go.Figure:
    """Three views of one decode step as the batch grows.

    Left: the roofline (attainable TFLOP/s against FLOP per byte) with this step on it.
    Middle: read time, compute time and TPOT = max of the two, per batch size (PD-8).
    Right: tokens/s for the whole server and per user (BATCH-2): the total climbs while the
    step stays memory-bound, then flattens; each user's speed is flat, then falls.
    """
    hw = _hardware(hardware)
    this = _step(model, hw, precision, batch, context)
    peak, bw = hw.peak_flops(this.compute_precision), hw.bandwidth
    ridge = peak / bw
    steps = [_step(model, hw, precision, b, context) for b in BATCHES]

    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.08, subplot_titles=(
        f"roofline (ridge {ridge:,.0f} FLOP/byte)", "time per decode step", "throughput"))
    ai = [0.1, ridge, 1e5]
    fig.add_trace(go.Scatter(x=[sig(x) for x in ai], y=[sig(min(peak, x * bw) / 1e12) for x in ai],
                             mode="lines", name="roof", line=dict(color="black")), 1, 1)
    fig.add_trace(go.Scatter(x=[sig(this.arithmetic_intensity)],
                             y=[sig(this.flops / this.tpot_s / 1e12)], mode="markers",
                             name=f"batch {batch}", marker=dict(size=12, color="crimson")), 1, 1)

    x = BATCHES
    # TPOT = max(read, compute) lies on one of the two: drawn first, wide and pale, so the
    # thin read and compute lines stay visible on top of it
    for name, ys, line in (("TPOT", [s.tpot_s for s in steps], _MAX_LINE),
                           ("read", [s.read_s for s in steps], dict(dash="dot", width=2.5)),
                           ("compute", [s.compute_s for s in steps], dict(dash="dash", width=2.5))):
        fig.add_trace(go.Scatter(x=x, y=[sig(y * 1e3) for y in ys], mode="lines", name=name,
                                 line=line), 1, 2)
    fig.add_trace(go.Scatter(x=[batch], y=[sig(this.tpot_s * 1e3)], mode="markers",
                             showlegend=False, marker=dict(size=12, color="crimson")), 1, 2)

    fig.add_trace(go.Scatter(x=x, y=[sig(s.tokens_per_s_total) for s in steps],
                             mode="lines", name="tok/s total"), 1, 3)
    fig.add_trace(go.Scatter(x=x, y=[sig(s.tokens_per_s_per_user) for s in steps],
                             mode="lines", name="tok/s per user"), 1, 3)
    fig.add_trace(go.Scatter(x=[batch, batch], y=[sig(this.tokens_per_s_total),
                                                  sig(this.tokens_per_s_per_user)],
                             mode="markers", showlegend=False,
                             marker=dict(size=12, color="crimson")), 1, 3)

    fig.update_xaxes(type="log")
    fig.update_yaxes(type="log")
    fig.update_xaxes(title_text="FLOP per byte", row=1, col=1)
    fig.update_yaxes(title_text="TFLOP/s", row=1, col=1)
    for axis in ("xaxis2", "xaxis3"):  # batches are powers of two: label some of them
        log_axis(fig, axis, values=BATCHES[::2], title_text="batch")
    fig.update_yaxes(title_text="ms", row=1, col=2)
    fig.update_yaxes(title_text="tokens/s", row=1, col=3)
    return style(fig, _title(this), width=900, height=400)


def prefill_figure(model: str = "llama-3-8b", precision: str = "bf16",
                   prompt_tokens: int = 2000, hardware: str = "illustrative") -> go.Figure:
    """Prefill time against prompt length (PD-1, PD-7): reading the weights costs the same for
    any prompt, the arithmetic grows with it, so long prompts are compute-bound and TTFT grows."""
    p = rl.prefill_time(model, hardware, prompt_tokens, precision=precision)
    runs = [rl.prefill_time(model, hardware, t, precision=precision) for t in PROMPTS]
    fig = go.Figure()
    for name, ys, line in (("TTFT", [s.ttft_s for s in runs], _MAX_LINE),
                           ("read weights", [s.read_s for s in runs], dict(dash="dot", width=2.5)),
                           ("compute", [s.compute_s for s in runs], dict(dash="dash", width=2.5))):
        fig.add_trace(go.Scatter(x=PROMPTS, y=[sig(y * 1e3) for y in ys], mode="lines",
                                 name=name, line=line))
    fig.add_trace(go.Scatter(x=[prompt_tokens], y=[sig(p.ttft_s * 1e3)], mode="markers",
                             name=f"{prompt_tokens:,} tokens",
                             marker=dict(size=12, color="crimson")))
    fig.update_xaxes(type="log", title_text="prompt tokens")
    fig.update_yaxes(type="log", title_text="ms")
    title = (f"{p.model}, {precision}: prefill of {prompt_tokens:,} tokens = "
             f"{p.flops / 1e12:,.3g} TFLOP, TTFT {p.ttft_s * 1e3:,.2f} ms, {p.bound}-bound")
    return style(fig, title, width=720, height=360)


def pd8_rows(model: str = "llama-3-8b", hardware: str = "illustrative", precision: str = "bf16",
             batches: tuple[int, ...] = PD8_BATCHES, context: int = 0) -> list[dict]:
    """The roofline table of claim PD-8 as rows of display-rounded numbers.

    Times in ms to 2 decimals, tokens/s to whole tokens (187.5 → 188, as the claim prints it).
    """
    rows = []
    for s in rl.roofline_table(model, hardware, batches, context=context, precision=precision,
                               include_kv=True, include_attention=True):
        rows.append({"batch": s.batch, "read ms": round(s.read_s * 1e3, 2),
                     "compute ms": round(s.compute_s * 1e3, 3), "TPOT ms": round(s.tpot_ms, 2),
                     "bound": s.bound, "tok/s per user": round(s.tokens_per_s_per_user),
                     "tok/s total": round(s.tokens_per_s_total)})
    return rows


_PD8_FORMATS = {"read ms": "{:,.2f}", "compute ms": "{:,.3f}", "TPOT ms": "{:,.2f}"}


def pd8_text(**kwargs) -> str:
    """:func:`pd8_rows` as a plain-text table (stable output for a notebook cell)."""
    rows = [{k: _PD8_FORMATS[k].format(v) if k in _PD8_FORMATS else v for k, v in r.items()}
            for r in pd8_rows(**kwargs)]
    return table(rows)


def pd8_table_figure(**kwargs) -> go.Figure:
    """:func:`pd8_rows` as a plotly table (same keyword arguments)."""
    rows = pd8_rows(**kwargs)
    cols = list(rows[0])
    cells = [[f"{r[c]:,}" if isinstance(r[c], (int, float)) else r[c] for r in rows]
             for c in cols]
    fig = go.Figure(go.Table(header=dict(values=cols), cells=dict(values=cells)))
    style(fig, "", width=720, height=60 + 30 * len(rows), top=10)
    fig.update_layout(margin=dict(l=10, r=10, b=10))  # a table needs no room for axes
    return fig


def panel(model: str = "llama-3-8b", precision: str = "bf16", batch: int = 1,
          hardware: str = "illustrative", context: int = 0,
          measured: bool = False) -> widgets.interactive:
    """Controls for :func:`decode_figure`: model, precision, batch, hardware, context length.

    ``measured=True`` adds "this-machine" to the hardware list (measured on first use, ~1 s).
    """
    hardware_options = HARDWARE_CHOICES + (["this-machine"] if measured else [])
    return _panel(
        decode_figure,
        model=control("dropdown", "model", options=MODEL_CHOICES, value=model),
        precision=control("select", "weights", options=precision_options(PRECISIONS),
                          value=precision),
        batch=control("select", "batch", options=BATCHES, value=batch),
        hardware=control("dropdown", "hardware", options=hardware_options, value=hardware),
        context=control("select", "context", options=CONTEXTS, value=context),
    )


def prefill_panel(model: str = "llama-3-8b", precision: str = "bf16", prompt_tokens: int = 2000,
                  hardware: str = "illustrative") -> widgets.interactive:
    """Controls for :func:`prefill_figure`: model, precision, prompt length, hardware."""
    return _panel(
        prefill_figure,
        model=control("dropdown", "model", options=MODEL_CHOICES, value=model),
        precision=control("select", "weights", options=precision_options(PRECISIONS),
                          value=precision),
        prompt_tokens=control("select", "prompt", options=PROMPTS, value=prompt_tokens),
        hardware=control("dropdown", "hardware", options=HARDWARE_CHOICES, value=hardware),
    )


# --------------------------------------------------------------------------------------------
# This machine: measured decode steps laid over its own (measured) roofline
# --------------------------------------------------------------------------------------------

BATCH1_REFERENCE_MS = DECODE["batch_ms"]  # claim BATCH-1's reference CPU, ms per step
MEASURED_BATCHES = [2**i for i in range(9)]  # 1 ... 256: the roofline curves of the figure


def _machine_step(spec: rl.ModelSpec | str, hw: rl.Hardware, batch: int, context: int,
                  precision: str) -> rl.DecodeEstimate:
    # KV reads and attention FLOPs on: that is what the measured step really does.
    return rl.decode_time(spec, hw, batch=batch, context=context, precision=precision,
                          include_kv=True, include_attention=True)


def _check_measured(batches, step_s) -> tuple[list[int], list[float]]:
    batches, step_s = list(batches), list(step_s)
    if not batches or len(batches) != len(step_s):
        raise ValueError("batches and step_s must be non-empty and equally long")
    if any(t <= 0 for t in step_s):
        raise ValueError("measured step times must be > 0 seconds")
    return batches, step_s


def measured_rows(hw: rl.Hardware, spec: rl.ModelSpec | str, batches, step_s,
                  context: int = 64, precision: str = "fp32",
                  reference_ms: dict[int, float] | None = None) -> list[dict]:
    """Measured decode steps next to this machine's roofline, one row per batch size.

    ``step_s[i]`` is the measured time of one decode step of ``batches[i]`` sequences with
    ``context`` tokens cached each. MBU = (weights + KV bytes) / step / bandwidth and
    MFU = FLOPs / step / peak FLOP/s, both against ``hw``'s (measured) ceilings (PD-10).
    ``reference_ms`` (default: claim BATCH-1's figures) adds a column where it has the batch.
    """
    batches, step_s = _check_measured(batches, step_s)
    reference_ms = BATCH1_REFERENCE_MS if reference_ms is None else reference_ms
    rows = []
    for b, t in zip(batches, step_s):
        s = _machine_step(spec, hw, b, context, precision)
        row = {"batch": b, "measured ms": round(t * 1e3, 2), "roofline ms": round(s.tpot_ms, 2),
               "bound": s.bound, "tok/s total": round(b / t),
               "MBU": round(rl.mbu(s.weight_bytes, s.kv_bytes, t, hw.bandwidth), 3),
               "MFU": round(rl.mfu(s.flops / t, hw.peak_flops(s.compute_precision)), 3)}
        if reference_ms:
            row["claim ms"] = reference_ms.get(b, "")
        rows.append(row)
    return rows


def measured_figure(hw: rl.Hardware, spec: rl.ModelSpec | str, batches, step_s,
                    context: int = 64, precision: str = "fp32",
                    reference_ms: dict[int, float] | None = None) -> go.Figure:
    """Left: time per decode step against batch — this machine's roofline (read, compute,
    max of the two) and the measured steps. Right: the roofline of this machine (attainable
    GFLOP/s against FLOP per byte) with each measured step placed on it."""
    batches, step_s = _check_measured(batches, step_s)
    reference_ms = BATCH1_REFERENCE_MS if reference_ms is None else reference_ms
    spec = spec if isinstance(spec, rl.ModelSpec) else rl.ModelSpec.preset(spec)
    curve = [_machine_step(spec, hw, b, context, precision) for b in MEASURED_BATCHES]
    measured = [_machine_step(spec, hw, b, context, precision) for b in batches]
    peak = hw.peak_flops(measured[0].compute_precision)
    ridge = peak / hw.bandwidth

    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1, subplot_titles=(
        "time per decode step", f"roofline of this machine (ridge {ridge:,.1f} FLOP/byte)"))
    for name, ys, dash in (("roofline: read", [s.read_s for s in curve], "dot"),
                           ("roofline: compute", [s.compute_s for s in curve], "dash"),
                           ("roofline: max", [s.tpot_s for s in curve], "solid")):
        fig.add_trace(go.Scatter(x=MEASURED_BATCHES, y=[sig(y * 1e3) for y in ys], mode="lines",
                                 name=name, line=dict(dash=dash, color="gray")), 1, 1)
    fig.add_trace(go.Scatter(x=batches, y=[sig(t * 1e3) for t in step_s], mode="lines+markers",
                             name="measured", marker=dict(size=10, color="crimson")), 1, 1)
    ref = [(b, reference_ms[b]) for b in batches if b in (reference_ms or {})]
    if ref:
        fig.add_trace(go.Scatter(x=[b for b, _ in ref], y=[m for _, m in ref], mode="markers",
                                 name="claim BATCH-1 (reference CPU)",
                                 marker=dict(symbol="x", size=9, color="black")), 1, 1)

    ai = [0.05, ridge, max(1e3, 10 * ridge)]
    fig.add_trace(go.Scatter(x=[sig(x) for x in ai], y=[sig(min(peak, x * hw.bandwidth) / 1e9)
                                                       for x in ai],
                             mode="lines", name="roof", line=dict(color="black"),
                             showlegend=False), 1, 2)
    fig.add_trace(go.Scatter(x=[sig(s.arithmetic_intensity) for s in measured],
                             y=[sig(s.flops / t / 1e9) for s, t in zip(measured, step_s)],
                             mode="markers+text", text=[f"batch {b}" for b in batches],
                             textposition=["top left" if i % 2 == 0 else "bottom right"
                                           for i in range(len(batches))],
                             name="measured (achieved)",
                             showlegend=False, marker=dict(size=10, color="crimson")), 1, 2)
    fig.update_xaxes(type="log")
    fig.update_yaxes(type="log")
    log_axis(fig, "xaxis", values=MEASURED_BATCHES, title_text="batch (sequences per step)")
    fig.update_yaxes(title_text="ms", row=1, col=1)
    fig.update_xaxes(title_text="FLOP per byte", row=1, col=2)
    fig.update_yaxes(title_text="GFLOP/s", row=1, col=2)
    title = (f"{spec.name}, {precision}, {context} tokens cached, on {hw.name}: "
             f"{hw.bandwidth / 1e9:,.1f} GB/s, {peak / 1e9:,.0f} GFLOP/s")
    return style(fig, title, width=900, height=400)


def mbu_sentence(mbu: float, batch: int = 1) -> str:
    """What a measured MBU says, in words for the reader of this run (no fixed numbers in prose)."""
    if mbu > 1:
        verdict = ("faster than the roofline allows: the CPU's caches held part of the model, so "
                   "fewer bytes came from memory than the roofline counts")
    elif mbu >= 0.6:
        verdict = "close to the roofline, so its time went to reading the weights"
    elif mbu >= 0.3:
        verdict = "within about 3× of the roofline: reading weights, plus overheads"
    else:
        verdict = ("well above the roofline's time: overheads (small kernels, threads, a busy "
                   "machine) cost more than the reading")
    return f"At batch {batch} this machine's step reached MBU {mbu:.0%}: {verdict}."


# --------------------------------------------------------------------------------------------
# The learner's own count: one decode step, linear layer by linear layer
# --------------------------------------------------------------------------------------------

def linear_bytes_figure(rows: list[dict]) -> go.Figure:
    """Where one decode step's weight reads go: MB read per kind of linear layer (all layers
    summed), each bar labelled with its share and its MFLOP per token.

    ``rows``: one dict per kind with ``layer``, ``MB`` and ``MFLOP`` (a learner's count)."""
    if not rows:
        raise ValueError("rows must hold at least one kind of layer")
    total = sum(r["MB"] for r in rows)
    fig = go.Figure(go.Bar(
        x=[r["layer"] for r in rows], y=[sig(r["MB"], 4) for r in rows],
        text=[f"{r['MB'] / total:.0%} · {r['MFLOP']:,.1f} MFLOP" for r in rows],
        textposition="outside", marker=dict(color="#1F77B4"), cliponaxis=False))
    fig.update_yaxes(range=[0, sig(max(r["MB"] for r in rows) * 1.2, 4)])
    return style(fig, f"One decode step reads {total:,.1f} MB of linear-layer weights "
                 "(bars: MB per kind of layer, all layers together)", "linear layer", "MB read")


def own_roofline_figure(bandwidth: float, peak_flops: float, points: list[dict],
                        title: str = "") -> go.Figure:
    """A roofline drawn from two measured ceilings, with measured decode steps placed on it.

    ``points``: one dict per step with ``batch``, ``FLOP/byte`` (the step's intensity) and
    ``GFLOP/s`` (its FLOPs over its measured time). The roof is min(peak, intensity ×
    bandwidth); a point under it is slower than the roofline allows."""
    if bandwidth <= 0 or peak_flops <= 0:
        raise ValueError("bandwidth and peak_flops must be > 0")
    if not points:
        raise ValueError("points must hold at least one measured step")
    ridge = peak_flops / bandwidth
    lo = min(0.1, min(p["FLOP/byte"] for p in points) / 2)
    hi = max(10 * ridge, max(p["FLOP/byte"] for p in points) * 2)
    xs = [lo, ridge, hi]
    fig = go.Figure(go.Scatter(x=[sig(x) for x in xs],
                               y=[sig(min(peak_flops, x * bandwidth) / 1e9) for x in xs],
                               mode="lines", name="roof: min(peak, intensity × bandwidth)",
                               line=dict(color="black")))
    fig.add_trace(go.Scatter(
        x=[sig(p["FLOP/byte"], 4) for p in points], y=[sig(p["GFLOP/s"], 4) for p in points],
        mode="markers+text", text=[f"batch {p['batch']}" for p in points],
        textposition=["top left" if i % 2 == 0 else "bottom right" for i in range(len(points))],
        name="your measured steps", marker=dict(size=10, color="crimson")))
    fig.add_vline(x=sig(ridge), line=dict(color="gray", dash="dot", width=1.5))
    fig.update_xaxes(type="log", title_text="FLOP per byte (your count)")
    fig.update_yaxes(type="log", title_text="GFLOP/s achieved",
                     range=[math.log10(min(lo * bandwidth, *(p["GFLOP/s"] * 1e9 / 2 for p in points))
                                       / 1e9), math.log10(peak_flops / 1e9 * 3)])
    return style(fig, title or f"Your roofline: {bandwidth / 1e9:,.1f} GB/s, "
                 f"{peak_flops / 1e9:,.0f} GFLOP/s, ridge {ridge:,.1f} FLOP/byte (dotted)",
                 width=720, height=400)
