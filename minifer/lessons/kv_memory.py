"""Lesson: how much memory the KV cache takes (claims KV-4 ... KV-11, BATCH-3).

Pure figure builders over :mod:`minifer.roofline`, their slider callbacks, and :func:`panel`.
Units: figures use one unit throughout, chosen by ``unit``: "GiB" (binary, 2**30 bytes, the
unit of the cache claims: "2 GB per sequence" is 2 GiB) or "GB" (decimal, 1e9 bytes, the unit
of spec sheets and weights: "8B parameters × 2 bytes = 16 GB"). Titles say which.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import ipywidgets as widgets
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from .. import roofline as rl
from ..bench.decode import random_ids
from ..cache import StaticKVCache
from ..generation import prefill
from .common import TEMPLATE, table

MODEL_CHOICES = ["llama-3-8b", "llama-7b", "llama-2-70b", "llama-2-70b-mha", "80L-8kv",
                 "reference"]
HARDWARE_CHOICES = list(rl.HARDWARE)
PRECISIONS = list(rl.BYTES_PER_VALUE)
CONTEXTS = [2**i for i in range(9, 18)]  # 512 ... 131072 tokens
BATCHES = [2**i for i in range(0, 9)]  # 1 ... 256
UNITS = {"GiB": rl.GiB, "GB": rl.GB}


def _unit(unit: str) -> float:
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {list(UNITS)}, got {unit!r}")
    return UNITS[unit]


def _r(x: float) -> float:
    """Round to 6 significant digits: stable figure JSON, no visible loss."""
    return float(f"{x:.6g}")


def per_token_label(nbytes: float) -> str:
    """Bytes per token in the claims' style: '131,072 B = 128 KiB'."""
    return f"{nbytes:,.0f} B = {nbytes / rl.KiB:,.4g} KiB"


def kv_figure(context: int = 4096, batch: int = 1, precision: str = "fp16",
              model: str = "llama-3-8b", hardware: str = "a100-80gb",
              weight_precision: str = "fp16", unit: str = "GiB") -> go.Figure:
    """Where device memory goes: weights, then the KV cache of ``batch`` × ``context`` tokens.

    Left: one stacked bar (weights + cache) against the device's memory.
    Right: the cache against context length for this batch, with the weights' size (the cache
    outgrows them, KV-11) and the memory left after the weights (the cache must fit there).
    ``precision`` is the cache's; ``weight_precision`` the weights'.
    """
    scale = _unit(unit)
    spec, hw = rl.ModelSpec.preset(model), rl.Hardware.preset(hardware)
    per_token = rl.kv_bytes_per_token(spec, precision)
    weights = rl.weight_bytes(spec, weight_precision)
    cache = rl.kv_cache_bytes(spec, context, batch, precision)
    fits = rl.max_batch(spec, hw, context, weight_precision, kv_precision=precision)

    fig = make_subplots(rows=1, cols=2, column_widths=[0.3, 0.7], horizontal_spacing=0.12,
                        subplot_titles=(f"{hw.name}", f"cache of {batch:,} sequence(s)"))
    fig.add_trace(go.Bar(x=["memory"], y=[_r(weights / scale)], name="weights"), 1, 1)
    fig.add_trace(go.Bar(x=["memory"], y=[_r(cache / scale)], name="KV cache"), 1, 1)
    fig.add_hline(y=_r(hw.memory_bytes / scale), line_dash="dash", row=1, col=1,
                  annotation_text="device memory")
    fig.update_layout(barmode="stack")

    sizes = [rl.kv_cache_bytes(spec, c, batch, precision) / scale for c in CONTEXTS]
    fig.add_trace(go.Scatter(x=CONTEXTS, y=[_r(y) for y in sizes], mode="lines+markers",
                             name="KV cache by context"), 1, 2)
    fig.add_trace(go.Scatter(x=CONTEXTS, y=[_r(weights / scale)] * len(CONTEXTS), mode="lines",
                             name="weights (size)", line=dict(dash="dot")), 1, 2)
    fig.add_trace(go.Scatter(x=CONTEXTS, y=[_r((hw.memory_bytes - weights) / scale)]
                             * len(CONTEXTS), mode="lines", name="room after weights",
                             line=dict(dash="dash")), 1, 2)
    fig.add_trace(go.Scatter(x=[context], y=[_r(cache / scale)], mode="markers",
                             showlegend=False, marker=dict(size=12, color="crimson")), 1, 2)
    fig.update_xaxes(type="log", title_text="context (tokens per sequence)", row=1, col=2)
    fig.update_yaxes(type="log", title_text=unit, row=1, col=2)
    fig.update_yaxes(title_text=unit, row=1, col=1)

    title = (f"{spec.name}, cache in {precision}: {per_token_label(per_token)} per token × "
             f"{context:,} tokens × {batch:,} = {cache / scale:,.2f} {unit}<br>"
             f"weights ({weight_precision}) {weights / scale:,.2f} {unit}; "
             f"{fits:,} sequences of {context:,} tokens fit beside them in "
             f"{hw.memory_bytes / scale:,.1f} {unit}")
    fig.update_layout(title=dict(text=title, font=dict(size=12)), template=TEMPLATE,
                      width=1000, height=380, margin=dict(l=50, r=20, t=70, b=50))
    return fig


