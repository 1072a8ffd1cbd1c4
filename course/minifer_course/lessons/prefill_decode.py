"""Lesson 02, prefill versus decode: the two kinds of forward pass, measured and explained.

:func:`measure` times the reference model on this machine (prefill of prompts of several lengths,
one decode step at the same numbers of cached tokens) with :mod:`minifer.bench_decode`, exactly as
``python -m minifer_course.bench decode`` does; the figure builders and the slider panel only read the
resulting :class:`Sweep`, so they are fast and testable without timing anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import ipywidgets as widgets
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from .. import roofline as rl
from ..bench.decode import time_decode_step, time_prefill
from ..bench.reference import DECODE as REFERENCE
from .common import control, log_axis, sig, style
from .common import panel as _panel

LENGTHS = (16, 64, 128, 256, 512, 1000)  # prompt tokens = cached tokens for decode (≤ 1023)


@dataclass(frozen=True)
class Sweep:
    """Measured times (median seconds) of one prefill and one decode step per length.

    ``prefill_s[i]``: a prefill of a ``lengths[i]``-token prompt (batch 1): the TTFT, minus
    sampling. ``decode_s[i]``: one decode step with ``lengths[i]`` tokens already cached: the
    time per output token (TPOT) at that point of a generation.
    """

    lengths: tuple[int, ...]
    prefill_s: tuple[float, ...]
    decode_s: tuple[float, ...]
    threads: int = 1

    def __post_init__(self) -> None:
        if not self.lengths or not (len(self.lengths) == len(self.prefill_s)
                                    == len(self.decode_s)):
            raise ValueError("lengths, prefill_s and decode_s must be non-empty and equally long")
        if any(t <= 0 for t in (*self.prefill_s, *self.decode_s)):
            raise ValueError("measured times must be > 0 seconds")

    def index(self, tokens: int) -> int:
        try:
            return self.lengths.index(tokens)
        except ValueError:
            raise ValueError(f"{tokens} was not measured; choose one of {list(self.lengths)}"
                             ) from None

    def ttft_s(self, tokens: int) -> float:
        return self.prefill_s[self.index(tokens)]

    def tpot_s(self, tokens: int) -> float:
        return self.decode_s[self.index(tokens)]

    def prefill_tokens_per_s(self, tokens: int) -> float:
        """Prompt tokens processed per second by one prefill of ``tokens`` tokens."""
        return tokens / self.ttft_s(tokens)

    def decode_tokens_per_s(self, tokens: int) -> float:
        """Tokens generated per second by one sequence decoding at ``tokens`` of context."""
        return 1 / self.tpot_s(tokens)


def measure(model: torch.nn.Module, lengths: Sequence[int] = LENGTHS, *, repeats: int = 3,
            decode_repeats: int = 7, seed: int = 0) -> Sweep:
    """Time prefill and one decode step at each length (medians after warm-up)."""
    lengths = tuple(lengths)
    time_prefill(model, min(lengths), warmup=1, repeats=1, seed=seed)  # lazy init, not counted
    pre = tuple(time_prefill(model, t, warmup=1, repeats=repeats, seed=seed).median_s
                for t in lengths)
    dec = tuple(time_decode_step(model, 1, t, warmup=2, repeats=decode_repeats,
                                 seed=seed).median_s for t in lengths)
    return Sweep(lengths, pre, dec, torch.get_num_threads())


def rows(sweep: Sweep) -> list[dict]:
    """The sweep as table rows (ms, tokens/s, and prefill's throughput advantage)."""
    return [{"tokens": t, "prefill ms": round(sweep.ttft_s(t) * 1e3, 1),
             "prefill tok/s": round(sweep.prefill_tokens_per_s(t)),
             "decode ms/token": round(sweep.tpot_s(t) * 1e3, 2),
             "decode tok/s": round(sweep.decode_tokens_per_s(t)),
             "throughput ratio": round(sweep.prefill_tokens_per_s(t)
                                       / sweep.decode_tokens_per_s(t), 1)}
            for t in sweep.lengths]


def reference_rows(sweep: Sweep, prompt_tokens: int = 512, context: int = 512) -> list[dict]:
    """Our prefill and decode figures beside claim PD-3's reference CPU figures.

    The source timed one decode step right after its 512-token prefill (``start = 512``), so
    the like-for-like decode step is the one with `context` = 512 tokens cached."""
    ours_pre, ours_dec = sweep.prefill_tokens_per_s(prompt_tokens), sweep.decode_tokens_per_s(
        context)
    return [
        {"": f"prefill {prompt_tokens} tokens", "ours ms": round(sweep.ttft_s(prompt_tokens) * 1e3, 1),
         "ours tok/s": round(ours_pre), "claim ms": REFERENCE["prefill_512_ms"],
         "claim tok/s": REFERENCE["prefill_tok_s"]},
        {"": f"decode ({context} cached)", "ours ms": round(sweep.tpot_s(context) * 1e3, 1),
         "ours tok/s": round(ours_dec), "claim ms": REFERENCE["decode_ms"],
         "claim tok/s": REFERENCE["decode_tok_s"]},
        {"": "prefill ÷ decode tok/s", "ours ms": "", "ours tok/s": round(ours_pre / ours_dec, 1),
         "claim ms": "", "claim tok/s": round(REFERENCE["prefill_tok_s"]
                                              / REFERENCE["decode_tok_s"], 1)},
    ]


def phase_rows(model: str | rl.ModelSpec = "reference", prompt_tokens: int = 512,
               precision: str = "fp32") -> list[dict]:
    """What one prefill and one decode step must do (analytic): FLOPs, bytes, FLOP per byte.

    Both read every weight once; prefill does ``prompt_tokens`` tokens' worth of arithmetic
    with them, decode one token's. Hardware does not enter these three numbers.
    """
    p = rl.prefill_time(model, "illustrative", prompt_tokens, precision=precision)
    d = rl.decode_time(model, "illustrative", batch=1, precision=precision)
    return [{"pass": f"prefill ({prompt_tokens} tokens)", "tokens": prompt_tokens,
             "GFLOP": round(p.flops / 1e9, 2), "MB read": round(p.bytes_read / 1e6, 1),
             "FLOP/byte": round(p.arithmetic_intensity, 2)},
            {"pass": "decode (1 token)", "tokens": 1, "GFLOP": round(d.flops / 1e9, 2),
             "MB read": round(d.bytes_read / 1e6, 1),
             "FLOP/byte": round(d.arithmetic_intensity, 2)}]


def sweep_figure(sweep: Sweep, context: int | None = None, reference: bool = True,
                 title: str = "") -> go.Figure:
    """Left: prefill time grows with the prompt (PD-1) while one decode step barely changes
    with the context (PD-2). Right: tokens per second of each phase (PD-3)."""
    x = list(sweep.lengths)
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12, subplot_titles=(
        "time (ms)", "throughput (tokens/s)"))
    fig.add_trace(go.Scatter(x=x, y=[sig(s * 1e3, 4) for s in sweep.prefill_s],
                             mode="lines+markers", name="prefill of a prompt of N tokens (TTFT)",
                             line=dict(color="#1f77b4")), 1, 1)
    fig.add_trace(go.Scatter(x=x, y=[sig(s * 1e3, 4) for s in sweep.decode_s],
                             mode="lines+markers", name="one decode step, N tokens cached (TPOT)",
                             line=dict(color="#d62728")), 1, 1)
    fig.add_trace(go.Scatter(x=x, y=[sig(sweep.prefill_tokens_per_s(t), 4) for t in x],
                             mode="lines+markers", name="prefill tok/s",
                             line=dict(color="#1f77b4"), showlegend=False), 1, 2)
    fig.add_trace(go.Scatter(x=x, y=[sig(sweep.decode_tokens_per_s(t), 4) for t in x],
                             mode="lines+markers", name="decode tok/s",
                             line=dict(color="#d62728"), showlegend=False), 1, 2)
    if reference:
        fig.add_trace(go.Scatter(x=[512, 64], y=[REFERENCE["prefill_512_ms"],
                                                 REFERENCE["decode_ms"]],
                                 mode="markers", name="claim PD-3 (reference CPU)",
                                 marker=dict(symbol="x", size=10, color="gray")), 1, 1)
        fig.add_trace(go.Scatter(x=[512, 64], y=[REFERENCE["prefill_tok_s"],
                                                 REFERENCE["decode_tok_s"]],
                                 mode="markers", name="claim PD-3", showlegend=False,
                                 marker=dict(symbol="x", size=10, color="gray")), 1, 2)
    if context is not None:
        i = sweep.index(context)
        fig.add_trace(go.Scatter(x=[context, context],
                                 y=[sig(sweep.prefill_s[i] * 1e3, 4), sig(sweep.decode_s[i] * 1e3, 4)],
                                 mode="markers", name=f"{context} tokens", showlegend=False,
                                 marker=dict(size=13, color="black", symbol="circle-open")), 1, 1)
    for axis in ("xaxis", "xaxis2"):  # label exactly the lengths that were measured
        log_axis(fig, axis, values=x, title_text="tokens (prompt, or already cached)")
    fig.update_yaxes(type="log")
    return style(fig, title, width=900, height=380)


