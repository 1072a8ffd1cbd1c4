"""The course's one figure style: a plotly template, titles and legends that fit, log axes
with readable ticks, reference lines, and :func:`sig`, which rounds every number a figure or
table stores (nbval compares stored outputs exactly). Lessons reach these through
:mod:`minifer_course.lessons.common`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import plotly.graph_objects as go


def sig(x: float, digits: int = 6) -> float:
    """``x`` rounded to ``digits`` significant digits.

    Figures store their numbers in the notebook and nbval compares them exactly, so every float
    a figure or table shows goes through here: 6 digits for analytic numbers (no visible loss),
    fewer for measured ones, at the precision the claim needs.
    """
    return float(f"{x:.{digits}g}")


def sig_or_none(x: float | None, digits: int = 4) -> float | None:
    """:func:`sig` for a figure's data, where nan (or None) becomes None: a gap in the line."""
    return None if x is None or math.isnan(x) else sig(x, digits)


# --------------------------------------------------------------------------------------------
# The course's one figure style
# --------------------------------------------------------------------------------------------

INK = "rgb(36,36,36)"
GRID = "rgb(232,232,232)"
REFERENCE = "rgb(90,90,90)"  # reference lines (TTFT, device memory, ...) unless a colour is given
FONT = "Arial, 'Liberation Sans', Helvetica, sans-serif"  # metric-compatible on every OS
FONT_SIZE = 13  # text, axis titles, annotations
SMALL = 12  # tick labels and legend entries: the smallest text a figure shows
TITLE_SIZE = 15  # a figure's title, shrunk (to SMALL at least) if it would not fit the width
SUBPLOT_TITLE_SIZE = 14
MAX_WIDTH = 900  # fits JupyterLab's output area beside an open file browser
_MARGIN = dict(l=60, r=20, b=50)
_PAD = 8  # px above the title, and between the top slots
LEGEND_ROW = 22  # px per row of a horizontal legend at SMALL size
_SUBPLOT_TITLE_ROOM = 24


def _axis(**extra) -> dict:
    return dict(showline=True, linecolor=INK, ticks="outside", tickcolor=INK, ticklen=5,
                tickfont=dict(size=SMALL), title=dict(standoff=10, font=dict(size=FONT_SIZE)),
                zeroline=False, gridcolor=GRID, automargin=True, **extra)


TEMPLATE = go.layout.Template(
    layout=dict(
        font=dict(family=FONT, size=FONT_SIZE, color=INK),
        title=dict(font=dict(size=TITLE_SIZE)),
        colorway=["#1F77B4", "#FF7F0E", "#2CA02C", "#D62728", "#9467BD", "#8C564B", "#E377C2",
                  "#7F7F7F", "#BCBD22", "#17BECF"],
        paper_bgcolor="white", plot_bgcolor="white", hovermode="closest",
        xaxis=_axis(showgrid=False), yaxis=_axis(showgrid=True),
        legend=dict(font=dict(size=SMALL), bgcolor="rgba(255,255,255,0)"),
        # plotly's simple_white draws shapes with a line width of 0: reference lines vanished
        shapedefaults=dict(line=dict(color=REFERENCE, width=2), fillcolor="rgba(0,0,0,0.08)",
                           opacity=1),
        annotationdefaults=dict(font=dict(size=SMALL)),
    ),
    data=dict(
        bar=[go.Bar(marker=dict(line=dict(color="white", width=0.5)))],
        table=[go.Table(header=dict(fill=dict(color="rgb(232,232,232)"), line=dict(color="white"),
                                    font=dict(size=SMALL)),
                        cells=dict(fill=dict(color="rgb(246,246,246)"), line=dict(color="white"),
                                   font=dict(size=SMALL)))],
    ),
)
"""The course's plotly template: a small one (a few hundred bytes in each stored figure, where
plotly's ``simple_white`` stores ~9 KB), light, with reference lines that are drawn."""


