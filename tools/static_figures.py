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

Each PNG gets an alt text, a sentence naming what the figure shows (its title, its panels'
titles, its axes and its series, and for a panel the controls' values), stored where nbformat
keeps a mimetype's display attributes: the output's metadata, ``{"image/png": {"alt": ...}}``
(:func:`alt_text`; :func:`add_static` also gives one to a stored PNG that has none, from its
plotly figure). :func:`missing` reports a PNG without one.

nbval skips `image/png` and output metadata when it compares, so none of this changes what the
tests compare, and the tests need neither kaleido nor chromium. Only rendering needs them:
`kaleido` (>= 1.0) drives a Chromium found through `BROWSER_PATH` (default `/usr/bin/chromium`).
"""

from __future__ import annotations

import base64
import copy
import json
import os
import re
import shutil
import struct
import zlib
from collections.abc import Callable, Iterator

import numpy as np

PLOTLY = "application/vnd.plotly.v1+json"
WIDGET = "application/vnd.jupyter.widget-view+json"
PNG = "image/png"
NO_ALT = "static PNG without alt text"  # what :func:`missing` says of a PNG with no alt text
PENDING = "minifer_static_figure"  # output metadata: {"figure": <plotly JSON>, "caption": str}

WIDTH = 720  # px, the course's figure width (common.style); scale 1 keeps the files small
HEIGHT = 360  # px, for a figure that sets none (JupyterLab's plotly renderer does the same)
CAPTION_PX = 26  # room added under a panel's figure for its caption
COVERED = 0.97  # share of pixels the 256 commonest colours must cover for a palette PNG


def is_panel(output: dict) -> bool:
    """A slider panel's output: an ipywidgets `interactive` (shown as a widget view, or saved
    with its static view in place of it)."""
    text = output.get("data", {}).get("text/plain", "")
    return "".join(text).startswith("interactive(")


def missing(nb: dict) -> Iterator[tuple[int, str]]:
    """(code cell number, what) for each figure or panel output that has no static PNG, and for
    each static PNG without an alt text."""
    code = (c for c in nb["cells"] if c["cell_type"] == "code")
    for i, cell in enumerate(code):
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if PNG in data:
                if not alt_of(output):
                    yield i, NO_ALT
                continue
            if PLOTLY in data:
                yield i, "plotly figure"
            elif is_panel(output):
                yield i, "slider panel"


CAPTION_CHAR_PX = 6.2  # a generous average width of one character at the caption's size 11


def wrap_caption(caption: str, width_px: float) -> list[str]:
    """`caption` in lines that fit `width_px` (broken after commas or spaces), so a long list of
    control values is never cut off at the figure's right edge."""
    room = max(20, int((width_px - 20) / CAPTION_CHAR_PX))
    lines, line = [], ""
    for word in caption.split(" "):
        if line and len(line) + 1 + len(word) > room:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return lines + [line]


def caption_figure(figure: dict, caption: str) -> dict:
    """A copy of ``figure`` with ``caption`` in small grey type under the plot, in room added
    to the bottom margin (so it never covers the axis title)."""
    fig = copy.deepcopy(figure)
    layout = fig.setdefault("layout", {})
    margin = layout.setdefault("margin", {})
    bottom = margin.get("b", 80)  # plotly's default
    lines = wrap_caption(caption, layout.get("width", WIDTH))
    margin["b"] = bottom + CAPTION_PX * len(lines)
    layout["height"] = layout.get("height", HEIGHT) + CAPTION_PX * len(lines)
    layout.setdefault("annotations", []).append(dict(
        text="<br>".join(lines), showarrow=False, xref="paper", yref="paper", x=0, y=0, xanchor="left",
        yanchor="top", yshift=-bottom - 4, align="left", font=dict(size=11, color="#666666")))
    return fig


def _plain(text) -> str:
    """Figure text without its markup: line breaks as spaces, tags dropped."""
    text = re.sub(r"<br\s*/?>", " ", str(text or ""))
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", text)).strip()