def request(sweep: Sweep, context: int, output_tokens: int) -> dict:
    """A request with a ``context``-token prompt that writes ``output_tokens`` tokens, from the
    measurements: TTFT = its prefill, TPOT = one decode step at that context, and
    e2e ≈ TTFT + TPOT × output tokens (MET-2; the context grows while it writes, ignored here)."""
    ttft, tpot = sweep.ttft_s(context), sweep.tpot_s(context)
    return {"context": context, "output_tokens": output_tokens, "ttft_s": ttft, "tpot_s": tpot,
            "e2e_s": rl.e2e_latency(ttft, tpot, output_tokens),
            "decode_share": tpot * output_tokens / rl.e2e_latency(ttft, tpot, output_tokens)}


def request_figure(sweep: Sweep, context: int = 512, output_tokens: int = 100,
                   max_tokens: int = 1000) -> go.Figure:
    """One request over its answer's length (what :func:`sweep_figure` does not show): at this
    ``context``, the time to the whole answer, e2e ≈ TTFT + TPOT × new tokens (MET-2), split
    into the prefill (paid once) and the decode steps (one per token), marked at
    ``output_tokens`` and titled with that request."""
    r = request(sweep, context, output_tokens)
    ns = sorted({1, *range(50, max_tokens + 1, 50), max(1, min(output_tokens, max_tokens))})
    ttft = sig(r["ttft_s"], 4)
    e2e = [sig(request(sweep, context, n)["e2e_s"], 4) for n in ns]
    fig = go.Figure([
        go.Scatter(x=ns, y=[ttft] * len(ns), mode="lines", fill="tozeroy", name="prefill (TTFT)",
                   line=dict(color="#1f77b4")),
        go.Scatter(x=ns, y=e2e, mode="lines", fill="tonexty",
                   name="+ decode steps (TPOT × new tokens)", line=dict(color="#d62728")),
        go.Scatter(x=[output_tokens, output_tokens], y=[0, sig(r["e2e_s"], 4)], mode="lines+markers",
                   name=f"this request: {output_tokens:,} new tokens",
                   line=dict(color="black", dash="dot")),
    ])
    return style(fig, (
        f"prompt of {context:,} tokens: TTFT {r['ttft_s'] * 1e3:,.1f} ms, then "
        f"{r['tpot_s'] * 1e3:,.1f} ms per token → {output_tokens:,} tokens take "
        f"{r['e2e_s']:,.2f} s ({r['decode_share']:.0%} of it decoding)"),
        "new tokens in the answer", "time to the whole answer (s)", width=820)