# Average advance of a character in Arial-like fonts, in em: enough to keep text inside a figure.
_NARROW, _WIDE = set(" .,:;!|'()[]-ijlrtfI1"), set("mwMW%@")


def text_width(text: str, size: float) -> float:
    """Estimated width in px of ``text`` (plotly's ``<br>`` ends a line: the widest line counts)."""
    def line(s: str) -> float:
        em = sum(0.3 if c in _NARROW else 0.85 if c in _WIDE else 0.68 if c.isupper()
                 else 0.56 for c in s)
        return em * size
    return max((line(part) for part in _plain(text).split("\n")), default=0.0)


def _plain(text: str) -> str:
    for tag in ("<b>", "</b>", "<i>", "</i>", "<sup>", "</sup>", "<sub>", "</sub>"):
        text = text.replace(tag, "")
    return text.replace("<br>", "\n").replace("<br />", "\n")


def _fit_title(title: str, room: float, size: int | None) -> tuple[str, int]:
    """Shrink the title's font until it fits ``room`` px (not below :data:`SMALL`); a title that
    still does not fit is wrapped at the last space, comma or semicolon before the edge."""
    size = size or TITLE_SIZE
    while size > SMALL and text_width(title, size) > room:
        size -= 1
    lines = []
    for line in title.split("<br>"):
        while text_width(line, size) > room and " " in line:
            cut = len(line)
            while cut > 0 and text_width(line[:cut], size) > room:
                cut = line.rfind(" ", 0, cut)
            if cut <= 0:
                break
            lines.append(line[:cut].rstrip())
            line = line[cut:].lstrip()
        lines.append(line)
    return "<br>".join(lines), size


def _legend_items(fig: go.Figure) -> list[str]:
    """Names the legend will show (plotly shows it for two or more entries, or when asked)."""
    names = [t.name if t.name is not None else f"trace {i}" for i, t in enumerate(fig.data)
             if getattr(t, "showlegend", False) is not False
             and getattr(t, "visible", True) is not False]
    if fig.layout.showlegend is False or (fig.layout.showlegend is None and len(names) < 2):
        return []
    return names


def legend_rows(names: Sequence[str], room: float) -> int:
    """Rows a horizontal legend of ``names`` needs in ``room`` px (entries wrap like words)."""
    rows, used = 0, room
    for name in names:
        w = 46 + text_width(name, SMALL)  # symbol, gaps and text
        if used + w > room:
            rows, used = rows + 1, 0.0
        used += w
    return rows


def _subplot_titles(fig: go.Figure) -> list:
    """make_subplots' titles: paper-referenced annotations sitting on top of a subplot."""
    return [a for a in fig.layout.annotations
            if a.yref == "paper" and a.yanchor == "bottom" and a.showarrow is False and a.text]


_NUMBER = (int, float)


def _axis_values(fig: go.Figure, axis: str) -> list[float]:
    """Positive numbers plotted on ``axis`` ("xaxis", "yaxis2", ...): traces and shapes."""
    letter, suffix = axis[0], axis[5:]
    ref = letter + suffix  # "x", "y2"
    values: list[float] = []
    for t in fig.data:
        if (getattr(t, f"{letter}axis", None) or letter) != ref:
            continue
        v = getattr(t, letter, None)
        if v is not None:
            values += [float(u) for u in v if isinstance(u, _NUMBER) and not isinstance(u, bool)]
    for sh in fig.layout.shapes:
        if getattr(sh, f"{letter}ref", None) == ref:
            values += [float(u) for u in (getattr(sh, f"{letter}0"), getattr(sh, f"{letter}1"))
                       if isinstance(u, _NUMBER)]
    return [v for v in values if v > 0 and math.isfinite(v)]


def tick_text(v: float) -> str:
    """A tick label: 20, 500, 2k, 50k, 1M, 0.05, 1,024 (round thousands shortened, other
    numbers written out: no exponent notation, no "2 3 … 9")."""
    for scale, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= scale and (v / scale * 10) == int(v / scale * 10):
            return f"{v / scale:g}{unit}"
    return f"{v:,.0f}" if v == int(v) else f"{v:g}"


