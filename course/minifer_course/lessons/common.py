"""Helpers every lesson uses: notebook set-up, small tables, token labels, the precision slider
and the one panel contract (a plain function returns a figure; :func:`panel` adds the
controls). The figure style lives in :mod:`minifer_course.lessons.figures` and is re-exported here.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import json
import os
import platform
from collections.abc import Callable, Iterable

import ipywidgets as widgets
import plotly.graph_objects as go
import plotly.io as pio
import torch

from .figures import (  # noqa: F401 (lessons import the figure style from here)
    FONT,
    FONT_SIZE,
    GRID,
    INK,
    LEGEND_ROW,
    MAX_WIDTH,
    REFERENCE,
    SMALL,
    SUBPLOT_TITLE_SIZE,
    TEMPLATE,
    TITLE_SIZE,
    legend_rows,
    log_axis,
    reference_line,
    sig,
    sig_or_none,
    style,
    text_width,
    tick_text,
    wide_layout,
)


def diagram(name: str):
    """The lesson's schematic ``name`` (``course/minifer_course/lessons/diagrams/NAME.svg``, drawn by
    ``tools/draw_diagrams.py``) as an SVG for a code cell to show.

    A code cell stores the picture in the notebook, so it shows on GitHub, nbviewer, in JupyterLab
    and on Colab, a saved copy included; a relative image link in markdown breaks on Colab.
    """
    from importlib.resources import files

    from IPython.display import SVG

    folder = files("minifer_course.lessons") / "diagrams"
    path = folder / f"{name}.svg"
    if not path.is_file():
        known = sorted(p.name[:-4] for p in folder.iterdir() if p.name.endswith(".svg"))
        raise ValueError(f"no diagram named {name!r}; the diagrams are {known}")
    return SVG(data=path.read_text(encoding="utf-8"))


def setup(threads: int | None = None, seed: int = 0) -> torch.device:
    """Pin what makes stored notebook outputs stable, and return the device used for timing.

    - plotly's `plotly_mimetype` renderer stores figures as JSON only (no random div ids), so a
      re-run compares equal;
    - torch uses at most `threads` CPU threads (default: all cores torch sees) and a fixed seed.

    On Google Colab, whose front end renders neither plotly's mimetype nor ipywidgets 8 by
    itself, figures use plotly's ``colab`` renderer and Colab's widget manager is switched on.
    """
    if _on_colab():
        from google.colab import output  # only importable on Colab

        output.enable_custom_widget_manager()
        pio.renderers.default = "colab"
    else:
        pio.renderers.default = "plotly_mimetype"
    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    from minifer.device import default_device

    return default_device()


def _on_colab() -> bool:
    import sys

    return "google.colab" in sys.modules


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


def token_label(text: str) -> str:
    """A token's (or any short) text, readable in a table or on an axis: ``⏎`` for a newline,
    ``␣`` for a space, ``⇥`` for a tab, ``<0xFF>`` for a lone byte or a control character,
    ``(nothing)`` for the empty string. Printable text is shown as it is, without quotes."""
    if text == "":
        return "(nothing)"
    out = []
    i = 0
    while i < len(text):
        c = text[i]
        if text.startswith("\\x", i) and len(text) >= i + 4 and all(
                h in "0123456789abcdefABCDEF" for h in text[i + 2:i + 4]):
            out.append(f"<0x{text[i + 2:i + 4].upper()}>")  # a byte the tokenizer shows escaped
            i += 4
            continue
        if c == "\n":
            out.append("⏎")
        elif c == " ":
            out.append("␣")
        elif c == "\t":
            out.append("⇥")
        elif c == "\r":
            out.append("<0x0D>")
        elif not c.isprintable():
            out.append(f"<0x{ord(c):02X}>" if ord(c) < 256 else f"<U+{ord(c):04X}>")
        else:
            out.append(c)
        i += 1
    return "".join(out)


PRECISION_BITS = {"fp32": 32, "bf16": 16, "fp16": 16, "int8": 8, "int4": 4}


def precision_options(names: Iterable[str]) -> list[tuple[str, str]]:
    """Options for a precision slider, ``control("select", ..., options=...)``: ordered from 32
    to 4 bits, each labelled with its bits ("bf16 · 16 bit"); the values stay the names."""
    names = list(names)
    unknown = [n for n in names if n not in PRECISION_BITS]
    if unknown:
        raise ValueError(f"precision must be one of {list(PRECISION_BITS)}, got {unknown}")
    ordered = sorted(names, key=lambda n: (-PRECISION_BITS[n], list(PRECISION_BITS).index(n)))
    return [(f"{n} · {PRECISION_BITS[n]} bit", n) for n in ordered]


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


# ---- the run's measured figures, for notebooks/CLAIMS.md and the README -------------------------
MEASURED_TAG = "minifer-measured "
# CPU features a timing depends on (named as /proc/cpuinfo names them)
TIMING_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx_vnni",
                "amx_bf16", "amx_int8", "asimddp", "sve")


def machine() -> dict:
    """Where this run happened: CPU model and the features timings depend on, cores, torch's
    threads and version, the date and the load average (from the run itself)."""
    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and cpu in ("", platform.machine()):
                    cpu = line.split(":", 1)[1].strip()
                elif line.startswith(("flags", "Features")) and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    try:
        load = round(os.getloadavg()[0], 1)
    except (OSError, AttributeError):
        load = None
    return {"cpu": cpu, "flags": [f for f in TIMING_FLAGS if f in flags], "cpus": os.cpu_count(),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "load_1min": load}


def record(lesson: str, **figures: str | int | float) -> None:
    """Print this run's measured figures as one tagged JSON line, with the machine they were
    measured on. ``tools/write_claims.py`` reads these lines from the stored outputs and writes
    them into notebooks/CLAIMS.md (the numbers marked ‡), so that file quotes the run the
    notebooks show. Pass each figure as the claims file prints it (a formatted string). Call it
    in a cell tagged ``nbval-ignore-output``: the figures differ from machine to machine."""
    row = {"lesson": lesson, "figures": {k: v if isinstance(v, str) else repr(v)
                                         for k, v in figures.items()}, "machine": machine()}
    print(MEASURED_TAG + json.dumps(row, ensure_ascii=False))