def show_kv(context: int = 4096, batch: int = 1, precision: str = "fp16",
            model: str = "llama-3-8b", hardware: str = "a100-80gb",
            weight_precision: str = "fp16", unit: str = "GiB") -> go.Figure:
    """Slider callback: build :func:`kv_figure`, show it, return it (for asserts)."""
    fig = kv_figure(context, batch, precision, model, hardware, weight_precision, unit)
    fig.show()
    return fig


def gqa_figure(precision: str = "fp16",
               models: tuple[str, ...] = ("llama-2-70b-mha", "llama-2-70b", "llama-7b",
                                          "llama-3-8b")) -> go.Figure:
    """KV bytes per token of several models (KiB): grouped-query attention shrinks the cache by
    the group size, e.g. Llama-2-70B's 64 query heads share 8 K/V heads: 8× smaller (KV-9)."""
    specs = [rl.ModelSpec.preset(m) for m in models]
    kib = [_r(rl.kv_bytes_per_token(s, precision) / rl.KiB) for s in specs]
    labels = [f"{s.name}<br>{s.n_head} Q / {s.n_kv_head} KV heads" for s in specs]
    fig = go.Figure(go.Bar(x=labels, y=kib, text=[f"{k:,.0f}" for k in kib],
                           textposition="outside"))
    fig.update_layout(title=f"KV cache per token ({precision}, KiB = 1,024 bytes)",
                      yaxis_title="KiB per token", template=TEMPLATE, width=720, height=380,
                      margin=dict(l=50, r=20, t=50, b=80))
    return fig


def kv_rows(model: str = "llama-3-8b", precision: str = "fp16",
            cases: tuple[tuple[int, int], ...] = ((1, 4096), (1, 32768), (1, 131072),
                                                  (32, 4096)),
            unit: str = "GiB") -> list[dict]:
    """KV-cache sizes for (batch, context) cases, as in claim KV-6 (default: Llama-3-8B)."""
    scale = _unit(unit)
    return [{"batch": b, "context": c,
             f"KV {unit}": round(rl.kv_cache_bytes(model, c, b, precision) / scale, 3)}
            for b, c in cases]


def kv_text(**kwargs) -> str:
    """:func:`kv_rows` as a plain-text table (stable output for a notebook cell)."""
    return table(kv_rows(**kwargs), floatfmt="{:,.3f}")


def panel(context: int = 4096, batch: int = 1, precision: str = "fp16",
          model: str = "llama-3-8b", hardware: str = "a100-80gb",
          weight_precision: str = "fp16", unit: str = "GiB") -> widgets.interactive:
    """Sliders for :func:`show_kv`: context, batch, cache precision, model, hardware, weights'
    precision and the unit of the figure."""
    return widgets.interactive(
        show_kv,
        context=widgets.SelectionSlider(options=CONTEXTS, value=context, description="context",
                                        continuous_update=False),
        batch=widgets.SelectionSlider(options=BATCHES, value=batch, description="batch",
                                      continuous_update=False),
        precision=widgets.Dropdown(options=PRECISIONS, value=precision, description="cache"),
        model=widgets.Dropdown(options=MODEL_CHOICES, value=model, description="model"),
        hardware=widgets.Dropdown(options=HARDWARE_CHOICES, value=hardware,
                                  description="hardware", style={"description_width": "initial"}),
        weight_precision=widgets.Dropdown(options=PRECISIONS, value=weight_precision,
                                          description="weights"),
        unit=widgets.Dropdown(options=list(UNITS), value=unit, description="unit"),
    )


# --------------------------------------------------------------------------------------------
# Units (KV-7, KV-8), the memory limit on batching (BATCH-3)
# --------------------------------------------------------------------------------------------

def kv8_rows(model: str = "80L-8kv", contexts: tuple[int, ...] = (32768, 32000), batch: int = 8,
             precision: str = "bf16") -> list[dict]:
    """Claim KV-8 both ways: a "32K" context as 32,768 tokens and as exactly 32,000, for one
    sequence and for ``batch`` of them, in decimal GB and binary GiB."""
    rows = []
    for c in contexts:
        one = rl.kv_cache_bytes(model, c, 1, precision)
        rows.append({"tokens": c, "1 seq GB": round(one / rl.GB, 2),
                     "1 seq GiB": round(one / rl.GiB, 2),
                     f"{batch} seqs GB": round(batch * one / rl.GB, 1),
                     f"{batch} seqs GiB": round(batch * one / rl.GiB, 1)})
    return rows


