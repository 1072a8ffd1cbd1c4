"""Readable ticks for log axes: labelled 1-2-5 steps (or whole decades on a wide axis), never
plotly's tiny unlabelled-looking minor digits "2 3 … 9" between the decades."""

from __future__ import annotations

import math
from collections.abc import Iterable

import plotly.graph_objects as go


def log_ticks(values: Iterable[float | None], max_ticks: int = 8) -> list[float]:
    """Tick values for a log axis showing ``values``: 1, 2, 5 × 10ⁿ covering them, or only the
    decades (1, 10, 100, …) when that would be more than ``max_ticks`` ticks."""
    vals = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    if not vals:
        return []
    lo, hi = math.floor(math.log10(min(vals))), math.ceil(math.log10(max(vals)))
    for steps in ((1, 2, 5), (1, 3), (1,)):
        ticks = [s * 10.0**e for e in range(lo, hi + 1) for s in steps]
        ticks = [t for t in ticks if min(vals) / 2.5 <= t <= max(vals) * 2.5]
        if len(ticks) <= max_ticks or steps == (1,):
            return [float(f"{t:.6g}") for t in ticks]
    return []  # unreachable


def _label(v: float) -> str:
    if v >= 1e6:
        return f"{v / 1e6:g}M"
    if v >= 1e4:
        return f"{v / 1e3:g}k"
    return f"{v:,g}"


def log_axis(fig: go.Figure, values: Iterable[float | None], axis: str = "x", **where) -> go.Figure:
    """Make an axis of ``fig`` logarithmic with :func:`log_ticks` labels for ``values`` (the data
    it shows). ``where``: ``row``/``col``/``secondary_y``, as for ``fig.update_xaxes``."""
    ticks = log_ticks(values)
    update = fig.update_xaxes if axis == "x" else fig.update_yaxes
    update(type="log", tickvals=ticks, ticktext=[_label(t) for t in ticks], minor=dict(ticks=""),
           **where)
    return fig
