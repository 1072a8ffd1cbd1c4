"""Lesson 09, the outlier experiment (QUANT-4): a few large input channels spoil every row's
int8 scale; per-tensor vs per-channel scales, and keeping the outlier channels in full precision.
"""

from __future__ import annotations

import plotly.graph_objects as go
import torch

from minifer.quantization import quantize_int8

from .common import style


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