def _title(obj) -> str:
    title = (obj or {}).get("title")
    return _plain(title.get("text") if isinstance(title, dict) else title)


def alt_text(figure: dict, caption: str | None = None) -> str:
    """One or two sentences saying what ``figure`` (plotly JSON) shows, for readers who cannot
    see the PNG: its title, its panels' titles, its axes (x against y) and its named series, and
    ``caption`` (a panel's saved view: the controls' values)."""
    layout = figure.get("layout", {})
    data = figure.get("data", [])
    kinds = {"bar": "bar chart", "heatmap": "heatmap", "scatter": "line chart", "pie": "pie chart"}
    kind = kinds.get(data[0].get("type", "scatter"), "chart") if data else "figure"
    parts = [f"{kind.capitalize()}: {_title(layout) or 'untitled'}."]
    panels = [_plain(a.get("text")) for a in layout.get("annotations", [])
              if a.get("xref") == "paper" and a.get("yref") == "paper" and a.get("y", 0) >= 0.99
              and a.get("text")]
    if len(panels) > 1:
        parts.append(f"{len(panels)} panels: " + "; ".join(panels) + ".")
    axes = []
    xs = sorted(k for k in layout if re.fullmatch(r"xaxis\d*", k))
    for x in xs:
        y = "yaxis" + x[5:]
        xt, yt = _title(layout.get(x)), _title(layout.get(y))
        if xt or yt:
            axes.append(f"{yt or 'value'} against {xt or 'category'}")
    if axes:
        parts.append("Axes: " + "; ".join(dict.fromkeys(axes)) + ".")
    names = list(dict.fromkeys(_plain(t.get("name")) for t in data if t.get("name")))
    if names:
        more = f" and {len(names) - 8} more" if len(names) > 8 else ""
        parts.append("Series: " + ", ".join(names[:8]) + more + ".")
    if caption:
        parts.append(_plain(caption) + ".")
    return " ".join(parts)


def alt_of(output: dict) -> str | None:
    """The alt text stored with an output's PNG, if any."""
    return output.get("metadata", {}).get(PNG, {}).get("alt")


def set_alt(output: dict, alt: str) -> None:
    output.setdefault("metadata", {}).setdefault(PNG, {})["alt"] = alt


def add_static(nb: dict, render: Callable[[dict], bytes]) -> int:
    """Give every plotly output, and every panel output with a pending figure, an `image/png`
    made by ``render(figure_json) -> png bytes``, with its :func:`alt_text`; a stored PNG beside
    a plotly figure that has no alt text gets one. Idempotent; returns how many PNGs were added."""
    added = 0
    for cell in nb["cells"]:
        for output in cell.get("outputs", []):
            data = output.get("data")
            if data is not None and PNG in data and PLOTLY in data and not alt_of(output):
                set_alt(output, alt_text(data[PLOTLY]))
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
            set_alt(output, alt_text(figure if pending is None else pending["figure"],
                                     None if pending is None else pending["caption"]))
            if pending is not None:
                # The widget's model is never saved, so its view could only show "Error
                # displaying widget: model not found" (JupyterLab picks it over the PNG when the
                # notebook is trusted). nbval does not compare this mimetype anyway.
                data.pop(WIDGET, None)
            added += 1
    return added


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _pixels(png: bytes) -> np.ndarray | None:
    """The RGB pixels of an 8-bit, non-interlaced RGB(A) PNG with an opaque alpha (what
    Chromium writes for a plotly figure); None for any other PNG."""
    pos, chunks = 8, []
    while pos < len(png):
        (n,) = struct.unpack(">I", png[pos:pos + 4])
        chunks.append((png[pos + 4:pos + 8], png[pos + 8:pos + 8 + n]))
        pos += 12 + n
    w, h, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    if depth != 8 or ctype not in (2, 6) or interlace:
        return None
    bpp = 4 if ctype == 6 else 3
    raw = zlib.decompress(b"".join(d for k, d in chunks if k == b"IDAT"))
    rows = np.frombuffer(raw, np.uint8).reshape(h, 1 + w * bpp)
    img = np.zeros((h, w * bpp), np.uint8)
    prev = np.zeros(w * bpp, np.uint8)
    for y in range(h):  # undo each row's filter (PNG spec, section 9)
        kind, line = rows[y, 0], rows[y, 1:]
        if kind == 0:
            cur = line.copy()
        elif kind == 1:  # sub: a running sum along the row, per channel
            cur = np.cumsum(line.reshape(w, bpp), axis=0, dtype=np.uint8).reshape(-1)
        elif kind == 2:  # up
            cur = line + prev
        else:  # average or Paeth: sequential, rare in Chromium's output
            cur = line.astype(np.int32)
            up = prev.astype(np.int32)
            for x in range(w * bpp):
                a = cur[x - bpp] if x >= bpp else 0
                c = up[x - bpp] if x >= bpp else 0
                if kind == 3:
                    pred = (a + up[x]) >> 1
                else:
                    p = a + up[x] - c
                    pa, pb, pc = abs(p - a), abs(p - up[x]), abs(p - c)
                    pred = a if pa <= pb and pa <= pc else (up[x] if pb <= pc else c)
                cur[x] = (cur[x] + pred) & 255
            cur = cur.astype(np.uint8)
        img[y] = prev = cur
    img = img.reshape(h, w, bpp)
    if bpp == 4 and img[..., 3].min() < 255:
        return None
    return img[..., :3]


