"""The static views that `make notebooks` saves beside figures (tools/static_figures.py), the
guard that `make test` runs (tools/check_executed.py), and the runner (tools/run_notebooks.py)
on a tiny notebook with a slider panel."""

import base64
import copy
import importlib.util
import json
import shutil
import struct
import zlib

import nbformat
import numpy as np
import pytest
from nbformat.v4 import new_code_cell, new_notebook, new_output
from tool_modules import load_tool

sf = load_tool("static_figures")


FIGURE = {"data": [{"type": "scatter", "x": [0, 1], "y": [1, 2]}],
          "layout": {"title": {"text": "t"}, "width": 720, "height": 360,
                     "margin": {"b": 50}}, "config": {}}
PANEL_TEXT = "interactive(children=(IntSlider(value=5, description='n', max=20, min=1), Output()…"
VIEW = {"model_id": "abc", "version_major": 2, "version_minor": 0}


def notebook(*outputs_per_cell):
    nb = new_notebook(cells=[new_code_cell("x", execution_count=i + 1, outputs=list(outs))
                             for i, outs in enumerate(outputs_per_cell)])
    return nbformat.from_dict(json.loads(json.dumps(nb)))


def plotly_output():
    return new_output("display_data", data={sf.PLOTLY: copy.deepcopy(FIGURE)})


def panel_output(pending=True):
    out = new_output("display_data", data={sf.WIDGET: dict(VIEW), "text/plain": PANEL_TEXT})
    if pending:
        out.metadata[sf.PENDING] = {"figure": copy.deepcopy(FIGURE), "caption": "Saved view (n = 5)"}
    return out


class FakeRender:
    def __init__(self):
        self.figures = []

    def __call__(self, figure):
        self.figures.append(figure)
        return b"\x89PNG fake"


def test_missing_names_figures_and_panels_without_png():
    nb = notebook([new_output("stream", name="stdout", text="hi")],
                  [plotly_output()], [panel_output(pending=False)],
                  [new_output("display_data", data={sf.WIDGET: dict(VIEW), "text/plain": "IntSlider()"})])
    assert list(sf.missing(nb)) == [(1, "plotly figure"), (2, "slider panel")]


def test_add_static_puts_png_beside_figures_and_in_place_of_panel_views():
    nb = notebook([plotly_output()], [panel_output()], [new_output("stream", name="stdout", text="1")])
    render = FakeRender()
    assert sf.add_static(nb, render) == 2
    fig_out, panel_out = nb.cells[0].outputs[0], nb.cells[1].outputs[0]
    assert base64.b64decode(fig_out.data[sf.PNG]) == b"\x89PNG fake"
    assert fig_out.data[sf.PLOTLY] == FIGURE  # the interactive figure is kept, unchanged
    assert set(panel_out.data) == {"text/plain", sf.PNG}  # widget view dropped: never restorable
    assert sf.PENDING not in panel_out.metadata  # the figure's JSON is not kept
    assert render.figures[0] == FIGURE
    captioned = render.figures[1]
    assert captioned["layout"]["annotations"][-1]["text"] == "Saved view (n = 5)"
    assert list(sf.missing(nb)) == []
    assert sf.add_static(nb, render) == 0  # idempotent


def test_every_png_gets_an_alt_text_saying_what_the_figure_shows():
    fig = copy.deepcopy(FIGURE)
    fig["data"][0]["name"] = "decode <b>step</b>"
    fig["layout"].update(xaxis={"title": {"text": "batch"}}, yaxis={"title": {"text": "ms"}})
    fig["layout"]["title"]["text"] = "One step<br>per token"
    alt = sf.alt_text(fig, "Saved view (n = 5)")
    assert alt == ("Line chart: One step per token. Axes: ms against batch. Series: decode step. "
                   "Saved view (n = 5).")
    nb = notebook([plotly_output()], [panel_output()])
    sf.add_static(nb, FakeRender())
    assert [sf.alt_of(c.outputs[0]) for c in nb.cells] == [sf.alt_text(FIGURE),
                                                           sf.alt_text(FIGURE, "Saved view (n = 5)")]
    del nb.cells[0].outputs[0].metadata[sf.PNG]  # a PNG stored before alt texts: given one
    assert sf.add_static(nb, FakeRender()) == 0 and sf.alt_of(nb.cells[0].outputs[0]) == sf.alt_text(FIGURE)
    nb.cells[1].outputs[0].metadata[sf.PNG].pop("alt")  # a panel's PNG cannot be: it is reported
    assert list(sf.missing(nb)) == [(1, "static PNG without alt text")]