def log_axis(fig: go.Figure, axis: str = "xaxis", values: Iterable[float] | None = None,
             labels: Sequence[str] | None = None, *, row: int | None = None,
             col: int | None = None, secondary_y: bool = False, **update) -> go.Figure:
    """Make ``axis`` ("xaxis", "yaxis2", ...) logarithmic with readable labels.

    In a figure with subplots, name the axis by its subplot instead: ``axis`` "x" or "y" with
    ``row``/``col`` (and ``secondary_y``), as for ``fig.update_yaxes``.

    With ``values`` (e.g. the lengths 128, 256, 512, 1024 that were measured) exactly those are
    labelled, as ``labels`` (default: :func:`tick_text`, e.g. "2k"). Otherwise the data plotted
    on the axis decide: across three or more powers of ten every decade is labelled (1, 10,
    100, 1k, ...) with small unlabelled ticks between; across fewer, the 1-2-5 steps are (20,
    50, 100, 200, 500). ``update`` goes to the axis (e.g. ``title_text``).
    """
    if axis[0] not in "xy":
        raise ValueError(f"axis must name an x or y axis ('xaxis', 'yaxis2', 'y'...), got {axis!r}")
    if row is not None or col is not None or secondary_y:
        sub = fig.get_subplot(row or 1, col or 1, secondary_y=secondary_y)
        axis = (sub.xaxis if axis[0] == "x" else sub.yaxis).plotly_name
    elif axis in ("x", "y"):
        axis += "axis"
    ax = fig.layout[axis]
    ax.update(type="log", showgrid=True, **update)
    if values is not None:
        vals = [float(v) for v in values]
        if labels is not None and len(labels) != len(vals):
            raise ValueError(f"labels must name each of the {len(vals)} values, got {len(labels)}")
        text = list(labels) if labels is not None else [tick_text(v) for v in vals]
        return fig.update_layout({axis: dict(tickmode="array", tickvals=vals, ticktext=text)})
    data = _axis_values(fig, axis)
    if not data:
        return fig.update_layout({axis: dict(dtick=1)})
    lo, hi = min(data), max(data)
    first, last = math.ceil(math.log10(lo) - 1e-9), math.floor(math.log10(hi) + 1e-9)
    if last - first + 1 >= 3:  # every decade, labelled like the 1-2-5 steps ("1k", not "1000")
        vals = [sig(10.0 ** e) for e in range(math.floor(math.log10(lo) + 1e-9),
                                              math.ceil(math.log10(hi) - 1e-9) + 1)]
        return fig.update_layout({axis: dict(
            tickmode="array", tickvals=vals, ticktext=[tick_text(v) for v in vals],
            minor=dict(ticks="outside", ticklen=3, dtick="D1", showgrid=False))})
    steps = [m * 10.0 ** e for e in range(first - 1, last + 2) for m in (1, 2, 5)]
    vals = [sig(v) for v in steps if lo / 1.25 <= v <= hi * 1.25] or [sig(lo), sig(hi)]
    return fig.update_layout({axis: dict(tickmode="array", tickvals=vals,
                                         ticktext=[tick_text(v) for v in vals])})


def reference_line(fig: go.Figure, *, x: float | None = None, y: float | None = None,
                   text: str = "", row: int | None = None, col: int | None = None,
                   color: str = REFERENCE, dash: str = "dash", position: str | None = None
                   ) -> go.Figure:
    """A labelled horizontal (``y=``) or vertical (``x=``) reference line: a deadline, a
    capacity, a measured TTFT. Drawn 2 px wide in ``color`` with its label in the same colour
    (``position``: plotly's annotation position, default "top left" / "top right").

    Without ``text`` no label is made (plotly would draw a "new text" placeholder). On a log
    axis, label the line by hand: plotly puts a line's own label at 10**value there."""
    if (x is None) == (y is None):
        raise ValueError("reference_line needs exactly one of x= or y=")
    kw: dict = dict(line=dict(color=color, width=2, dash=dash))
    if text:
        kw.update(annotation_text=text, annotation_font=dict(size=SMALL, color=color),
                  annotation_bgcolor="rgba(255,255,255,0.85)",  # readable over bars and curves
                  annotation_position=position or ("top left" if y is not None else "top right"))
    if row is not None or col is not None:
        kw.update(row=row, col=col)
    if y is not None:
        return fig.add_hline(y=y, **kw)
    return fig.add_vline(x=x, **kw)


