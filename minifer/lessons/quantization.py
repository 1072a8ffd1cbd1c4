"""Lesson 08 — quantization: what each precision costs in quality and buys in bytes and speed.

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

from .. import roofline as rl
from ..bench.quant import time_variants
from ..quality import greedy_agreement, max_logit_diff, top1_agreement, validation_perplexity
from ..quantization import PRECISIONS, model_bytes, quantize, quantize_int8
from .common import style, table

__all__ = ["PrecisionRow", "quantized_models", "precision_rows", "rows_table", "quality_figure",
           "measure_speed", "speed_figure", "roofline_rows", "roofline_figure", "outlier_rows",
           "outlier_figure", "QuantPanel", "panel", "BATCHES"]

BATCHES = (1, 4, 16, 32, 64)
COLORS = {"fp32": "#1f77b4", "bf16": "#2ca02c", "fp16": "#98df8a", "int8": "#ff7f0e",
          "int4": "#d62728", "int8 dequant": "#ffbb78", "int4 dequant": "#ff9896"}


def quantized_models(model: torch.nn.Module, precisions=PRECISIONS, group_size: int = 64,
                     dequant: bool = False) -> dict[str, torch.nn.Module]:
    """``{precision: model}``; fp32 is the model itself. ``dequant=True`` adds the
    dequantize-per-call int8/int4 variants (labels ``"int8 dequant"``, ``"int4 dequant"``)."""
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a layer the fused kernel rejects uses the reference path
        for p in precisions:
            out[p] = model if p == "fp32" else quantize(model, p, group_size=group_size)
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


def precision_rows(models: dict[str, torch.nn.Module], tokenizer, prompt: str,
                   n_tokens: int = 32, text: str | None = None, max_chars: int = 10_000
                   ) -> list[PrecisionRow]:
    """For each model against ``models["fp32"]``: bytes; perplexity and top-1 agreement on the
    first ``max_chars`` of held-out text; identical free-running greedy tokens (of
    ``n_tokens``) from ``prompt``; max |Δlogit| on ``prompt``. Rounded so stored outputs are
    stable (perplexity to 3 decimals, Δlogit to 3 significant digits)."""
    from ..pretrained import load_validation_text

    text = (load_validation_text() if text is None else text)[:max_chars]
    ids = tokenizer.encode(text)
    ref = models["fp32"]
    ref_tokens = greedy_agreement(ref, ref, prompt, n_tokens, tokenizer).reference_tokens
    ctx = ref.config.context_length
    rows = []
    for name, m in models.items():
        mb = model_bytes(m)
        ppl = validation_perplexity(m, tokenizer, text, stride=ctx).perplexity
        greedy = greedy_agreement(ref, m, prompt, n_tokens, tokenizer, reference_tokens=ref_tokens)
        first = greedy.first_divergence
        d = max_logit_diff(ref, m, prompt, tokenizer)
        rows.append(PrecisionRow(name, round(mb.total / 1e6, 2), round(mb.linear / 1e6, 2),
                                 round(ppl, 3), round(top1_agreement(ref, m, ids), 3),
                                 n_tokens if first is None else first, float(f"{d:.3g}")))
    return rows


def rows_table(rows: list[PrecisionRow]) -> str:
    return table([r.as_dict() for r in rows], floatfmt="{:,.3f}")


def quality_figure(rows: list[PrecisionRow], highlight: str | None = None) -> go.Figure:
    """Perplexity (lower is better) against megabytes stored: the cost and the gain."""
    fig = go.Figure()
    for r in rows:
        fig.add_trace(go.Scatter(
            x=[r.total_mb], y=[r.perplexity], mode="markers+text", name=r.precision,
            text=[r.precision], textposition="top center",
            marker=dict(size=16 if r.precision == highlight else 11,
                        color=COLORS.get(r.precision, "#7f7f7f"),
                        line=dict(width=2 if r.precision == highlight else 0, color="black"))))
    style(fig, "Quality vs size (held-out Shakespeare)", "model size (MB, 10⁶ bytes)",
          "validation perplexity")
    fig.update_layout(showlegend=False)
    return fig


def measure_speed(models: dict[str, torch.nn.Module], batch: int = 1, context: int = 64,
                  rounds: int = 3) -> dict[str, float]:
    """Measured decode ms per step of each model at ``batch`` (round-robin, medians)."""
    return {k: s * 1e3 for k, s in time_variants(models, batch, context, rounds).items()}


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


# ---- the outlier experiment (QUANT-4) ------------------------------------------------------
def _per_tensor_int8(w: torch.Tensor) -> torch.Tensor:
    scale = w.abs().max() / 127
    return torch.round(w / scale).clamp(-127, 127) * scale


def _per_channel_int8(w: torch.Tensor) -> torch.Tensor:
    q, scale = quantize_int8(w)
    return q.float() * scale[:, None]


def _keep_channels(w: torch.Tensor, channels: torch.Tensor) -> torch.Tensor:
    """LLM.int8()-style decomposition: the outlier input channels stay in float, the rest int8."""
    rest = w.clone()
    rest[:, channels] = 0
    out = _per_channel_int8(rest)
    out[:, channels] = w[:, channels]
    return out


def outlier_rows(w: torch.Tensor, n_outliers: int = 4, magnitude: float = 20.0, seed: int = 0,
                 tokens: int = 256) -> list[dict]:
    """Relative output error ``‖x Ŵᵀ − x Wᵀ‖ / ‖x Wᵀ‖`` of three int8 schemes, for a real
    weight ``w`` [out, in], before and after `n_outliers` input channels are made
    `magnitude`× larger (as the few "salient" feature dimensions of large LLMs are)."""
    w = w.detach().float()
    gen = torch.Generator().manual_seed(seed)
    channels = torch.randperm(w.shape[1], generator=gen)[:n_outliers]
    x = torch.randn(tokens, w.shape[1], generator=gen)
    w_out = w.clone()
    w_out[:, channels] *= magnitude
    rows = []
    for case, ww in (("as trained", w), (f"{n_outliers} outlier channels ×{magnitude:g}", w_out)):
        y = x @ ww.T
        row = {"weights": case}
        for name, fn in (("per-tensor", _per_tensor_int8), ("per-channel", _per_channel_int8),
                         ("per-channel + outliers in float", lambda t: _keep_channels(t, channels))):
            err = (x @ fn(ww).T - y).norm() / y.norm()
            row[name] = float(f"{err:.3g}")
        rows.append(row)
    return rows


def outlier_figure(rows: list[dict]) -> go.Figure:
    schemes = [k for k in rows[0] if k != "weights"]
    fig = go.Figure([go.Bar(name=s, x=[r["weights"] for r in rows], y=[r[s] * 100 for r in rows])
                     for s in schemes])
    style(fig, "int8 error of one layer's output", "weights", "relative output error (%)")
    fig.update_layout(barmode="group")
    return fig


# ---- the panel -----------------------------------------------------------------------------
class QuantPanel:
    """Precision dropdown + batch slider. ``show(precision, batch)`` is the plain callback: it
    prints the precision's row, shows both figures and returns a dict a test can check."""

    def __init__(self, rows: list[PrecisionRow], models: dict[str, torch.nn.Module],
                 context: int = 64, rounds: int = 3) -> None:
        self.rows = {r.precision: r for r in rows}
        self.models, self.context, self.rounds = models, context, rounds
        self._ms: dict[int, dict[str, float]] = {}

    def ms(self, batch: int) -> dict[str, float]:
        """Measured ms per decode step of every precision at `batch` (measured once, kept)."""
        if batch not in self._ms:
            self._ms[batch] = measure_speed(self.models, batch, self.context, self.rounds)
        return self._ms[batch]

    def result(self, precision: str, batch: int) -> dict:
        if precision not in self.rows:
            raise ValueError(f"precision must be one of {list(self.rows)}, got {precision!r}")
        ms = self.ms(batch)
        r = self.rows[precision]
        return {**r.as_dict(), "batch": batch, "ms/token": ms[precision],
                "tokens/s": batch * 1e3 / ms[precision],
                "quality": quality_figure(list(self.rows.values()), precision),
                "speed": speed_figure(ms, batch, precision)}

    def show(self, precision: str = "int8", batch: int = 1) -> dict:
        res = self.result(precision, batch)
        print(f"{precision}: {res['total MB']:.2f} MB, perplexity {res['perplexity']:.3f}, "
              f"top-1 agreement {res['top-1 agree']:.1%}, max |Δlogit| {res['max |Δlogit|']}, "
              f"decode {res['ms/token']:.2f} ms/step at batch {batch} "
              f"({res['tokens/s']:,.0f} tokens/s)")
        res["quality"].show()
        res["speed"].show()
        return res


def panel(qp: QuantPanel, precision: str = "int8", batch: int = 1) -> widgets.interactive:
    return widgets.interactive(
        qp.show,
        precision=widgets.Dropdown(options=list(qp.rows), value=precision,
                                   description="precision", style={"description_width": "initial"}),
        batch=widgets.SelectionSlider(options=BATCHES, value=batch, description="batch",
                                      continuous_update=False),
    )

