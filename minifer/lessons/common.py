"""Helpers every lesson uses: notebook set-up, small tables, rounding, the shared figure style,
and the one panel contract (a plain function returns a figure; :func:`panel` adds the controls).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import ipywidgets as widgets
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


def sig(x: float, digits: int = 6) -> float:
    """``x`` rounded to ``digits`` significant digits.

    Figures store their numbers in the notebook and nbval compares them exactly, so every float
    a figure or table shows goes through here: 6 digits for analytic numbers (no visible loss),
    fewer for measured ones, at the precision the claim needs.
    """
    return float(f"{x:.{digits}g}")


def style(fig: go.Figure, title: str, x: str | None = None, y: str | None = None, *,
          height: int = 360, width: int = 720, title_size: int | None = None, top: int = 50,
          legend: bool = True) -> go.Figure:
    """The course's figure style: light template, titled axes, compact margins, the legend in a
    row above the plot (``legend=False`` keeps plotly's, beside it, for crowded subplots).

    ``x``/``y`` title the (first) axes; figures with subplots title each axis themselves.
    ``title_size`` shrinks a long title; ``top`` makes room for a two-line one.
    """
    fig.update_layout(
        title=dict(text=title, font=dict(size=title_size)) if title_size else title,
        template=TEMPLATE, height=height, width=width, margin=dict(l=60, r=20, t=top, b=50))
    if x is not None:
        fig.update_layout(xaxis_title=x)
    if y is not None:
        fig.update_layout(yaxis_title=y)
    if legend:
        fig.update_layout(legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="right",
                                      x=1.0))
    return fig


_CONTROLS = {"int": widgets.IntSlider, "float": widgets.FloatSlider,
             "select": widgets.SelectionSlider, "dropdown": widgets.Dropdown}


def control(kind: str, description: str, **kwargs) -> widgets.ValueWidget:
    """One panel control in the course's style.

    ``kind`` is ``"int"``, ``"float"`` (sliders), ``"select"`` (a slider over ``options``) or
    ``"dropdown"``; ``kwargs`` go to the widget (``value``, ``min``, ``max``, ``options``...).
    The label is shown whole (ipywidgets otherwise cuts labels at ~80 px: "new tok..."), and a
    slider calls back once when released, not at every pixel, since callbacks may measure.
    """
    if kind not in _CONTROLS:
        raise ValueError(f"kind must be one of {list(_CONTROLS)}, got {kind!r}")
    kwargs.setdefault("style", {"description_width": "initial"})
    if kind != "dropdown":
        kwargs.setdefault("continuous_update", False)
    return _CONTROLS[kind](description=description, **kwargs)


def panel(figure: Callable[..., go.Figure], **controls: widgets.ValueWidget) -> widgets.interactive:
    """The one panel contract: ``figure(**values)`` is a plain function that returns a plotly
    figure (tests call it directly); the panel calls it whenever a control changes, shows the
    figure, and keeps it as ``ui.result`` so a notebook cell can drive a control and check it.

    ``controls`` name ``figure``'s parameters (build them with :func:`control`); its other
    parameters keep their defaults and get no control.
    """
    fixed = {name: widgets.fixed(p.default)
             for name, p in inspect.signature(figure).parameters.items()
             if name not in controls and p.default is not inspect.Parameter.empty}

    @functools.wraps(figure)  # interactive reads the parameters from the signature
    def show(*args, **kwargs) -> go.Figure:
        fig = figure(*args, **kwargs)
        if not isinstance(fig, go.Figure):
            raise TypeError(f"a panel callback must return a plotly Figure, got {type(fig).__name__}")
        fig.show()
        return fig

    return widgets.interactive(show, **controls, **fixed)


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
