"""Lesson 08, part 1: paged vs reserve-the-maximum KV memory (KV-12), arithmetic over
:mod:`minifer_course.roofline` and a seeded set of sequence lengths, with block-size and context sliders.
"""

from __future__ import annotations

import functools
import math

import ipywidgets as widgets
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from minifer.checks import check_int

from .. import roofline as rl
from ..workload import LogNormal
from .common import control, log_axis, panel, sig, wide_layout

# =============================================================================================
# 1. Paged vs reserve-the-maximum KV memory (KV-12), arithmetic
# =============================================================================================

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CONTEXTS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
TYPICAL_LENGTH = LogNormal(median=300, sigma=0.8, lo=16, hi=10**9)
"""Lengths (prompt + answer, tokens) of the sequences in the KV-12 example: median 300, a long
tail, clipped to the context. (vLLM's paper: ShareGPT requests average ~160 prompt + ~340 output
tokens.)"""


@functools.lru_cache(maxsize=64)
def sequence_lengths(context: int, n: int = 1000, seed: int = 0,
                     lengths: LogNormal = TYPICAL_LENGTH) -> tuple[int, ...]:
    """``n`` seeded sequence lengths from ``lengths``, none longer than ``context``."""
    import random

    rng = random.Random(f"{seed}-kv12")
    return tuple(min(lengths.sample(rng), context) for _ in range(n))


def paging_rows(context: int = 2048, block_size: int = 16, model: str = "llama-3-8b",
                hardware: str = "a100-80gb", precision: str = "fp16", n: int = 1000,
                seed: int = 0) -> dict:
    """KV memory of ``n`` sequences (lengths from :func:`sequence_lengths`) under two schemes:

    * **reserve**: every sequence gets room for ``context`` tokens up front (contiguous, as
      servers before PagedAttention did): everything past its real length is wasted;
    * **paged**: the cache is a pool of ``block_size``-token blocks; a sequence holds
      ceil(length / block size) of them, so only the unfilled tail of its last block is wasted.

    Also: how many such sequences fit in the device memory left after the weights.
    """
    check_int("context", context, 1)
    check_int("block_size", block_size, 1)
    lens = sequence_lengths(context, n, seed)
    used = sum(lens)
    reserved = n * context
    paged = sum(math.ceil(x / block_size) * block_size for x in lens)
    per_token = rl.kv_bytes_per_token(model, precision)
    hw = rl.Hardware.preset(hardware)
    room = hw.memory_bytes - rl.weight_bytes(model, precision)
    room_tokens = rl.kv_tokens_fit(model, room, precision)
    return {
        "model": rl.ModelSpec.preset(model).name, "hardware": hw.name, "context": context,
        "block_size": block_size, "sequences": n, "mean_length": used / n,
        "used_tokens": used, "reserved_tokens": reserved, "paged_tokens": paged,
        "reserve_waste": 1 - used / reserved, "paged_waste": 1 - used / paged,
        "bytes_per_token": per_token, "room_bytes": room, "room_tokens": room_tokens,
        "fit_reserve": room_tokens // context,
        "fit_paged": int(room_tokens // (paged / n)),  # on average, for lengths like these
        "fit_ideal": int(room_tokens // (used / n)),
    }


def paging_figure(context: int = 2048, block_size: int = 16, model: str = "llama-3-8b",
                  hardware: str = "a100-80gb", precision: str = "fp16") -> go.Figure:
    """Left: of the KV memory each scheme allocates, the share holding real tokens and the share
    wasted. Middle: the waste of paging against the block size (selected one marked).
    Right: sequences that fit beside the weights (KV-12)."""
    p = paging_rows(context, block_size, model, hardware, precision)
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.09, column_widths=[0.3, 0.4, 0.3],
                        subplot_titles=("KV memory allocated", "paging's waste by block size",
                                        "sequences that fit"))
    schemes = [f"reserve {context:,}", f"paged, block {block_size}"]
    used = [1 - p["reserve_waste"], 1 - p["paged_waste"]]
    fig.add_trace(go.Bar(x=schemes, y=[sig(100 * u, 4) for u in used], name="holds tokens",
                         marker_color="seagreen"), 1, 1)
    fig.add_trace(go.Bar(x=schemes, y=[sig(100 * (1 - u), 4) for u in used], name="wasted",
                         marker_color="indianred"), 1, 1)
    fig.update_layout(barmode="stack")
    waste = [sig(100 * paging_rows(context, b, model, hardware, precision)["paged_waste"], 4)
             for b in BLOCK_SIZES]
    fig.add_trace(go.Scatter(x=list(BLOCK_SIZES), y=waste, mode="lines+markers",
                             name="paged waste", line=dict(color="indianred")), 1, 2)
    fig.add_trace(go.Scatter(x=[block_size], y=[sig(100 * p["paged_waste"], 4)], mode="markers",
                             showlegend=False, marker=dict(size=13, color="crimson")), 1, 2)
    fig.add_trace(go.Bar(x=["reserve", "paged", "no waste"],
                         y=[p["fit_reserve"], p["fit_paged"], p["fit_ideal"]],
                         text=[f"{v:,}" for v in (p["fit_reserve"], p["fit_paged"],
                                                  p["fit_ideal"])],
                         textposition="outside", showlegend=False,
                         marker_color=["indianred", "seagreen", "lightgray"]), 1, 3)
    fig.update_yaxes(title_text="% of allocated KV memory", range=[0, 106],
                     tickvals=[0, 20, 40, 60, 80, 100], row=1, col=1)  # room for the subplot title
    log_axis(fig, "x", values=BLOCK_SIZES, title_text="block size (tokens)", row=1, col=2)
    fig.update_yaxes(title_text="% wasted", row=1, col=2)
    fig.update_yaxes(title_text="sequences", row=1, col=3)
    title = (f"{p['model']} ({precision} cache) on {p['hardware']}, sequences of ~"
             f"{p['mean_length']:,.0f} tokens, context {context:,}: reserving wastes "
             f"{p['reserve_waste']:.0%}, blocks of {block_size} waste {p['paged_waste']:.1%}"
             f"<br>{p['fit_reserve']:,} sequences fit reserved, {p['fit_paged']:,} paged "
             f"({p['fit_paged'] / p['fit_reserve']:.1f}×)")
    return wide_layout(fig, title, width=1050, height=420)


def paging_panel(context: int = 2048, block_size: int = 16) -> widgets.interactive:
    """Sliders for :func:`paging_figure`: the context length reserved and the block size."""

    def figure(context: int = context, block_size: int = block_size) -> go.Figure:
        return paging_figure(context, block_size)

    return panel(figure,
                 context=control("select", "context", options=list(CONTEXTS), value=context),
                 block_size=control("select", "block size", options=list(BLOCK_SIZES),
                                    value=block_size))
