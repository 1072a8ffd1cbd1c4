"""Drive every lesson in a real browser, as a student would, and fail on what a student would see.

    python tools/browser_test.py [NOTEBOOK.ipynb ...] [--out screenshots]   (or: make browser-test)

It starts JupyterLab on 127.0.0.1 (a free port, a random token, settings in a temporary folder,
the kernel importing this checkout's `minifer`), drives Debian's Chromium headless through
playwright (it never downloads a browser), and for each notebook:

1. opens it, clears the stored outputs, runs all cells and waits until every code cell has run;
2. fails on an error output (a traceback), a cell that did not run, or no rendered plotly figure;
3. in each slider panel (`.widget-interact`) moves every slider one step with the keyboard and
   selects another option in every dropdown, and fails unless the panel's figure changed (its
   plotly `data`/`layout`, compared as JSON) within ``--answer-timeout`` seconds; each control's
   answer time is measured and reported;
4. checks each visible figure (after the run, and each panel's after each move) for text drawn
   over text (title, legend entries, annotations such as subplot titles, trace labels; glyph
   boxes, so text that merely comes close passes) and for text cut off (a title, legend or
   annotation beyond the figure's edge, a trace label beyond its plot area);
5. saves screenshots under ``<out>/<notebook>/``: the whole notebook after the run, and each
   panel before and after each move.

It prints a summary table and exits non-zero on any failure. The notebooks are never saved
(autosave is off); a notebook file changed by the run is restored and reported as a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# --------------------------------------------------------------------------------------------
# Pure helpers (tests/test_browser_test.py)

# Which kinds of text may not be drawn over which. Axis titles and tick labels are left out:
# plotly lays those out itself and they sit next to the plot, not over the texts below.
CHECKED_PAIRS = frozenset({
    ("title", "legend"), ("title", "annotation"), ("title", "label"),
    ("legend", "annotation"), ("legend", "label"),
    ("annotation", "annotation"), ("annotation", "label"), ("label", "label"),
})
# Kinds that must lie inside the figure (a legend or title beyond the edge is cut off).
FRAMED = frozenset({"title", "legend", "annotation"})


@dataclass(frozen=True)
class Box:
    """A piece of text drawn in a figure: its kind, its text and its box in page pixels.

    The lines of one text (or a legend entry's text and symbol) share a ``group`` and are not
    compared with each other; -1 means a group of its own. ``clip`` is the plot area that cuts
    the text off (a trace's labels with plotly's ``cliponaxis``), if any.
    """

    kind: str
    text: str
    x0: float
    y0: float
    x1: float
    y1: float
    group: int = -1
    clip: tuple[float, float, float, float] | None = None


def overlap(a: Box, b: Box) -> tuple[float, float]:
    """Width and height (pixels) of the intersection of two boxes; (0, 0) when they are apart."""
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return (w, h) if w > 0 and h > 0 else (0.0, 0.0)


def overlapping(boxes: list[Box], tol: float = 1.0) -> list[tuple[Box, Box]]:
    """Pairs of boxes whose kinds are checked against each other (:data:`CHECKED_PAIRS`), from
    different texts, that intersect by more than ``tol`` pixels both across and down (touching
    edges pass)."""
    if tol < 0:
        raise ValueError(f"tol must be >= 0 pixels, got {tol}")
    found = []
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            if (a.kind, b.kind) not in CHECKED_PAIRS and (b.kind, a.kind) not in CHECKED_PAIRS:
                continue
            if a.group == b.group != -1:
                continue
            w, h = overlap(a, b)
            if w > tol and h > tol:
                found.append((a, b))
    return found


def cut_off(boxes: list[Box], frame: tuple[float, float, float, float],
            tol: float = 2.0) -> list[Box]:
    """Texts the browser cuts off: titles, legends and annotations reaching more than ``tol``
    pixels beyond ``frame`` (x0, y0, x1, y1: the figure's drawing), and texts reaching beyond
    their own ``clip`` (a trace's labels outside the plot area)."""
    if tol < 0:
        raise ValueError(f"tol must be >= 0 pixels, got {tol}")

    def beyond(b: Box, r) -> bool:
        return b.x0 < r[0] - tol or b.y0 < r[1] - tol or b.x1 > r[2] + tol or b.y1 > r[3] + tol

    return [b for b in boxes if (b.kind in FRAMED and beyond(b, frame))
            or (b.clip is not None and beyond(b, b.clip))]


def classify_stderr(text: str) -> str:
    """"error" for a traceback or an exception line, else "warning" (plain stderr output)."""
    if "Traceback" in text or re.search(r"^\s*[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b",
                                        text, re.M):
        return "error"
    return "warning"


def table(rows: list[list[str]], header: list[str]) -> str:
    """Rows as an aligned plain-text table (first column left-aligned, the others right)."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]

    def line(cells):
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def short(text: str, n: int = 50) -> str:
    """``text`` on one line, at most ``n`` characters."""
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


# --------------------------------------------------------------------------------------------
# JupyterLab

# Lab settings for the run: never save a notebook, keep every cell in the page (with windowing,
# cells off screen leave the DOM or skip layout), no news or update checks.
LAB_SETTINGS = {
    "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false",
                                                     "checkForUpdates": False},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    """A JupyterLab server serving ``root`` on 127.0.0.1, with its REST API."""

    def __init__(self, root: Path, python: str, tmp: Path):
        self.root, self.port, self.token = root, free_port(), secrets.token_hex(16)
        self.base = f"http://127.0.0.1:{self.port}"
        for name, values in LAB_SETTINGS.items():
            path = tmp / "settings" / f"{name}.jupyterlab-settings"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        # A user's own kernelspecs, config or workspaces must not change what runs.
        env.update(JUPYTER_DATA_DIR=str(tmp / "data"), JUPYTER_CONFIG_DIR=str(tmp / "config"),
                   JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
                   JUPYTERLAB_SETTINGS_DIR=str(tmp / "settings"),
                   JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"))
        cmd = [python, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
               f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={root}"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-root")
        self.log = tmp / "lab.log"
        self._log = open(self.log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=root)

    def api(self, path: str, method: str = "GET"):
        req = urllib.request.Request(f"{self.base}{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body else None

    def wait_ready(self, timeout: float = 120) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                break
            try:
                self.api("/api/status")
                return
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.5)
        raise RuntimeError(f"JupyterLab did not start; its log:\n{self.log.read_text()[-3000:]}")

    def session(self, name: str) -> dict | None:
        for s in self.api("/api/sessions"):
            if s.get("path", "").endswith(name):
                return s
        return None

    def kernel_state(self, name: str) -> str | None:
        s = self.session(name)
        return s["kernel"].get("execution_state") if s else None

    def stop_kernel(self, name: str) -> None:
        s = self.session(name)
        if s:
            self.api(f"/api/sessions/{s['id']}", method="DELETE")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


# --------------------------------------------------------------------------------------------
# In the page

# Everything plotly draws as text that may collide, in page pixels, for one figure div.
JS_BOXES = """gd => {
  const r = e => { const b = e.getBoundingClientRect(); return [b.left, b.top, b.right, b.bottom]; };
  const union = bs => bs.length ? [Math.min(...bs.map(b => b[0])), Math.min(...bs.map(b => b[1])),
      Math.max(...bs.map(b => b[2])), Math.max(...bs.map(b => b[3]))] : null;
  // A text's box as the browser lays it out spans the font's whole ascent and descent; the
  // glyphs (the ink) are shorter. Trim each line to its ink with the canvas's text metrics.
  const ctx = document.createElement('canvas').getContext('2d');
  const ink = el => {  // one box per line of text
    const lines = el.querySelectorAll('tspan.line'), boxes = [];
    for (const part of (lines.length ? [...lines] : [el])) {
      const b = part.getBoundingClientRect(), text = part.textContent;
      if (!text.trim() || b.width <= 0 || b.height <= 0) continue;
      const cs = getComputedStyle(part);
      ctx.font = `${cs.fontStyle} ${cs.fontWeight} ${cs.fontSize} ${cs.fontFamily}`;
      const m = ctx.measureText(text);
      let top = b.top, bottom = b.bottom;
      const full = m.fontBoundingBoxAscent + m.fontBoundingBoxDescent;
      if (full > 0) {
        const k = b.height / full;
        top += Math.max(0, m.fontBoundingBoxAscent - m.actualBoundingBoxAscent) * k;
        bottom -= Math.max(0, m.fontBoundingBoxDescent - m.actualBoundingBoxDescent) * k;
      }
      boxes.push([b.left, top, b.right, bottom]);
    }
    return boxes;
  };
  const svg = gd.querySelector('.main-svg');
  const out = {frame: svg ? r(svg) : r(gd), boxes: []};
  let group = 0;
  const add = (kind, boxes, text) => {  // the lines of one text share a group
    group += 1;
    for (const b of boxes) if (b && b[2] - b[0] > 0 && b[3] - b[1] > 0 && text.trim())
      out.boxes.push([kind, text, ...b, group]);
  };
  const visible = e => getComputedStyle(e).opacity !== '0' && getComputedStyle(e).visibility !== 'hidden';
  gd.querySelectorAll('.gtitle').forEach(e => add('title', ink(e), e.textContent));
  // each legend entry: its text and its symbol (not the legend's padding around them)
  gd.querySelectorAll('.legend .traces').forEach(e => {
    const t = e.querySelector('.legendtext'), sym = e.querySelector('.legendsymbols');
    const parts = t ? ink(t) : [];
    if (sym) { const sb = r(sym); if (sb[2] > sb[0] && sb[3] > sb[1]) parts.push(sb); }
    if (visible(e)) add('legend', [union(parts)], t ? t.textContent : 'legend entry');
  });
  gd.querySelectorAll('.legendtitletext').forEach(t => add('legend', ink(t), t.textContent));
  gd.querySelectorAll('.annotation').forEach(a => {
      const t = a.querySelector('.annotation-text');
      if (t && visible(a)) add('annotation', ink(t), t.textContent); });
  // a trace's text labels; with cliponaxis (plotly's default) the plot area cuts them off
  const fl = gd._fullLayout || {}, s0 = svg ? svg.getBoundingClientRect() : {left: 0, top: 0};
  gd.querySelectorAll('.cartesianlayer .subplot').forEach(sub => {
    const m = /^x(\\d*)y(\\d*)$/.exec([...sub.classList].find(c => /^x\\d*y\\d*$/.test(c)) || '');
    const xa = m && fl['xaxis' + m[1]], ya = m && fl['yaxis' + m[2]];
    const area = xa && ya ? [s0.left + xa._offset, s0.top + ya._offset,
                             s0.left + xa._offset + xa._length, s0.top + ya._offset + ya._length]
                          : null;
    sub.querySelectorAll('.trace').forEach(tr => {
      const cd = tr.__data__, trace = cd && cd[0] && cd[0].trace;
      const clip = trace && trace.cliponaxis === false ? null : area;
      tr.querySelectorAll('.textpoint text, text.bartext').forEach(t => {
        if (!visible(t)) return;
        group += 1;
        for (const b of ink(t)) out.boxes.push(['label', t.textContent, ...b, group, clip]);
      });
    });
  });
  return out;
}"""

# The figure a panel shows, as JSON (null while none is drawn).
JS_FIG = """p => {
  const gd = p.querySelector('.js-plotly-plot');
  if (!gd || !gd.querySelector('.main-svg') || !gd.data) return null;
  return JSON.stringify({data: gd.data, layout: gd.layout}, (k, v) =>
      k.startsWith('_') ? undefined : (ArrayBuffer.isView(v) ? Array.from(v) : v));
}"""

# After a move: "changed" once the panel draws another figure, "error" if it shows a traceback.
JS_CHANGED = ("([p, before]) => { const f = (" + JS_FIG + ")(p);"
              " if (f !== null && f !== before) return 'changed';"
              " const err = [...p.querySelectorAll('.jp-OutputArea-output[data-mime-type="
              "\"application/vnd.jupyter.stderr\"]')].some(o => /Traceback|Error/.test(o.textContent));"
              " return err ? 'error' : false; }")

JS_PROMPTS = """() => {
  const cells = [...document.querySelectorAll('.jp-NotebookPanel .jp-CodeCell')];
  const run = [], blank = [];
  cells.forEach(c => {
    const p = (c.querySelector('.jp-InputPrompt') || {}).textContent || '';
    const src = (c.querySelector('.cm-content') || {}).textContent || '';
    if (p.includes('*')) run.push(p); else if (!/\\d/.test(p) && src.trim()) blank.push(src);
  });
  return {running: run.length, blank: blank.map(s => s.slice(0, 60)), code: cells.length};
}"""

JS_STDERR = """root => [...root.querySelectorAll(
    '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')].map(o => {
  const cells = [...document.querySelectorAll('.jp-NotebookPanel .jp-Cell')];
  return [cells.indexOf(o.closest('.jp-Cell')) + 1, o.textContent];
})"""

JS_FIGURES = """() => {
  const cells = [...document.querySelectorAll('.jp-NotebookPanel .jp-Cell')];
  return [...document.querySelectorAll('.jp-NotebookPanel .js-plotly-plot')].map(gd => {
    const b = gd.getBoundingClientRect(), t = gd.querySelector('.gtitle');
    return {cell: cells.indexOf(gd.closest('.jp-Cell')) + 1, visible: b.width > 0 && b.height > 0,
            drawn: !!gd.querySelector('.main-svg'), title: t ? t.textContent : ''};
  });
}"""

JS_CONTROL = """el => {
  const box = el.closest('.widget-inline-hbox') || el.parentElement;
  const label = box.querySelector('.widget-label');
  const readout = box.querySelector('.widget-readout');
  const value = el.tagName === 'SELECT' ? el.options[el.selectedIndex].text
      : (readout ? readout.textContent : el.getAttribute('aria-valuetext'));
  return {label: label ? label.textContent : '', value,
          now: +el.getAttribute('aria-valuenow'), max: +el.getAttribute('aria-valuemax'),
          index: el.selectedIndex, options: el.options ? el.options.length : 0};
}"""


@dataclass
class Result:
    """What one notebook did in the browser."""

    name: str
    run_s: float = 0.0
    figures: int = 0
    panels: int = 0
    controls: int = 0
    moved: int = 0
    answers: list[tuple[str, float]] = field(default_factory=list)
    overlaps: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def fail(self, msg: str) -> None:
        self.failures.append(msg)
        print(f"  FAIL {msg}", flush=True)


def wait_until(pred, timeout: float, interval: float = 0.2) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(interval)
    return False


class NotebookRun:
    """One notebook open in one browser page."""

    def __init__(self, lab: Lab, context, name: str, out: Path, args):
        self.lab, self.name, self.args = lab, name, args
        self.out = out / Path(name).stem
        self.out.mkdir(parents=True, exist_ok=True)
        for old in self.out.glob("*.png"):
            old.unlink()
        self.res = Result(name)
        self.page = context.new_page()
        self.js_errors: list[str] = []
        self.page.on("pageerror", lambda e: self.js_errors.append(str(e)))
        self.seen_overlaps: set[tuple] = set()

    # --- helpers
    def dialogs(self) -> list[str]:
        return [short(t, 200) for t in self.page.locator(".jp-Dialog").all_inner_texts()]

    def kernel_idle(self) -> bool:
        return self.lab.kernel_state(self.name) == "idle"

    def menu(self, menu: str, item: str) -> None:
        self.page.get_by_role("menuitem", name=menu, exact=True).click()
        self.page.locator(".lm-Menu-itemLabel", has_text=item).first.click()

    def check_stderr(self, root, where: str) -> None:
        for cell, text in root.evaluate(JS_STDERR):
            kind = classify_stderr(text)
            msg = f"{where}: cell {cell}: {short(text.strip().splitlines()[-1] if text.strip() else text, 160)}"
            if kind == "error":
                self.res.fail(f"error output in {msg}")
            elif msg not in self.res.notes:
                self.res.notes.append(f"stderr in {msg}")

    def check_text(self, gd, cell: int, label: str) -> None:
        """Report texts of figure ``gd`` drawn over each other or cut off, each problem once
        per cell (a panel's title changes with its controls: numbers are not told apart)."""
        raw = gd.evaluate(JS_BOXES)
        boxes = [Box(*b[:7], clip=tuple(b[7]) if len(b) > 7 and b[7] else None)
                 for b in raw["boxes"]]
        problems = [((a.kind, a.text), (b.kind, b.text),
                     f"{a.kind} '{short(a.text, 40)}' overlaps {b.kind} '{short(b.text, 40)}' "
                     "({:.0f}x{:.0f} px)".format(*overlap(a, b)))
                    for a, b in overlapping(boxes, self.args.tol)]
        problems += [((b.kind, b.text), ("edge", ""), f"{b.kind} '{short(b.text, 40)}' is cut off "
                      + ("by the plot area" if b.clip else "at the figure's edge"))
                     for b in cut_off(boxes, tuple(raw["frame"]), self.args.tol + 1)]
        for a, b, text in problems:
            key = (cell, *sorted((k, re.sub(r"[\d.,]+", "#", t)) for k, t in (a, b)))
            if key not in self.seen_overlaps:
                self.seen_overlaps.add(key)
                msg = f"{label}: {text}"
                self.res.overlaps.append(msg)
                print(f"  OVERLAP {msg}", flush=True)

    def screenshot_notebook(self, path: Path) -> None:
        """The whole notebook in one picture: a viewport as tall as the notebook, for a moment."""
        size = self.page.viewport_size
        h = self.page.evaluate("""() => { const s = document.querySelector(
            '.jp-NotebookPanel .jp-WindowedPanel-outer'); return s ? s.scrollHeight : 0; }""")
        self.page.set_viewport_size({"width": size["width"],
                                     "height": int(min(max(size["height"], h + 120), 16000))})
        time.sleep(1.0)
        self.page.evaluate("""() => { const s = document.querySelector(
            '.jp-NotebookPanel .jp-WindowedPanel-outer'); if (s) s.scrollTop = 0; }""")
        time.sleep(0.3)
        self.page.screenshot(path=str(path))
        self.page.set_viewport_size(size)
        time.sleep(0.5)

    # --- the steps
    def open(self) -> None:
        url = (f"{self.lab.base}/lab/tree/{urllib.parse.quote(self.name)}"
               f"?reset&token={self.lab.token}")
        self.page.goto(url)
        self.page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=90_000)
        self.page.keyboard.press("Control+b")  # fold the file browser: the notebook gets its width

        def ready():
            accept = self.page.locator(".jp-Dialog .jp-mod-accept")
            if accept.count():  # "Select Kernel" for a notebook without a session
                accept.first.click()
            return self.kernel_idle()

        if not wait_until(ready, 120, 0.5):
            raise RuntimeError(f"the kernel did not start (state {self.lab.kernel_state(self.name)})")

    def run_all(self) -> None:
        self.menu("Edit", "Clear Outputs of All Cells")
        t0 = time.monotonic()
        self.menu("Run", "Run All Cells")
        started = wait_until(lambda: self.page.evaluate(JS_PROMPTS)["running"] > 0, 20, 0.1)
        if not started:
            self.res.notes.append("no cell was seen running after Run All")

        def done():
            p = self.page.evaluate(JS_PROMPTS)
            return p["running"] == 0 and self.kernel_idle()

        finished = wait_until(done, self.args.run_timeout, 0.3)
        self.res.run_s = time.monotonic() - t0
        if not finished:
            self.res.fail(f"Run All did not finish within {self.args.run_timeout} s")
        # let the last outputs and widgets render: the drawn figure count stops changing
        last, stable_since = -1, time.monotonic()
        end = time.monotonic() + 30
        while time.monotonic() < end:
            n = self.page.locator(".jp-NotebookPanel .js-plotly-plot .main-svg").count()
            if n != last:
                last, stable_since = n, time.monotonic()
            elif time.monotonic() - stable_since > 2.0:
                break
            time.sleep(0.25)
        prompts = self.page.evaluate(JS_PROMPTS)
        for src in prompts["blank"]:
            self.res.fail(f"a code cell did not run: {short(src, 60)!r}")
        for d in self.dialogs():
            self.res.fail(f"dialog after Run All: {d}")

    def check_outputs(self) -> None:
        self.check_stderr(self.page.locator(".jp-NotebookPanel").first, "after Run All")
        figs = self.page.evaluate(JS_FIGURES)
        self.res.figures = sum(f["drawn"] for f in figs)
        if self.res.figures == 0:
            self.res.fail("no plotly figure was rendered")
        gds = self.page.locator(".jp-NotebookPanel .js-plotly-plot")
        for i, f in enumerate(figs):
            if f["visible"] and f["drawn"]:
                self.check_text(gds.nth(i), f["cell"],
                                f"cell {f['cell']} figure '{short(f['title'], 40)}'")
        self.screenshot_notebook(self.out / "notebook.png")

    def drive_panels(self) -> None:
        panels = self.page.locator(".jp-NotebookPanel .widget-interact")
        self.res.panels = panels.count()
        cells = self.page.evaluate("""() => [...document.querySelectorAll(
            '.jp-NotebookPanel .widget-interact')].map(p => [...document.querySelectorAll(
            '.jp-NotebookPanel .jp-Cell')].indexOf(p.closest('.jp-Cell')) + 1)""")
        for i in range(self.res.panels):
            panel = panels.nth(i)
            where = f"panel {i + 1} (cell {cells[i]})"
            panel.scroll_into_view_if_needed()
            if panel.locator(".js-plotly-plot .main-svg").count() == 0:
                self.res.fail(f"{where} shows no figure")
                continue
            panel.screenshot(path=str(self.out / f"panel{i + 1}_0_before.png"))
            controls = [("slider", h) for h in panel.locator(".noUi-handle").all()]
            controls += [("dropdown", s) for s in panel.locator("select").all()]
            for j, (kind, el) in enumerate(controls, 1):
                self.res.controls += 1
                self.move(panel, i + 1, cells[i], j, kind, el)

    def move(self, panel, i: int, cell: int, j: int, kind: str, el) -> None:
        """Move control ``j`` of panel ``i`` (in ``cell``) one step and wait for the panel's
        figure to change."""
        where = f"panel {i} (cell {cell})"
        info = el.evaluate(JS_CONTROL)
        name = f"{where} {kind} '{info['label']}'"
        before = panel.evaluate(JS_FIG)
        if kind == "slider":
            key = "ArrowLeft" if info["now"] >= info["max"] else "ArrowRight"
            el.focus()
            t0 = time.monotonic()
            el.press(key)
        else:
            if info["options"] < 2:
                self.res.notes.append(f"{name} has one option: not moved")
                return
            t0 = time.monotonic()
            el.select_option(index=(info["index"] + 1) % info["options"])
        after_value = el.evaluate(JS_CONTROL)["value"]
        moved = f"{name} {info['value']} -> {after_value}"
        if after_value == info["value"]:
            self.res.fail(f"{moved}: the control did not move")
            return
        try:
            state = self.page.wait_for_function(
                JS_CHANGED, arg=[panel.element_handle(), before], polling=100,
                timeout=self.args.answer_timeout * 1000).json_value()
            took = time.monotonic() - t0
        except Exception:  # playwright's TimeoutError
            state, took = "timeout", time.monotonic() - t0
        if state != "changed":
            self.res.fail(f"{moved}: the figure did not change within {self.args.answer_timeout} s"
                          if state == "timeout" else f"{moved}: the panel shows an error")
            wait_until(self.kernel_idle, 60, 0.2)
            panel.screenshot(path=str(self.out / f"panel{i}_{j}_after.png"))
            self.check_stderr(panel, moved)
            return
        self.res.moved += 1
        self.res.answers.append((f"{where} '{info['label']}'", took))
        print(f"  {moved}: figure changed after {took:.1f} s", flush=True)
        wait_until(self.kernel_idle, 60, 0.2)
        time.sleep(0.3)
        panel.screenshot(path=str(self.out / f"panel{i}_{j}_after.png"))
        self.check_stderr(panel, moved)
        gd = panel.locator(".js-plotly-plot").first
        if gd.count():
            self.check_text(gd, cell,
                            f"{where} figure after {kind} '{info['label']}' -> {after_value}")

    def close(self) -> None:
        for d in self.dialogs():
            self.res.fail(f"dialog at the end: {d}")
        if self.js_errors:
            self.res.notes.append(f"{len(self.js_errors)} page errors, first: "
                                  f"{short(self.js_errors[0], 160)}")
        self.page.close()
        try:
            self.lab.stop_kernel(self.name)
        except (urllib.error.URLError, OSError) as e:
            self.res.notes.append(f"could not stop the kernel: {e}")


def check_notebook(lab: Lab, context, name: str, out: Path, args) -> Result:
    print(f"== {name}", flush=True)
    run = NotebookRun(lab, context, name, out, args)
    try:
        run.open()
        run.run_all()
        run.check_outputs()
        run.drive_panels()
    except Exception as e:  # a step that could not go on: record it and test the next notebook
        run.res.fail(f"{type(e).__name__}: {short(str(e), 300)}")
        try:
            run.page.screenshot(path=str(run.out / "failure.png"))
        except Exception:
            pass
    finally:
        run.close()
    r = run.res
    print(f"   ran in {r.run_s:.1f} s, {r.figures} figures, {r.panels} panels, "
          f"{r.moved}/{r.controls} controls answered, {len(r.overlaps)} text overlaps, "
          f"{len(r.failures)} failures", flush=True)
    return r


def summary(results: list[Result]) -> str:
    rows = []
    for r in results:
        slow = max(r.answers, key=lambda a: a[1], default=None)
        rows.append([r.name, f"{r.run_s:.1f}", r.figures, r.panels, f"{r.moved}/{r.controls}",
                     f"{slow[1]:.1f}" if slow else "-", len(r.overlaps), len(r.failures)])
    return table(rows, ["notebook", "run s", "figures", "panels", "controls moved",
                        "max answer s", "overlaps", "failures"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("notebooks", nargs="*", type=Path,
                    help="notebooks, all in one folder (default: notebooks/[0-9]*.ipynb)")
    ap.add_argument("--out", type=Path, default=REPO / "screenshots",
                    help="screenshot folder (default: screenshots/)")
    ap.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium",
                    help="the browser (Debian's chromium; never downloaded)")
    ap.add_argument("--python", default=sys.executable, help="runs JupyterLab and the kernel")
    ap.add_argument("--run-timeout", type=float, default=300, help="seconds for Run All")
    ap.add_argument("--answer-timeout", type=float, default=60,
                    help="seconds a panel's figure may take to answer a control")
    ap.add_argument("--tol", type=float, default=1.0,
                    help="pixels two texts may overlap before it counts")
    args = ap.parse_args(argv)

    notebooks = [p.resolve() for p in args.notebooks] or sorted(
        (REPO / "notebooks").glob("[0-9]*.ipynb"))
    if not notebooks:
        ap.error("no notebooks")
    roots = {p.parent for p in notebooks}
    if len(roots) != 1:
        ap.error("the notebooks must all be in one folder")
    root = roots.pop()
    if not Path(args.chromium).exists():
        ap.error(f"no browser at {args.chromium}: install Debian's chromium (apt-get install "
                 "chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        ap.error("playwright is missing: pip install -e '.[dev]'")

    # a SIGTERM (CI's timeout) unwinds like ^C: JupyterLab and the browser are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    originals = {p: p.read_bytes() for p in notebooks}
    t_start = time.monotonic()
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="browser-test-") as tmp:
        lab = Lab(root, args.python, Path(tmp))
        try:
            lab.wait_ready()
            print(f"JupyterLab at {lab.base} serving {root}", flush=True)
            with sync_playwright() as pw:
                browser = pw.chromium.launch(
                    executable_path=args.chromium, headless=True,
                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                          "--disable-dev-shm-usage"])
                context = browser.new_context(viewport={"width": 1280, "height": 1000})
                for nb in notebooks:
                    results.append(check_notebook(lab, context, nb.name, args.out, args))
                browser.close()
        finally:
            lab.stop()
    for p, data in originals.items():
        if p.read_bytes() != data:
            p.write_bytes(data)
            next(r for r in results if r.name == p.name).fail(
                "the notebook file was changed by the run (restored)")

    print("\n" + summary(results))
    print(f"\nscreenshots: {args.out}/<notebook>/   total {time.monotonic() - t_start:.0f} s")
    report = [{"notebook": r.name, "run_s": round(r.run_s, 1), "figures": r.figures,
               "panels": r.panels, "controls": r.controls, "moved": r.moved,
               "answers_s": {k: round(v, 2) for k, v in r.answers}, "overlaps": r.overlaps,
               "failures": r.failures, "notes": r.notes} for r in results]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(json.dumps(report, indent=1, ensure_ascii=False))
    for r in results:
        for n in r.notes:
            print(f"note  {r.name}: {n}")
    bad = 0
    for r in results:
        for f in r.failures:
            print(f"FAIL  {r.name}: {f}")
            bad += 1
        for o in r.overlaps:
            print(f"FAIL  {r.name}: overlapping text: {o}")
            bad += 1
    print(f"\n{bad} failures" if bad else "\nall notebooks passed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