def panel(sweep: Sweep, context: int = 512, output_tokens: int = 100) -> widgets.interactive:
    """Sliders over a measured :class:`Sweep`: context (prompt) length and answer length."""

    def figure(context: int = context, output_tokens: int = output_tokens) -> go.Figure:
        return request_figure(sweep, context, output_tokens)

    return _panel(
        figure,
        context=control("select", "context", options=list(sweep.lengths), value=context),
        output_tokens=control("int", "new tokens", value=output_tokens, min=1, max=1000),
    )


def run_figure(step_s: Sequence[float], prompt_tokens: int) -> go.Figure:
    """One generation, pass by pass: ``step_s[0]`` is the prefill of a ``prompt_tokens``-token
    prompt (it also yields the first new token), ``step_s[1:]`` the decode steps, one token
    each. One bar per forward pass, in order: the first bar is the long one."""
    step_s = list(step_s)
    if len(step_s) < 2:
        raise ValueError("step_s needs the prefill and at least one decode step")
    if any(t <= 0 for t in step_s):
        raise ValueError("measured step times must be > 0 seconds")
    ms = [sig(t * 1e3, 4) for t in step_s]
    decode = sorted(ms[1:])
    median = decode[len(decode) // 2]
    fig = go.Figure()
    fig.add_trace(go.Bar(x=[0], y=[ms[0]], name=f"prefill: {prompt_tokens:,} tokens in",
                         marker=dict(color="#1f77b4")))
    fig.add_trace(go.Bar(x=list(range(1, len(ms))), y=ms[1:], name="decode: 1 token in",
                         marker=dict(color="#d62728")))
    fig.update_xaxes(title_text="forward pass (0 = the prefill)", dtick=max(1, len(ms) // 8))
    fig.update_yaxes(title_text="ms", rangemode="tozero")
    title = (f"prefill of {prompt_tokens:,} tokens {ms[0]:,.1f} ms, then {len(ms) - 1} decode "
             f"steps of ~{median:,.1f} ms each (median)")
    return style(fig, title, width=720, height=340)
