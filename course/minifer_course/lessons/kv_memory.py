"""Lesson: how much memory the KV cache takes (claims KV-4 ... KV-11, BATCH-3).

Pure figure builders over :mod:`minifer_course.roofline`, and :func:`panel`, the controls that call them.
Units: figures use one unit throughout, chosen by ``unit``: "GiB" (binary, 2**30 bytes, the
unit of the cache claims: "2 GB per sequence" is 2 GiB) or "GB" (decimal, 1e9 bytes, the unit
of spec sheets and weights: "8B parameters × 2 bytes = 16 GB"). Titles say which.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import ipywidgets as widgets
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from minifer.cache import StaticKVCache
from minifer.config import LLAMA, GPTConfig
from minifer.generation import prefill

from .. import roofline as rl
from ..bench.common import random_ids
from .common import (
    REFERENCE,
    control,
    log_axis,
    precision_options,
    reference_line,
    sig,
    style,
    table,
)
from .common import panel as _panel

LLAMA_2_70B = GPTConfig(vocab_size=32000, context_length=4096, n_layer=80, n_head=64, n_embd=8192,
                        n_kv_head=8, intermediate_size=28672, **LLAMA)
"""Llama-2-70B's shape (GQA, 64 query heads over 8 K/V heads): build it on the meta device."""

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


_WEIGHTS, _CACHE = "#1F77B4", "#FF7F0E"


def _tokens_label(n: int) -> str:
    """512, 1K, 32K, 128K: contexts are powers of two, K = 1,024 tokens."""
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else f"{n:,}"


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

    fig = make_subplots(rows=1, cols=2, column_widths=[0.34, 0.66], horizontal_spacing=0.1,
                        subplot_titles=(f"{hw.name}", f"cache of {batch:,} sequence(s)"))
    memory = sig(hw.memory_bytes / scale)
    fig.add_trace(go.Bar(x=["memory"], y=[sig(weights / scale)], name="weights",
                         legendgroup="weights", marker_color=_WEIGHTS), 1, 1)
    fig.add_trace(go.Bar(x=["memory"], y=[sig(cache / scale)], name="KV cache",
                         legendgroup="cache", marker_color=_CACHE), 1, 1)
    over = weights + cache > hw.memory_bytes
    reference_line(fig, y=memory, row=1, col=1, color="#D62728" if over else REFERENCE,
                   text=f"device memory {memory:,.4g} {unit}"
                   + ("<br>the cache does not fit" if over else ""))
    fig.update_layout(barmode="stack")
    fig.update_yaxes(range=[0, max(memory, (weights + cache) / scale) * 1.12], row=1, col=1)

    sizes = [rl.kv_cache_bytes(spec, c, batch, precision) / scale for c in CONTEXTS]
    fig.add_trace(go.Scatter(x=CONTEXTS, y=[sig(y) for y in sizes], mode="lines+markers",
                             name="KV cache by context", legendgroup="cache", showlegend=False,
                             line=dict(color=_CACHE)), 1, 2)
    fig.add_trace(go.Scatter(x=CONTEXTS, y=[sig(weights / scale)] * len(CONTEXTS), mode="lines",
                             name="weights (size)", legendgroup="weights", showlegend=False,
                             line=dict(dash="dot", color=_WEIGHTS)), 1, 2)
    fig.add_trace(go.Scatter(x=CONTEXTS, y=[sig((hw.memory_bytes - weights) / scale)]
                             * len(CONTEXTS), mode="lines", name="room after weights",
                             line=dict(dash="dash", color=REFERENCE)), 1, 2)
    # the dotted line is labelled where it ends (the legend names only the left panel's bars)
    fig.add_annotation(x=1, xref="x2 domain", y=math.log10(weights / scale), yref="y2",
                       text=f"weights {weights / scale:,.4g} {unit}", showarrow=False,
                       xanchor="right", yanchor="bottom", font=dict(color=_WEIGHTS))
    fig.add_trace(go.Scatter(x=[context], y=[sig(cache / scale)], mode="markers",
                             showlegend=False, marker=dict(size=12, color="crimson")), 1, 2)
    log_axis(fig, "xaxis2", values=CONTEXTS, labels=[_tokens_label(c) for c in CONTEXTS],
             title_text="context (tokens per sequence)")
    fig.update_yaxes(type="log", title_text=unit, row=1, col=2)
    fig.update_yaxes(title_text=unit, row=1, col=1)

    title = (f"{spec.name}, cache in {precision}: {per_token_label(per_token)} per token × "
             f"{context:,} tokens × {batch:,} = {cache / scale:,.2f} {unit}<br>"
             f"weights ({weight_precision}) {weights / scale:,.2f} {unit}; "
             f"{'only ' if fits < batch else ''}{fits:,} sequences of {context:,} tokens fit "
             f"beside them in "
             f"{hw.memory_bytes / scale:,.1f} {unit}")
    return style(fig, title, width=900, height=380)


