"""Lesson 07, measured: one decode step for a batch of sequences, measured (BATCH-1, BATCH-2, MET-4).

:class:`BatchSweep` holds a sweep timed with :func:`minifer_course.bench.decode.time_decode_step`;
the figure and panel show step time, per-user and server tokens/s beside the claims' reference
CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import ipywidgets as widgets
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from ..bench.decode import time_decode_step
from ..bench.reference import DECODE as REFERENCE
from .common import control, log_axis, panel, sig, table, wide_layout

BATCHES = (1, 2, 4, 8, 16, 32, 64)





# =============================================================================================
# 4. Measured: one decode step for a batch of sequences (BATCH-1, BATCH-2, MET-4)
# =============================================================================================

@dataclass(frozen=True)
class BatchSweep:
    """Median seconds of one decode step for each batch size, every sequence with ``context``
    cached tokens. Each sequence gets one token per step, so a user sees ``1 / step`` tokens/s
    and the server makes ``batch / step`` (MET-4: say which one a figure is)."""

    batches: tuple[int, ...]
    step_s: tuple[float, ...]
    context: int = 64
    label: str = "this machine"

    def __post_init__(self) -> None:
        if not self.batches or len(self.batches) != len(self.step_s):
            raise ValueError("batches and step_s must be non-empty and equally long")
        if list(self.batches) != sorted(set(self.batches)) or self.batches[0] < 1:
            raise ValueError(f"batches must be increasing positive integers, got {self.batches}")
        if any(not t > 0 for t in self.step_s):
            raise ValueError("step times must be > 0 seconds")

    def step(self, batch: int) -> float:
        if batch not in self.batches:
            raise ValueError(f"batch {batch} was not measured; choose one of {list(self.batches)}")
        return self.step_s[self.batches.index(batch)]

    def per_user(self, batch: int) -> float:
        """Tokens/s one user sees in a batch of ``batch``."""
        return 1 / self.step(batch)

    def total(self, batch: int) -> float:
        """Tokens/s the whole server makes with a batch of ``batch``."""
        return batch / self.step(batch)

    def rows(self) -> list[dict]:
        base = self.step_s[0]
        return [{"batch": b, "step ms": round(t * 1e3, 2), "× batch 1": round(t / base, 1),
                 "tok/s per user": round(1 / t), "tok/s server": round(b / t)}
                for b, t in zip(self.batches, self.step_s)]


REFERENCE_SWEEP = BatchSweep(tuple(REFERENCE["batch_ms"]),
                             tuple(ms / 1e3 for ms in REFERENCE["batch_ms"].values()),
                             context=128, label="claims' reference CPU")
"""Claim BATCH-1's figures: a 4-thread laptop CPU, the reference model in fp32, every sequence
with 128 tokens of context."""


def measure_sweep(model: torch.nn.Module, batches: Sequence[int] = BATCHES, context: int = 64,
                  *, repeats: int = 5, seed: int = 0) -> BatchSweep:
    """Time one decode step of ``model`` for each batch size (medians after warm-up), exactly as
    ``python -m minifer_course.bench decode`` does."""
    time_decode_step(model, 1, context, warmup=1, repeats=1, seed=seed)  # lazy init
    steps = tuple(time_decode_step(model, b, context, warmup=2, repeats=repeats,
                                   seed=seed).median_s for b in batches)
    return BatchSweep(tuple(batches), steps, context)


def sweep_table(sweep: BatchSweep, reference: BatchSweep | None = REFERENCE_SWEEP) -> str:
    """The sweep as text, with the reference CPU's step time beside each batch it has."""
    rows = sweep.rows()
    if reference is not None:
        for r in rows:
            b = r["batch"]
            r["claim ms"] = (f"{reference.step(b) * 1e3:.1f}" if b in reference.batches else "")
            r["claim tok/s"] = (f"{reference.total(b):,.0f}" if b in reference.batches else "")
    return table(rows)


def batch_figure(sweep: BatchSweep, batch: int = 8,
                 reference: BatchSweep | None = REFERENCE_SWEEP) -> go.Figure:
    """Left: decode step time against batch (and the "64 × batch 1" a batch would cost if every
    sequence paid for its own weight reads). Right: tokens/s per user and for the server. The
    reference CPU's figures are drawn beside ours; ``batch`` is marked and titled."""
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1,
                        subplot_titles=("time of one decode step", "tokens per second"))
    x = list(sweep.batches)
    fig.add_trace(go.Scatter(x=x, y=[sig(t * 1e3, 4) for t in sweep.step_s], mode="lines+markers",
                             name=f"step, {sweep.label}"), 1, 1)
    fig.add_trace(go.Scatter(x=x, y=[sig(sweep.step_s[0] * b * 1e3, 4) for b in x], mode="lines",
                             name="batch × one step (no sharing)", line=dict(dash="dot")), 1, 1)
    fig.add_trace(go.Scatter(x=x, y=[sig(sweep.total(b), 4) for b in x], mode="lines+markers",
                             name=f"server tok/s, {sweep.label}"), 1, 2)
    fig.add_trace(go.Scatter(x=x, y=[sig(sweep.per_user(b), 4) for b in x], mode="lines+markers",
                             name=f"per-user tok/s, {sweep.label}"), 1, 2)
    if reference is not None:
        rx = list(reference.batches)
        fig.add_trace(go.Scatter(x=rx, y=[sig(t * 1e3, 4) for t in reference.step_s],
                                 mode="markers", name=f"step, {reference.label}",
                                 marker=dict(symbol="x", size=9)), 1, 1)
        fig.add_trace(go.Scatter(x=rx, y=[sig(reference.total(b), 4) for b in rx], mode="markers",
                                 name=f"server tok/s, {reference.label}",
                                 marker=dict(symbol="x", size=9)), 1, 2)
    fig.add_trace(go.Scatter(x=[batch], y=[sig(sweep.step(batch) * 1e3, 4)], mode="markers",
                             showlegend=False, marker=dict(size=13, color="crimson")), 1, 1)
    fig.add_trace(go.Scatter(x=[batch, batch], y=[sig(sweep.total(batch), 4),
                                                  sig(sweep.per_user(batch), 4)],
                             mode="markers", showlegend=False,
                             marker=dict(size=13, color="crimson")), 1, 2)
    for col in (1, 2):
        log_axis(fig, "x", values=x, title_text="batch (sequences per step)", row=1, col=col)
        log_axis(fig, "y", row=1, col=col)
    fig.update_yaxes(title_text="ms", row=1, col=1)
    fig.update_yaxes(title_text="tokens/s", row=1, col=2)
    title = (f"batch {batch}: one step {sweep.step(batch) * 1e3:.1f} ms "
             f"({sweep.step(batch) / sweep.step_s[0]:.1f}× batch 1) → "
             f"{sweep.per_user(batch):,.0f} tok/s per user, "
             f"{sweep.total(batch):,.0f} tok/s for the server ({sweep.label})")
    if reference is not None and batch in reference.batches:
        title += (f"<br>{reference.label}: {reference.step(batch) * 1e3:.1f} ms, "
                  f"{reference.per_user(batch):,.0f} per user, "
                  f"{reference.total(batch):,.0f} server")
    return wide_layout(fig, title, height=420)


def batch_panel(sweep: BatchSweep, batch: int = 8) -> widgets.interactive:
    """A batch-size slider over a measured :class:`BatchSweep`."""

    def figure(batch: int = batch) -> go.Figure:
        return batch_figure(sweep, batch)

    return panel(figure, batch=control("select", "batch", options=list(sweep.batches),
                                       value=batch))
