"""Static views of a notebook's figures, for readers without a kernel (GitHub, nbviewer).

Lessons store plotly figures as `application/vnd.plotly.v1+json` only (stable, so nbval can
compare them), and a slider panel as a widget view whose figure lives in an Output widget that
a saved notebook does not keep. Neither shows without a kernel. At save time
(`tools/run_notebooks.py`), this module adds an `image/png` beside each of them:

- a plotly output gets the PNG of its own figure, in the same bundle: plotly's own convention
  (its JupyterLab renderer stores such a PNG itself after drawing a figure live). JupyterLab's
  plotly renderer still handles the bundle: it shows the PNG until the pointer enters it, then
  draws the interactive figure. GitHub and nbconvert (nbviewer) show the PNG.
- a panel output (a widget view) gets the PNG of the figure its Output widget showed when the
  cell finished, i.e. the panel's default view, with a caption naming the controls' values, in
  place of the widget view (whose model is never saved, so it could only show an error). The
  runner puts that figure's JSON in the output's metadata under `PENDING`; :func:`add_static`
  turns it into the PNG and drops it. Running the cell in a live kernel brings the panel back.

nbval skips `image/png` and output metadata when it compares, so none of this changes what the
tests compare, and the tests need neither kaleido nor chromium. Only rendering needs them:
`kaleido` (>= 1.0) drives a Chromium found through `BROWSER_PATH` (default `/usr/bin/chromium`).
"""

from __future__ import annotations

import base64
import copy
import json
import os
import shutil
from collections.abc import Callable, Iterator

PLOTLY = "application/vnd.plotly.v1+json"
WIDGET = "application/vnd.jupyter.widget-view+json"
PNG = "image/png"
PENDING = "minifer_static_figure"  # output metadata: {"figure": <plotly JSON>, "caption": str}

WIDTH = 720  # px, the course's figure width (common.style); scale 1 keeps the files small
CAPTION_PX = 26  # room added under a panel's figure for its caption


def is_panel(output: dict) -> bool:
    """A slider panel's output: an ipywidgets `interactive` (shown as a widget view, or saved
    with its static view in place of it)."""
    text = output.get("data", {}).get("text/plain", "")
    return "".join(text).startswith("interactive(")


def missing(nb: dict) -> Iterator[tuple[int, str]]:
    """(code cell number, what) for each figure or panel output that has no static PNG."""
    code = (c for c in nb["cells"] if c["cell_type"] == "code")
    for i, cell in enumerate(code):
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if PNG in data:
                continue
            if PLOTLY in data:
                yield i, "plotly figure"
            elif is_panel(output):
                yield i, "slider panel"


def caption_figure(figure: dict, caption: str) -> dict:
    """A copy of ``figure`` with ``caption`` in small grey type under the plot, in room added
    to the bottom margin (so it never covers the axis title)."""
    fig = copy.deepcopy(figure)
    layout = fig.setdefault("layout", {})
    margin = layout.setdefault("margin", {})
    bottom = margin.get("b", 80)  # plotly's default
    margin["b"] = bottom + CAPTION_PX
    layout["height"] = layout.get("height", 450) + CAPTION_PX
    layout.setdefault("annotations", []).append(dict(
        text=caption, showarrow=False, xref="paper", yref="paper", x=0, y=0, xanchor="left",
        yanchor="top", yshift=-bottom - 4, font=dict(size=11, color="#666666")))
    return fig


def add_static(nb: dict, render: Callable[[dict], bytes]) -> int:
    """Give every plotly output, and every panel output with a pending figure, an `image/png`
    made by ``render(figure_json) -> png bytes``. Idempotent; returns how many were added."""
    added = 0
    for cell in nb["cells"]:
        for output in cell.get("outputs", []):
            data = output.get("data")
            if data is None or PNG in data:
                continue
            pending = output.get("metadata", {}).pop(PENDING, None)
            if PLOTLY in data:
                figure = data[PLOTLY]
            elif pending is not None:
                figure = caption_figure(pending["figure"], pending["caption"])
            else:
                continue
            data[PNG] = base64.b64encode(render(figure)).decode("ascii")
            if pending is not None:
                # The widget's model is never saved, so its view could only show "Error
                # displaying widget: model not found" (JupyterLab picks it over the PNG when the
                # notebook is trusted). nbval does not compare this mimetype anyway.
                data.pop(WIDGET, None)
            added += 1
    return added


class Renderer:
    """Figure JSON -> PNG bytes through kaleido and a headless Chromium, one browser for all
    figures (starting it takes seconds; a figure then takes a fraction of one)."""

    def __init__(self, width: int = WIDTH) -> None:
        self.width = width

    def start(self) -> Renderer:
        """Start Chromium (raises RuntimeError if there is none, ImportError without kaleido)."""
        browser = os.environ.get("BROWSER_PATH") or shutil.which("chromium")
        if not browser:
            raise RuntimeError("static figures need Chromium: install Debian's `chromium` "
                               "(or set BROWSER_PATH to a Chrome/Chromium binary)")
        os.environ["BROWSER_PATH"] = browser
        import kaleido  # the `dev` extra; only saving notebooks needs it

        self._kaleido = kaleido
        # No MathJax: it would be fetched from a CDN, and the course's figures use none.
        kaleido.start_sync_server(n=1, mathjax=False, silence_warnings=True)
        return self

    def close(self) -> None:
        self._kaleido.stop_sync_server(silence_warnings=True)

    def __enter__(self) -> Renderer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def __call__(self, figure: dict) -> bytes:
        layout = figure.get("layout", {})
        width = layout.get("width") or self.width
        height = layout.get("height") or round(width * 0.5)
        # plotly's own JSON; kaleido wants a dict with "data" and "layout"
        fig = {"data": figure.get("data", []), "layout": layout}
        return self._kaleido.calc_fig_sync(
            json.loads(json.dumps(fig)),
            opts=dict(format="png", width=width, height=height, scale=1))
