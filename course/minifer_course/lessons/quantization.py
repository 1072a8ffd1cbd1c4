"""Lesson 09 — quantization: what each precision costs in quality and buys in bytes and speed.

Plain functions first (each testable without a notebook): quality of every precision on the
trained Shakespeare model, measured decode time, the roofline view of QUANT-2 and the outlier
experiment; then the figures, and the precision/batch panel whose callback a test can call.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import ipywidgets as widgets
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from minifer.quantization import PRECISIONS, fused_available, model_bytes, quantize
from minifer_course.evaluate import score_windows

from .. import roofline as rl
from ..bench.quant import time_variants
from ..quality import (
    greedy_agreement,
    max_logit_diff,
    validation_perplexity,
)
from .common import control, precision_options, sig, style, table
from .common import panel as _panel
from .int_math import (  # noqa: F401 (the lesson's Q.*)
    int8_operands,
    int8_units,
    int_math_sentence,
    int_mm_verdict,
    matmul_rows,
    pair_saturating_mm,
)
from .outliers import outlier_figure, outlier_rows  # noqa: F401

__all__ = ["PrecisionRow", "quantized_models", "precision_rows", "rows_table", "quality_figure",
           "quality_detail_figure", "matmul_rows", "int8_units", "int_math_sentence",
           "int8_operands", "int_mm_verdict", "pair_saturating_mm",
           "measure_speed", "speed_figure", "roofline_rows", "roofline_figure", "outlier_rows",
           "outlier_figure", "panel_figure", "QuantPanel", "panel", "speed_notes", "greedy_note",
           "BATCHES", "codes_figure", "channel_error_figure"]

BATCHES = (1, 8, 32)  # the panel's batch slider: each measured once, before the panel
COLORS = {"fp32": "#1f77b4", "bf16": "#2ca02c", "fp16": "#98df8a", "int8": "#ff7f0e",
          "int4": "#d62728", "int8 dequant": "#ffbb78", "int4 dequant": "#ff9896"}


def quantized_models(model: torch.nn.Module, precisions=PRECISIONS, group_size: int = 64,
                     dequant: bool = False) -> dict[str, torch.nn.Module]:
    """``{precision: model}``; fp32 is the model itself, int8 and int4 are weight-only (torch's
    fused kernels, the reference path where they cannot run). ``dequant=True`` adds the
    dequantize-per-call int8/int4 variants (labels ``"int8 dequant"``, ``"int4 dequant"``)."""
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a layer the fused kernel rejects uses the reference path
        for p in precisions:
            if p == "fp32":
                out[p] = model
            elif p == "int8":  # not quantize's default, which may pick W8A8 (section 8)
                impl = "fused" if fused_available(8) else "reference"
                out[p] = quantize(model, p, impl=impl)
            else:
                out[p] = quantize(model, p, group_size=group_size)
        if dequant:
            for p in ("int8", "int4"):
                out[f"{p} dequant"] = quantize(model, p, group_size=group_size, impl="reference")
    return out


@dataclass(frozen=True)
class PrecisionRow:
    """Quality and size of one precision of a model, compared with fp32."""

    precision: str
    total_mb: float  # everything the model stores
    linear_mb: float  # linear weights + their scales
    perplexity: float  # on held-out text
    agreement: float  # fraction of held-out positions whose top-1 next token equals fp32's
    same_greedy: int  # free-running greedy tokens identical to fp32's before the first change
    max_dlogit: float  # max |Δlogit| over the prompt

    def as_dict(self) -> dict:
        return {"precision": self.precision, "total MB": self.total_mb,
                "linear MB": self.linear_mb, "perplexity": self.perplexity,
                "top-1 agree": self.agreement, "same greedy": self.same_greedy,
                "max |Δlogit|": self.max_dlogit}


def _perplexity_and_top1(model: torch.nn.Module, tokenizer, text: str, ctx: int
                         ) -> tuple[float, torch.Tensor]:
    """Perplexity on `text` (windows of the whole context) and, from the same forward calls,
    the most likely next token at every scored position, each once: one pass over the text
    gives both (`quality.top1_agreement` would run the model over it again)."""
    rows: list[torch.Tensor] = []  # every window's argmax row, in the order the windows ran
    handle = model.register_forward_hook(lambda _m, _args, out: rows.extend(out.argmax(-1).cpu()))
    try:
        result = validation_perplexity(model, tokenizer, text, stride=ctx)
    finally:
        handle.remove()
    windows = score_windows(result.tokens + 1, ctx, ctx)  # the windows `perplexity` scored
    top1 = torch.cat([row[first_new - 1 - begin:] for row, (begin, _end, first_new)
                      in zip(rows, windows, strict=True)])
    return result.perplexity, top1


def precision_rows(models: dict[str, torch.nn.Module], tokenizer, prompt: str,
                   n_tokens: int = 32, text: str | None = None, max_chars: int = 10_000
                   ) -> list[PrecisionRow]:
    """For each model against ``models["fp32"]``: bytes; perplexity and top-1 agreement on the
    first ``max_chars`` of held-out text; identical free-running greedy tokens (of
    ``n_tokens``) from ``prompt``; max |Δlogit| on ``prompt``. Perplexity and agreement to 3
    decimals, Δlogit to 3 significant digits: this machine's numbers (:func:`rows_table` prints
    the part that is the same everywhere)."""
    from minifer.pretrained import load_validation_text

    text = (load_validation_text() if text is None else text)[:max_chars]
    ref = models["fp32"]
    ref_tokens = greedy_agreement(ref, ref, prompt, n_tokens, tokenizer).reference_tokens
    ctx = ref.config.context_length
    ref_ppl, ref_top1 = _perplexity_and_top1(ref, tokenizer, text, ctx)
    rows = []
    for name, m in models.items():
        mb = model_bytes(m)
        ppl, top1 = (ref_ppl, ref_top1) if m is ref else _perplexity_and_top1(m, tokenizer, text, ctx)
        greedy = greedy_agreement(ref, m, prompt, n_tokens, tokenizer, reference_tokens=ref_tokens)
        first = greedy.first_divergence
        d = max_logit_diff(ref, m, prompt, tokenizer)
        agree = float((top1 == ref_top1).sum()) / ref_top1.numel()
        rows.append(PrecisionRow(name, round(mb.total / 1e6, 2), round(mb.linear / 1e6, 2),
                                 round(ppl, 3), round(agree, 3),
                                 n_tokens if first is None else first, float(f"{d:.3g}")))
    return rows


def rows_table(rows: list[PrecisionRow], detail: bool = False) -> str:
    """The rows as a plain-text table.

    By default only what is the same on every machine: sizes in whole MB (int4's exact bytes
    depend on how the kernel in use wants the 4-bit weights packed: 7.57 MB fused, 8.07 MB on
    the reference path for the Shakespeare model), and the change of perplexity from fp32's to 1
    decimal (its lower digits, like agreement counts, greedy runs and Δlogits, move with the
    CPU's bf16/int8/int4 kernels). ``detail=True`` prints every column to 3 decimals: this
    machine's numbers.
    """
    if detail:
        return table([r.as_dict() for r in rows], floatfmt="{:,.3f}")
    base = next(r for r in rows if r.precision == "fp32").perplexity
    return table([{"precision": r.precision, "total MB": round(r.total_mb),
                   "linear MB": round(r.linear_mb),
                   "Δ perplexity vs fp32": f"{round(r.perplexity - base, 1) + 0.0:+.1f}"}
                  for r in rows])


_LABEL_SPOTS = ("top left", "top right", "bottom left", "bottom right")


def quality_figure(rows: list[PrecisionRow], highlight: str | None = None) -> go.Figure:
    """Perplexity's rise over fp32 (lower is better) against megabytes stored: cost and gain.

    Plotted to 1 decimal, the precision the claim needs: the digits after it change with the
    CPU's kernels (and bf16/fp16/int8 within ±0.05 of fp32 are equally good); sizes in whole
    MB, as int4's exact bytes depend on the kernel's packing (see :func:`rows_table`)."""
    base = next(r for r in rows if r.precision == "fp32").perplexity
    points = {r.precision: (round(r.total_mb), round(r.perplexity - base, 1) + 0.0) for r in rows}
    fig = go.Figure()
    for r in rows:
        x, y = points[r.precision]
        same = [p for p, xy in points.items() if xy == (x, y)]  # bf16 and fp16 coincide
        fig.add_trace(go.Scatter(
            x=[x], y=[y], mode="markers+text", name=r.precision, text=[r.precision],
            textposition=_LABEL_SPOTS[same.index(r.precision) % len(_LABEL_SPOTS)] if len(same) > 1
            else "top center", cliponaxis=False,
            # a point hidden under another grows a ring around it (bf16 under fp16)
            marker=dict(size=16 if r.precision == highlight
                        else 11 + 5 * (len(same) - 1 - same.index(r.precision)),
                        color=COLORS.get(r.precision, "#7f7f7f"),
                        line=dict(width=2 if r.precision == highlight else 0, color="black"))))
    fig.update_layout(showlegend=False)  # before style(): no legend slot to keep free
    return style(fig, "Quality vs size (held-out Shakespeare)", "model size (MB, 10⁶ bytes)",
                 "perplexity − fp32's")



def quality_detail_figure(rows: list[PrecisionRow]) -> go.Figure:
    """Both quality measures of each precision at full precision: left, perplexity's rise over
    fp32's (to 3 decimals: the digits :func:`quality_figure` rounds away); right, how often the
    top-1 next token differs from fp32's along the held-out text, the measure that separates
    int4 from int8 (QUANT-3). The low digits depend on the CPU's kernels."""
    base = next(r for r in rows if r.precision == "fp32").perplexity
    names = [r.precision for r in rows]
    colors = [COLORS.get(p, "#7f7f7f") for p in names]
    rise = [round(r.perplexity - base, 3) + 0.0 for r in rows]
    miss = [round(100 * (1 - r.agreement), 1) + 0.0 for r in rows]
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12, subplot_titles=(
        "perplexity − fp32's", "top-1 token differs from fp32's (%)"))
    fig.add_trace(go.Bar(x=names, y=rise, marker_color=colors, text=[f"{v:+.3f}" for v in rise],
                         textposition="outside", cliponaxis=False), 1, 1)
    fig.add_trace(go.Bar(x=names, y=miss, marker_color=colors, text=[f"{v:.1f}%" for v in miss],
                         textposition="outside", cliponaxis=False), 1, 2)
    fig.update_layout(showlegend=False)
    fig.update_yaxes(title_text="perplexity points", row=1, col=1)
    fig.update_yaxes(title_text="% of held-out positions", row=1, col=2)
    return style(fig, "Quality on held-out Shakespeare: perplexity hardly moves, top-1 choices do",
                 width=860, height=380, top=80)