def shrink_png(png: bytes) -> bytes:
    """The same picture in fewer bytes: Chromium writes RGBA with a fast deflate; a figure has
    a few hundred colours, mostly the anti-aliased edges of a handful. If 256 colours cover
    ``COVERED`` of the pixels, store a palette image (the other pixels, edges, take the nearest
    of those colours: ~3x smaller, no visible change), else (a heatmap's smooth colour scale)
    lossless RGB at zlib level 9 (~1.7x smaller)."""
    rgb = _pixels(png)
    if rgb is None:
        return png
    h, w, _ = rgb.shape
    flat = rgb.reshape(-1, 3)
    keys = (flat[:, 0].astype(np.uint32) << 16) | (flat[:, 1].astype(np.uint32) << 8) | flat[:, 2]
    keys, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
    colours = np.stack([keys >> 16, (keys >> 8) & 255, keys & 255], axis=1)
    top = np.argsort(-counts, kind="stable")[:256]
    head = b"\x89PNG\r\n\x1a\n"
    if counts[top].sum() >= COVERED * len(flat):
        palette = colours[top].astype(np.int32)
        nearest = ((colours[:, None, :].astype(np.int32) - palette[None]) ** 2).sum(-1).argmin(1)
        index = nearest.astype(np.uint8)[inverse.reshape(-1)].reshape(h, w)
        ihdr = struct.pack(">IIBBBBB", w, h, 8, 3, 0, 0, 0)
        rows = np.hstack([np.zeros((h, 1), np.uint8), index]).tobytes()
        out = (head + _chunk(b"IHDR", ihdr) + _chunk(b"PLTE", palette.astype(np.uint8).tobytes())
               + _chunk(b"IDAT", zlib.compress(rows, 9)) + _chunk(b"IEND", b""))
    else:
        ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
        rows = np.hstack([np.zeros((h, 1), np.uint8), flat.reshape(h, w * 3)]).tobytes()
        out = head + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(rows, 9)) + _chunk(
            b"IEND", b"")
    return out if len(out) < len(png) else png


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
        height = layout.get("height") or HEIGHT
        # plotly's own JSON; kaleido wants a dict with "data" and "layout"
        fig = {"data": figure.get("data", []), "layout": layout}
        return shrink_png(self._kaleido.calc_fig_sync(
            json.loads(json.dumps(fig)),
            opts=dict(format="png", width=width, height=height, scale=1)))
