"""Lesson 07's figures of the learner's own batched step: what one step reads and computes as the
batch grows, and which cache slots each row of a left-padded batch may attend to."""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from .figures import log_axis, sig, style, wide_layout


def step_work_figure(weight_values: int, batches: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
                     bytes_per_value: int = 4) -> go.Figure:
    """One decode step's weight bytes read (flat: every weight once, whatever the batch) and its
    matrix-product FLOPs (2 per weight per row: they grow with the batch), and their ratio, the
    step's arithmetic intensity. ``weight_values``: the weights the step's matrix products read,
    counted by the learner's hook."""
    if weight_values < 1 or not batches or min(batches) < 1:
        raise ValueError(f"weight_values must be >= 1 and batches >= 1, got {weight_values}, "
                         f"{list(batches)}")
    x = list(batches)
    mb = weight_values * bytes_per_value / 1e6
    # one unit per axis: bytes read, FLOPs computed, and their ratio, each on its own panel
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.1,
                        subplot_titles=("weights read per step", "arithmetic per step",
                                        "FLOPs per byte read (intensity)"))
    fig.add_trace(go.Scatter(x=x, y=[sig(mb, 4)] * len(x), mode="lines+markers",
                             name="weight MB read", showlegend=False), 1, 1)
    fig.add_trace(go.Scatter(x=x, y=[sig(2 * b * weight_values / 1e6, 4) for b in x],
                             mode="lines+markers", name="MFLOP computed", showlegend=False), 1, 2)
    fig.add_trace(go.Scatter(x=x, y=[sig(2 * b / bytes_per_value, 4) for b in x],
                             mode="lines+markers", name="FLOP per byte", showlegend=False), 1, 3)
    for col in (1, 2, 3):
        log_axis(fig, "x", values=x, title_text="batch (rows per step)", row=1, col=col)
    for col in (2, 3):  # growing quantities on log axes; the flat bytes from zero, to look flat
        log_axis(fig, "y", row=1, col=col)
    fig.update_yaxes(rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="MB", row=1, col=1)
    fig.update_yaxes(title_text="MFLOP", row=1, col=2)
    fig.update_yaxes(title_text="FLOP / byte", row=1, col=3)
    return wide_layout(fig, f"One decode step reads the same {mb:.1f} MB of weights at every batch;"
                            f"<br>its arithmetic, and so its intensity, grows with the batch",
                       height=380)


def mask_figure(visible: torch.Tensor, start: Sequence[int], slot: int) -> go.Figure:
    """The left-padded batch's attention at ``slot``: for each row (y) and cache slot (x), padding
    (hidden), a slot the row's query attends to, or a slot not written yet. ``visible`` is the
    learner's (B, slots) boolean mask at ``slot``; ``start`` each row's first real slot."""
    rows, slots = visible.shape
    if len(start) != rows or not 0 <= slot < slots:
        raise ValueError(f"start needs one entry per row ({rows}) and slot must be in "
                         f"[0, {slots - 1}], got {len(start)} entries and slot {slot}")
    kind = [[0 if s < start[b] else 1 if bool(visible[b, s]) and s <= slot else 2
             for s in range(slots)] for b in range(rows)]
    names = ["padding: masked", "attended", "not written yet"]
    colors = ["rgb(200,200,200)", "rgb(76,120,168)", "rgb(243,243,243)"]
    scale = [[i / 3 + e, colors[i]] for i in range(3) for e in (0, 1 / 3)]
    scale[-1][0] = 1.0
    fig = go.Figure(go.Heatmap(z=kind, zmin=-0.5, zmax=2.5, colorscale=scale, showscale=False,
                               xgap=2, ygap=2, customdata=[[names[k] for k in r] for r in kind],
                               hovertemplate="row %{y}, slot %{x}: %{customdata}<extra></extra>"))
    for i, name in enumerate(names):  # a legend entry per kind
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=name,
                                 marker=dict(symbol="square", size=12, color=colors[i],
                                             line=dict(color="rgb(150,150,150)", width=1))))
    fig.update_yaxes(autorange="reversed", title_text="row", tickvals=list(range(rows)))
    fig.update_xaxes(title_text="cache slot", range=[-0.5, slots - 0.5])
    return style(fig, f"Row by row, the slots a query at slot {slot} may look at", height=300)