def measure_speed(models: dict[str, torch.nn.Module], batch: int = 1, context: int = 64,
                  rounds: int = 3, steps: int = 3) -> dict[str, float]:
    """Measured decode ms per step of each model at ``batch`` (round-robin, medians of
    ``rounds`` rounds of ``steps`` steps each)."""
    return {k: s * 1e3 for k, s in time_variants(models, batch, context, rounds, steps).items()}


def speed_figure(ms: dict[str, float], batch: int, highlight: str | None = None) -> go.Figure:
    """Decode ms per token (per step ÷ 1: each step makes one token per sequence) by precision."""
    names = list(ms)
    fig = go.Figure(go.Bar(
        x=names, y=[round(ms[n], 2) for n in names], text=[f"{ms[n]:.1f}" for n in names],
        textposition="outside",
        marker=dict(color=[COLORS.get(n, "#7f7f7f") for n in names],
                    line=dict(width=[3 if n == highlight else 0 for n in names], color="black"))))
    style(fig, f"Measured decode step at batch {batch} on this machine", "precision",
          "ms per decode step")
    return fig


def speed_notes(ms: dict[str, float], batch: int = 1) -> str:
    """What this machine's decode steps (``{precision: ms}``, from :func:`measure_speed`) say,
    in sentences: the fused kernels against fp32, dequantize-per-call against the fused
    kernels, and the 16-bit floats against fp32 (with why a CPU without native fp16 arithmetic
    is slower in fp16). Generated from the numbers, so the text never contradicts them."""
    fp32 = ms["fp32"]
    out = [f"At batch {batch} on this machine, fp32 takes {fp32:.1f} ms per decode step."]
    for bits in (8, 4):
        fused, slow = ms.get(f"int{bits}"), ms.get(f"int{bits} dequant")
        if fused is None:
            continue
        speed = fp32 / fused
        vs = ("faster than" if speed >= 1.1 else "slower than" if speed <= 0.9
              else "about as fast as")
        line = f"int{bits} with the fused kernel: {fused:.1f} ms, {vs} fp32 ({speed:.2f}× its speed)"
        if slow is not None:
            r = slow / fused
            how = ("much slower than" if r >= 1.5 else "slower than" if r >= 1.1
                   else "about as fast as")
            line += (f"; dequantizing at every call: {slow:.1f} ms, {how} the fused kernel "
                     f"({r:.1f}× its time)")
        out.append(line + ".")
    for p in ("bf16", "fp16"):
        if p not in ms:
            continue
        r = ms[p] / fp32
        if r >= 1.5:
            why = (f"{p} takes {r:.1f}× fp32's time: this CPU has no native {p} matrix multiply, "
                   "so torch converts the 16-bit weights to fp32 for the arithmetic — half the "
                   "bytes to read, but more work")
        elif r >= 1.15:
            why = (f"{p} is somewhat slower than fp32 ({r:.2f}× its time): half the bytes, but "
                   "this CPU's 16-bit matrix multiply is slower per number than its fp32 one, "
                   "and this small model's weights sit largely in the CPU's caches anyway")
        elif r <= 0.87:
            why = f"{p} is faster than fp32 ({r:.2f}× its time): half the bytes, read faster"
        else:
            why = (f"{p} takes about fp32's time ({r:.2f}×): this CPU's 16-bit matrix multiply is "
                   "not faster per byte than its fp32 one, and this small model's weights sit "
                   "largely in the CPU's caches")
        out.append(why + ".")
    return "\n".join(out)


