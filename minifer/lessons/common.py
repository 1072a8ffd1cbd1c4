"""Helpers every lesson uses: notebook set-up, small tables, and the shared figure style."""

from __future__ import annotations

import plotly.graph_objects as go
import plotly.io as pio
import torch

TEMPLATE = "simple_white"


def setup(threads: int | None = None, seed: int = 0) -> torch.device:
    """Pin what makes stored notebook outputs stable, and return the device used for timing.

    - plotly's `plotly_mimetype` renderer stores figures as JSON only (no random div ids), so a
      re-run compares equal;
    - torch uses at most `threads` CPU threads (default: all cores torch sees) and a fixed seed.
    """
    pio.renderers.default = "plotly_mimetype"
    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    from ..device import default_device

    return default_device()


def on_device(model: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    """The model itself if it already lives on `device`, else a copy moved there.

    Lessons compute the outputs that the tests compare on the CPU in fp32 (the same on every
    machine) and time a copy on the fastest device.
    """
    device = torch.device(device)
    current = next(model.parameters()).device
    if current.type == device.type:
        return model
    import copy

    return copy.deepcopy(model).to(device)


def style(fig: go.Figure, title: str, x: str, y: str, *, height: int = 360, width: int = 720) -> go.Figure:
    """The course's figure style: light template, titled axes, compact margins."""
    fig.update_layout(
        title=title, template=TEMPLATE, height=height, width=width,
        margin=dict(l=60, r=20, t=50, b=50), xaxis_title=x, yaxis_title=y,
        legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="right", x=1.0),
    )
    return fig


def table(rows: list[dict], floatfmt: str = "{:,.2f}") -> str:
    """Rows of dicts as an aligned plain-text table (stable text that nbval can compare)."""
    if not rows:
        return ""
    cols = list(rows[0])

    def fmt(v) -> str:
        if isinstance(v, float):
            return floatfmt.format(v)
        if isinstance(v, int) and not isinstance(v, bool):
            return f"{v:,}"
        return str(v)

    cells = [[fmt(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)