def test_caption_adds_room_below_and_leaves_the_figure_alone():
    fig = sf.caption_figure(FIGURE, "c")
    assert fig["layout"]["margin"]["b"] == 50 + sf.CAPTION_PX
    assert fig["layout"]["height"] == 360 + sf.CAPTION_PX
    note = fig["layout"]["annotations"][0]
    assert note["yshift"] < -50 and note["yref"] == "paper" and note["y"] == 0
    assert "annotations" not in FIGURE["layout"] and FIGURE["layout"]["margin"]["b"] == 50


def test_guard_fails_without_static_views_and_says_how_to_fix(tmp_path):
    check = load_tool("check_executed")
    path = tmp_path / "n.ipynb"
    nbformat.write(notebook([plotly_output()], [panel_output(pending=False)]), path)
    bad = check.problems(str(path))
    assert len(bad) == 2 and all("no static PNG" in line for line in bad)
    nb = nbformat.read(path, 4)
    sf.add_static(nb, FakeRender())
    nb.cells[1].outputs[0].data[sf.PNG] = "eA=="  # a panel that was given its view
    nbformat.write(nb, path)
    bad = check.problems(str(path))
    assert len(bad) == 1 and "code cell 1: a static PNG has no alt text" in bad[0]
    sf.set_alt(nb.cells[1].outputs[0], "a panel")  # and its alt text
    nbformat.write(nb, path)
    assert check.problems(str(path)) == []


@pytest.mark.skipif(not (shutil.which("chromium") and importlib.util.find_spec("kaleido")),
                    reason="rendering needs Debian's chromium and kaleido (the `dev` extra); "
                           "only `make notebooks` renders")
def test_renderer_makes_a_png_of_the_figures_size():
    with sf.Renderer() as render:
        png = render(FIGURE)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (720, 360)


PANEL_NB = [
    "import plotly.graph_objects as go\nfrom minifer_course.lessons import common\ncommon.setup()\n"
    "def f(n: int = 3):\n    return go.Figure(go.Bar(y=list(range(n))), layout=dict(width=400))",
    "ui = common.panel(f, n=common.control('int', 'n', min=1, max=9, value=5))\ndisplay(ui)",
    "ui.children[0].value = 7  # moves the shown panel: its saved view stays the default\n"
    "assert len(ui.result.data[0].y) == 7",
    "f(2)",
]


def test_runner_saves_the_panels_default_view_and_reports_costs(tmp_path):
    run = load_tool("run_notebooks")
    path = tmp_path / "tiny.ipynb"
    nb = new_notebook(cells=[new_code_cell(src) for src in PANEL_NB])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    render = FakeRender()
    row = run.run_one(path, render)

    saved = nbformat.read(path, 4)
    panel, figure = saved.cells[1].outputs[-1], saved.cells[3].outputs[0]
    assert set(panel.data) == {"text/plain", sf.PNG}
    assert panel.metadata == {sf.PNG: {"alt": "Bar chart: untitled. Saved view (n = 5): run the "
                                              "notebook to move the controls."}}  # no pending JSON
    assert sf.alt_of(figure)
    assert sf.PNG in figure.data and sf.PLOTLY in figure.data
    assert "widgets" not in saved.metadata
    panel_fig = render.figures[0]
    assert len(panel_fig["data"][0]["y"]) == 5  # the default, not the value a later cell set
    assert panel_fig["layout"]["annotations"][-1]["text"].startswith("Saved view (n = 5)")
    assert row["static_pngs"] == 2 and row["kernel_peak_rss_mb"] > 0
    assert row["tree_peak_rss_mb"] > 0
    assert row["size_kb"] >= 0 and row["cells_s"] <= row["with_kernel_start_s"]
    assert row["kernel_cpu_s"] > 0

    report = tmp_path / "RUNTIMES.md"
    run.write_report(report, [row])
    assert "| tiny.ipynb |" in report.read_text()
    assert json.loads(report.with_suffix(".json").read_text())["notebooks"][0]["notebook"] == "tiny.ipynb"