def greedy_note(rows: list[PrecisionRow]) -> str:
    """One sentence on how long each precision's free-running greedy text stayed fp32's,
    beside how much its perplexity moved: this machine's run, in words."""
    base = next(r for r in rows if r.precision == "fp32")
    parts = [f"{r.precision} {r.same_greedy} (perplexity "
             f"{round(r.perplexity - base.perplexity, 2) + 0.0:+.2f})"
             for r in rows if r.precision != "fp32"]
    return (f"Greedy tokens identical to fp32's from the prompt, of {base.same_greedy}: "
            + ", ".join(parts) + ".")


# ---- roofline view (QUANT-2) ---------------------------------------------------------------
def roofline_rows(model: str = "llama-7b", hardware: str = "a100-80gb", prompt_tokens: int = 512,
                  batch: int = 1, precisions=("bf16", "int8", "int4")) -> list[dict]:
    """Predicted TPOT (decode, memory-bound) and TTFT (prefill, compute-bound) per weight
    precision. Weight-only quantization keeps bf16 matmuls, so only the bytes change."""
    out = []
    for p in precisions:
        d = rl.decode_time(model, hardware, batch=batch, precision=p)
        f = rl.prefill_time(model, hardware, prompt_tokens, batch=batch, precision=p)
        out.append({"weights": p, "weight GB": round(d.weight_bytes / 1e9, 2),
                    "TPOT ms": round(d.tpot_ms, 2), "decode bound": d.bound,
                    "TTFT ms": round(f.ttft_ms, 1), "prefill bound": f.bound})
    return out