def style(fig: go.Figure, title: str, x: str | None = None, y: str | None = None, *,
          height: int = 360, width: int = 720, title_size: int | None = None,
          top: int = 50) -> go.Figure:
    """The course's figure style. Text never overlaps and nothing is cut off:

    - the title sits at the top, left-aligned with the plot, shrunk (not below 12 px) or
      wrapped to fit; the legend gets its own rows under it, above any subplot titles and
      the plot, and the top margin is sized for all three, so a legend never covers a title;
    - the figure is at most :data:`MAX_WIDTH` px wide (JupyterLab's output area), and the plot
      keeps the height it would have with a one-line title (``height``/``top`` as before);
    - log axes get readable labels (:func:`log_axis`): decades, or 1-2-5 steps on short ranges;
    - :data:`TEMPLATE`: readable fonts, and reference lines that are drawn.

    ``x``/``y`` title the (first) axes; figures with subplots title each axis themselves.
    ``title_size`` caps the title's font size.
    """
    width = min(width, MAX_WIDTH)
    if x is not None:
        fig.update_layout(xaxis_title=x)
    if y is not None:
        fig.update_layout(yaxis_title=y)
    room = width - _MARGIN["l"] - _MARGIN["r"]
    text, size = _fit_title(title or "", room, title_size)
    used = _PAD
    if text:
        used += round(size * 1.3 * (text.count("<br>") + 1))
    rows = legend_rows(_legend_items(fig), room)
    legend_y = used + (_PAD // 2 if text else 0)
    if rows:
        used = legend_y + rows * LEGEND_ROW
    subplot_titles = _subplot_titles(fig)
    for a in subplot_titles:
        a.font.size = SUBPLOT_TITLE_SIZE
    if any(a.y >= 0.99 for a in subplot_titles):
        used += _SUBPLOT_TITLE_ROOM
    t = max(used + _PAD, 20)
    total = max(height - top, 120) + t  # the plot's height as the caller planned it, + the slots
    # plotly.js shifts a one-line title down by its cap height (0.7 em) under yanchor="top" but
    # sets a multi-line title's first baseline at y itself: shift that one by hand.
    first = _PAD + (0 if "<br>" not in text else 0.7 * size)
    title_layout = dict(text=text, font=dict(size=size), x=0, xref="paper", xanchor="left",
                        y=1 - first / total, yref="container", yanchor="top",
                        pad=dict(t=0, b=0)) if text else dict(text="")
    fig.update_layout(
        template=TEMPLATE, width=width, height=total, title=title_layout,
        margin=dict(t=t, **_MARGIN),
        legend=dict(orientation="h", x=0, xref="paper", xanchor="left",
                    y=1 - legend_y / total, yref="container", yanchor="top", traceorder="normal"))
    for axis in [k for k in fig.layout.to_plotly_json() if k.startswith(("xaxis", "yaxis"))]:
        ax = fig.layout[axis]
        if ax.type == "log" and ax.tickvals is None and ax.dtick is None:
            log_axis(fig, axis)
    return fig


def wide_layout(fig: go.Figure, title: str, *, width: int = 1000, height: int = 380) -> go.Figure:
    """`style` for a wide figure whose title takes two lines: ``top=90`` keeps the title clear
    of the subplot titles under it (lessons 07 and 08's figures)."""
    return style(fig, title, width=width, height=height + 20, title_size=13, top=90)