def encode_png(img, kind):
    """A minimal PNG encoder (RGBA, every row filtered with ``kind``), to test the decoder."""
    h, w, bpp = img.shape
    raw = img.reshape(h, w * bpp).astype(int)
    rows = b""
    for y in range(h):
        prev = raw[y - 1] if y else [0] * (w * bpp)
        out = []
        for x in range(w * bpp):
            a = raw[y][x - bpp] if x >= bpp else 0
            b, c = prev[x], (prev[x - bpp] if x >= bpp else 0)
            p = a + b - c
            paeth = a if abs(p - a) <= abs(p - b) and abs(p - a) <= abs(p - c) else (
                b if abs(p - b) <= abs(p - c) else c)
            pred = [0, a, b, (a + b) // 2, paeth][kind]
            out.append((raw[y][x] - pred) % 256)
        rows += bytes([kind] + out)
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 6, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + sf._chunk(b"IHDR", ihdr)
            + sf._chunk(b"IDAT", zlib.compress(rows)) + sf._chunk(b"IEND", b""))


def decode_palette_png(png):
    pos, chunks = 8, {}
    while pos < len(png):
        (n,) = struct.unpack(">I", png[pos:pos + 4])
        chunks.setdefault(png[pos + 4:pos + 8], b"")
        chunks[png[pos + 4:pos + 8]] += png[pos + 8:pos + 8 + n]
        pos += 12 + n
    w, h, _, ctype = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert ctype == 3
    palette = np.frombuffer(chunks[b"PLTE"], np.uint8).reshape(-1, 3)
    rows = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), np.uint8).reshape(h, w + 1)
    assert (rows[:, 0] == 0).all()
    return palette[rows[:, 1:]]


@pytest.mark.parametrize("kind", range(5))
def test_png_decoder_undoes_every_row_filter(kind):
    rng = np.random.default_rng(kind)
    img = rng.integers(0, 256, (5, 7, 4), dtype=np.uint8)
    img[..., 3] = 255
    assert (sf._pixels(encode_png(img, kind)) == img[..., :3]).all()


def test_shrink_keeps_a_few_colour_figure_exact_and_leaves_other_pngs_alone():
    img = np.full((40, 60, 4), 255, np.uint8)
    img[10:20, 5:50, :3] = (31, 119, 180)  # a plotly-blue bar on white
    img[25, :, :3] = 0  # an axis line
    png = encode_png(img, 2)
    small = sf.shrink_png(png)
    assert len(small) < len(png)
    assert (decode_palette_png(small) == img[..., :3]).all()  # <= 256 colours: lossless
    translucent = img.copy()
    translucent[0, 0, 3] = 0
    assert sf.shrink_png(encode_png(translucent, 0)) == encode_png(translucent, 0)


def test_shrink_of_a_many_colour_picture_is_lossless():
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (30, 30, 4), dtype=np.uint8)
    img[..., 3] = 255
    png = encode_png(img, 0)
    small = sf.shrink_png(png)
    if small != png:  # lossless RGB, when it is smaller
        assert (sf._pixels(small) == img[..., :3]).all()


def test_a_long_caption_wraps_inside_the_figure():
    caption = "Saved view (" + ", ".join(f"control{i} = value{i}" for i in range(12)) + ")"
    lines = sf.wrap_caption(caption, 720)
    assert len(lines) > 1 and " ".join(lines) == caption
    assert all(len(line) * sf.CAPTION_CHAR_PX <= 720 for line in lines)
    fig = sf.caption_figure({"data": [], "layout": {"width": 720}}, caption)
    assert fig["layout"]["annotations"][-1]["text"] == "<br>".join(lines)
    assert fig["layout"]["margin"]["b"] == 80 + sf.CAPTION_PX * len(lines)