def roofline_figure(rows: list[dict], title: str = "LLaMA-7B on an A100: TPOT moves, TTFT barely"
                    ) -> go.Figure:
    names = [r["weights"] for r in rows]
    fig = go.Figure([
        go.Bar(name="TPOT (one decode step)", x=names, y=[r["TPOT ms"] for r in rows]),
        go.Bar(name="TTFT (prefill of the prompt)", x=names, y=[r["TTFT ms"] for r in rows]),
    ])
    style(fig, title, "weight precision", "ms (roofline prediction)")
    fig.update_layout(barmode="group")
    return fig


# ---- section 1: the learner's int8, drawn ------------------------------------------------------
def codes_figure(q: torch.Tensor, rows: tuple[int, ...] = (0, 1), bin_width: int = 8) -> go.Figure:
    """How the int8 codes of a few weight rows spread over [-127, 127]: counts per bin of
    ``bin_width`` codes, one bar series per row (fixed x axis: every code int8 allows)."""
    edges = list(range(-128, 128, bin_width))
    fig = go.Figure()
    for r in rows:
        counts = torch.histc(q[r].float(), bins=len(edges), min=-128, max=-128 + bin_width * len(edges))
        fig.add_trace(go.Bar(name=f"row {r}", x=[e + bin_width / 2 for e in edges],
                             y=[int(c) for c in counts.tolist()], width=bin_width * 0.45))
    style(fig, f"int8 codes of {len(rows)} weight rows ({q.shape[1]} weights each)",
          f"int8 code q (bins of {bin_width})", "weights")
    fig.update_layout(barmode="group", xaxis_range=[-132, 132])
    return fig


def channel_error_figure(err: torch.Tensor, scale: torch.Tensor, first: int = 256) -> go.Figure:
    """Per output channel (row), the first ``first`` of them: the largest |w - q·scale| and the
    bound half a step, scale / 2."""
    n = min(first, len(scale))
    x = list(range(n))
    fig = go.Figure([
        go.Scatter(name="half a step: scale / 2", x=x, y=[sig(v, 3) for v in (scale[:n] / 2).tolist()],
                   mode="lines", line=dict(width=1.5)),
        go.Scatter(name="largest |error| of the row", x=x, y=[sig(v, 3) for v in err[:n].tolist()],
                   mode="markers", marker=dict(size=4))])
    return style(fig, f"Rounding error of the first {n} output channels, and its bound",
                 "output channel (row)", "weight units")