def gqa_figure(precision: str = "fp16",
               models: tuple[str, ...] = ("llama-2-70b-mha", "llama-2-70b", "llama-7b",
                                          "llama-3-8b")) -> go.Figure:
    """KV bytes per token of several models (KiB): grouped-query attention shrinks the cache by
    the group size, e.g. Llama-2-70B's 64 query heads share 8 K/V heads: 8× smaller (KV-9)."""
    specs = [rl.ModelSpec.preset(m) for m in models]
    kib = [sig(rl.kv_bytes_per_token(s, precision) / rl.KiB) for s in specs]
    labels = [f"{s.name}<br>{s.n_head} Q / {s.n_kv_head} KV heads" for s in specs]
    fig = go.Figure(go.Bar(x=labels, y=kib, text=[f"{k:,.0f}" for k in kib],
                           textposition="outside"))
    style(fig, f"KV cache per token ({precision}, KiB = 1,024 bytes)", y="KiB per token",
          width=720, height=380)
    fig.update_layout(margin=dict(b=80))  # two-line bar labels
    return fig


def gqa_measured_figure(rows: list[dict]) -> go.Figure:
    """The measured MHA / GQA / MQA comparison side by side: the cache a decode step reads (MiB)
    and the step's time (ms), from `rows` of the lesson's own run (keys ``attention``,
    ``cache MiB`` and ``ms per step``). Each panel's axis starts at zero."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("KV cache read per step (MiB)",
                                                        "decode step (ms, measured)"))
    names = [r["attention"] for r in rows]
    for col, key in ((1, "cache MiB"), (2, "ms per step")):
        values = [r[key] for r in rows]
        fig.add_trace(go.Bar(x=names, y=values, text=[f"{v:,.0f}" for v in values],
                             textposition="outside", showlegend=False), row=1, col=col)
        fig.update_yaxes(rangemode="tozero", range=[0, 1.2 * max(values)], row=1, col=col)
    return style(fig, "Same width and layers, fewer K/V heads: a smaller cache, a faster step", height=380)


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
    """Controls for :func:`kv_figure`: context, batch, cache precision, model, hardware,
    weights' precision and the unit of the figure."""
    return _panel(
        kv_figure,
        context=control("select", "context", options=CONTEXTS, value=context),
        batch=control("select", "batch", options=BATCHES, value=batch),
        precision=control("select", "cache", options=precision_options(PRECISIONS),
                          value=precision),
        model=control("dropdown", "model", options=MODEL_CHOICES, value=model),
        hardware=control("dropdown", "hardware", options=HARDWARE_CHOICES, value=hardware),
        weight_precision=control("select", "weights", options=precision_options(PRECISIONS),
                                 value=weight_precision),
        unit=control("dropdown", "unit", options=list(UNITS), value=unit),
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
    weights (:func:`minifer_course.roofline.max_batch`) against the batch at which a step turns
    compute-bound (:func:`minifer_course.roofline.critical_batch`). The smaller one is the limit."""
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
    with torch.inference_mode():  # weights packed at their first call (`minifer.fast`) are
        model(ids[:, :1])  # the weights' memory, not the pass's: packed before measuring
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
        fig.add_trace(go.Scatter(x=x, y=[sig(r[key]) for r in rows], mode="lines+markers",
                                 name=name, line=dict(dash=dash)))
    log_axis(fig, "xaxis", values=x, title_text="prompt tokens T")
    fig.update_yaxes(type="log", title_text="peak extra memory during prefill (MiB)")
    return style(fig, "Prefill peak memory: O(T²) with the score matrix, O(T) fused",
                 width=720, height=380)