def batch3_rows(model: str = "llama-3-8b",
                hardware: tuple[str, ...] = ("a100-80gb", "h100", "illustrative"),
                contexts: tuple[int, ...] = (1024, 2048, 4096, 8192, 32768),
                precision: str = "bf16") -> list[dict]:
    """What limits the decode batch (BATCH-3): the sequences whose KV cache fits beside the
    weights (:func:`minifer.roofline.max_batch`) against the batch at which a step turns
    compute-bound (:func:`minifer.roofline.critical_batch`). The smaller one is the limit."""
    rows = []
    for h in hardware:
        crit = rl.critical_batch(model, h, precision)
        for c in contexts:
            fit = rl.max_batch(model, h, c, precision)
            rows.append({"hardware": rl.Hardware.preset(h).name, "context": c,
                         "fits in memory": fit, "compute-bound from": round(crit),
                         "limit": "memory" if fit < crit else "compute"})
    return rows


# --------------------------------------------------------------------------------------------
# Measured: peak memory of a prefill, plain attention math vs fused SDPA (KV-13)
# --------------------------------------------------------------------------------------------

@contextmanager
def _quiet_fd(fd: int = 2) -> Iterator[None]:
    """Send a file descriptor to /dev/null for a moment (torch's profiler logs a line to the
    C-level stderr when it starts and stops; in a notebook that would land in a later cell)."""
    saved, null = os.dup(fd), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, fd)
    try:
        yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)
        os.close(null)


def prefill_peak_bytes(model: torch.nn.Module, tokens: int, impl: str = "sdpa", *,
                       batch: int = 1, seed: int = 0) -> int:
    """Peak bytes a prefill of ``tokens`` tokens allocates, with attention ``impl``
    (``"math"``: scores written out; ``"sdpa"``: fused ``scaled_dot_product_attention``).

    Measured with ``torch.profiler`` (``profile_memory=True``), which records every allocation
    and free of torch's CPU allocator — kernels' scratch buffers included — in order; the peak is
    the running maximum of their sum. The weights and the (preallocated) KV cache exist before
    the prefill, so they are not counted: this is the *extra* memory the pass needs.
    """
    from torch.profiler import ProfilerActivity, profile

    blocks = list(model.transformer.h)
    old = [b.attn.impl for b in blocks]
    ids = random_ids(batch, tokens, model.config.vocab_size, seed,
                     next(model.parameters()).device)
    cache = StaticKVCache.for_model(model, batch, tokens)
    model.set_attention(impl)
    try:
        with torch.inference_mode(), _quiet_fd(2), \
                profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            prefill(model, ids, cache)
    finally:
        for b, i in zip(blocks, old):
            b.attn.impl = i
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def score_matrix_bytes(model: torch.nn.Module, tokens: int, batch: int = 1) -> int:
    """Bytes of one layer's attention scores during a prefill: batch × heads × T × T values."""
    cfg = model.config
    return batch * cfg.n_head * tokens * tokens * next(model.parameters()).element_size()


def attention_memory_rows(model: torch.nn.Module,
                          lengths: Sequence[int] = (128, 256, 512, 1024)) -> list[dict]:
    """Measured prefill peak (MiB) for each length, math vs SDPA, beside one score matrix."""
    return [{"tokens": t,
             "math MiB": round(prefill_peak_bytes(model, t, "math") / rl.MiB, 2),
             "sdpa MiB": round(prefill_peak_bytes(model, t, "sdpa") / rl.MiB, 2),
             "one score matrix MiB": round(score_matrix_bytes(model, t) / rl.MiB, 2)}
            for t in lengths]


def attention_memory_figure(rows: list[dict]) -> go.Figure:
    """Peak prefill memory against prompt length (log-log): the written-out attention grows
    like T² (slope 2), the fused kernel like T (slope 1) (KV-13)."""
    x = [r["tokens"] for r in rows]
    fig = go.Figure()
    for name, key, dash in (("attention math (scores written out)", "math MiB", "solid"),
                            ("fused SDPA", "sdpa MiB", "solid"),
                            ("one layer's T×T score matrix", "one score matrix MiB", "dot")):
        fig.add_trace(go.Scatter(x=x, y=[_r(r[key]) for r in rows], mode="lines+markers",
                                 name=name, line=dict(dash=dash)))
    fig.update_xaxes(type="log", title_text="prompt tokens T")
    fig.update_yaxes(type="log", title_text="peak extra memory during prefill (MiB)")
    fig.update_layout(title="Prefill peak memory: O(T²) with the score matrix, O(T) fused",
                      template=TEMPLATE, width=720, height=380,
                      margin=dict(l=60, r=20, t=50, b=50))
    return fig