# ---- the panel -----------------------------------------------------------------------------
def panel_figure(rows: list[PrecisionRow], ms: dict[str, float], batch: int,
                 precision: str) -> go.Figure:
    """One precision in context: left, quality against size (:func:`quality_figure`); right, the
    measured decode step of every precision at ``batch`` (:func:`speed_figure`); the title
    sums up ``precision``'s row."""
    r = {row.precision: row for row in rows}[precision]
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1, subplot_titles=(
        "quality vs size (held-out Shakespeare)", f"measured decode step at batch {batch}"))
    for trace in quality_figure(rows, precision).data:
        fig.add_trace(trace, 1, 1)
    for trace in speed_figure(ms, batch, precision).data:
        fig.add_trace(trace, 1, 2)
    fig.update_xaxes(title_text="model size (MB, 10⁶ bytes)", row=1, col=1)
    fig.update_yaxes(title_text="perplexity − fp32's", row=1, col=1)
    fig.update_xaxes(title_text="precision", row=1, col=2)
    fig.update_yaxes(title_text="ms per decode step", row=1, col=2)
    title = (f"{precision}: {r.total_mb:.2f} MB, perplexity {r.perplexity:.1f}, top-1 agreement "
             f"{r.agreement:.0%}; decode {ms[precision]:.2f} ms/step at batch {batch} "
             f"({batch * 1e3 / ms[precision]:,.0f} tokens/s)")
    # every point and bar is labelled where it is; set before style(), which then keeps no
    # legend slot under the title
    fig.update_layout(showlegend=False)
    return style(fig, title, width=1000, height=400, title_size=13, top=70)


class QuantPanel:
    """Precision and batch sliders over measured rows and models.

    :meth:`figure` is the panel's plain callback (precision, batch → figure); :meth:`result`
    gives the same numbers as a dict for asserts. Decode steps are measured once per batch and
    kept: :meth:`measure` measures every batch of the slider up front, so that moving it only
    redraws (a batch not measured yet is measured when first chosen, which takes seconds).
    """

    def __init__(self, rows: list[PrecisionRow], models: dict[str, torch.nn.Module],
                 context: int = 64, rounds: int = 3, steps: int = 2,
                 batches: tuple[int, ...] = BATCHES) -> None:
        self.rows = {r.precision: r for r in rows}
        self.models, self.context, self.rounds, self.steps = models, context, rounds, steps
        self.batches = tuple(batches)
        self._ms: dict[int, dict[str, float]] = {}

    def ms(self, batch: int) -> dict[str, float]:
        """Measured ms per decode step of every precision at `batch` (measured once, kept)."""
        if batch not in self._ms:
            self._ms[batch] = measure_speed(self.models, batch, self.context, self.rounds,
                                            self.steps)
        return self._ms[batch]

    def measure(self) -> dict[int, dict[str, float]]:
        """Measure every batch of the slider now (the panel then answers at once)."""
        return {b: self.ms(b) for b in self.batches}

    def _check(self, precision: str) -> None:
        if precision not in self.rows:
            raise ValueError(f"precision must be one of {list(self.rows)}, got {precision!r}")

    def result(self, precision: str, batch: int) -> dict:
        """``precision``'s row with its measured decode step at ``batch``."""
        self._check(precision)
        ms = self.ms(batch)
        return {**self.rows[precision].as_dict(), "batch": batch, "ms/token": ms[precision],
                "tokens/s": batch * 1e3 / ms[precision]}

    def figure(self, precision: str = "int8", batch: int = 1) -> go.Figure:
        """:func:`panel_figure` for ``precision`` at ``batch``."""
        self._check(precision)
        return panel_figure(list(self.rows.values()), self.ms(batch), batch, precision)


def panel(qp: QuantPanel, precision: str = "int8", batch: int = 1) -> widgets.interactive:
    """Controls for :meth:`QuantPanel.figure`: a precision slider (32 → 4 bits) and a batch
    slider over ``qp.batches``."""
    return _panel(qp.figure, precision=control("select", "precision", value=precision,
                                               options=precision_options(qp.rows)),
                  batch=control("select", "batch", options=qp.batches, value=batch))
