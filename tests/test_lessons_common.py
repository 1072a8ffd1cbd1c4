"""The lessons' shared helpers: one rounding helper, one control helper, one panel contract."""

from __future__ import annotations

import ast
import pathlib

import ipywidgets as widgets
import plotly.graph_objects as go
import pytest

from minifer_course.lessons import common

LESSONS = pathlib.Path(common.__file__).parent


def test_sig_rounds_to_significant_digits():
    assert common.sig(0.28053149) == 0.280531
    assert common.sig(0.28053149, 2) == 0.28
    assert common.sig(72563.4, 3) == 72600.0
    assert common.sig(0.0) == 0.0


def test_control_shows_the_whole_label_and_updates_on_release():
    s = common.control("int", "new tokens", value=4, min=1, max=8)
    assert isinstance(s, widgets.IntSlider) and s.value == 4
    assert s.style.description_width == "initial" and s.continuous_update is False
    d = common.control("dropdown", "hardware", options=["a", "b"], value="b")
    assert isinstance(d, widgets.Dropdown) and d.style.description_width == "initial"
    sel = common.control("select", "batch", options=[1, 2, 4], value=2)
    assert isinstance(sel, widgets.SelectionSlider) and sel.continuous_update is False
    with pytest.raises(ValueError, match="kind"):
        common.control("knob", "x")


def test_panel_wraps_a_plain_figure_function():
    def figure(n: int = 2, label: str = "points") -> go.Figure:
        return go.Figure(go.Scatter(x=list(range(n)), y=list(range(n)), name=label))

    ui = common.panel(figure, n=common.control("int", "n", value=3, min=1, max=9))
    assert [c.description for c in ui.children if hasattr(c, "description")] == ["n"]  # label fixed
    assert isinstance(ui.result, go.Figure) and len(ui.result.data[0].x) == 3
    ui.children[0].value = 5
    assert len(ui.result.data[0].x) == 5 and ui.result.data[0].name == "points"


def test_panel_rejects_a_callback_that_returns_no_figure():
    ui = common.panel(lambda n=1: {"n": n}, n=common.control("int", "n", value=1, min=1, max=3))
    assert ui.result is None  # ipywidgets swallows the callback's TypeError ...
    with pytest.raises(TypeError, match="plotly Figure"):
        ui.f(n=2)  # ... which the wrapped callback raises when called directly


def _calls(tree: ast.AST) -> list[str]:
    return [ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)]


@pytest.mark.parametrize("path", sorted(p for p in LESSONS.glob("*.py") if p.name != "common.py"),
                         ids=lambda p: p.name)
def test_lessons_build_panels_and_round_through_common(path):
    tree = ast.parse(path.read_text())
    calls = _calls(tree)
    assert not any(c.startswith("widgets.") and c != "widgets.interactive" for c in calls), \
        f"{path.name}: build controls with common.control, not widgets.* directly"
    assert "widgets.interactive" not in calls, f"{path.name}: build panels with common.panel"
    defs = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert "_r" not in defs, f"{path.name}: round with common.sig, not a local copy"
    # a figure that adjusts its layout still gets the course style (common.style or wide_layout)
    assert "update_layout" not in " ".join(calls) or {"style", "wide_layout"} & set(calls), path.name


# ---------------------------------------------------------------- the one figure style

def _two_traces(**layout) -> go.Figure:
    fig = go.Figure([go.Scatter(x=[1, 2], y=[1, 2], name="first"),
                     go.Scatter(x=[1, 2], y=[2, 1], name="second")])
    return fig.update_layout(**layout)


def test_reference_lines_are_drawn():
    assert common.TEMPLATE.layout.shapedefaults.line.width >= 1  # simple_white's is 0
    fig = common.reference_line(go.Figure(go.Scatter(x=[0, 1], y=[0, 1])), y=0.5, text="limit")
    (line,) = fig.layout.shapes
    assert line.line.width == 2 and fig.layout.annotations[0].text == "limit"
    common.reference_line(fig, x=0.2, text="TTFT")
    assert fig.layout.shapes[1].x0 == 0.2
    with pytest.raises(ValueError, match="exactly one"):
        common.reference_line(fig, x=1, y=1)
    bare = common.reference_line(_two_traces(), y=1)  # no text: a line and no placeholder label
    assert len(bare.layout.shapes) == 1 and not bare.layout.annotations


def test_legend_sits_between_title_and_plot():
    fig = common.style(_two_traces(), "A title", "x", "y", height=360)
    top, h = fig.layout.margin.t, fig.layout.height
    title_y = (1 - fig.layout.title.y) * h  # px from the top, both container-referenced
    legend_y = (1 - fig.layout.legend.y) * h
    assert fig.layout.title.yref == fig.layout.legend.yref == "container"
    assert title_y < legend_y < top  # title, then the legend, then the plot
    assert legend_y - title_y >= common.TITLE_SIZE  # a whole title line above the legend
    assert top - legend_y >= 20  # one legend row
    assert h - top - fig.layout.margin.b == 360 - 50 - 50  # the plot keeps its planned height


def test_long_legends_and_subplot_titles_get_room():
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("left", "right"))
    for i in range(12):
        fig.add_trace(go.Scatter(x=[1], y=[i], name=f"a rather long legend entry {i}"), 1, 1)
    one_row = common.style(_two_traces(), "t").layout.margin.t
    fig = common.style(fig, "t", width=900)
    assert common.legend_rows([t.name for t in fig.data], 900 - 80) > 1
    assert fig.layout.margin.t >= one_row + common.LEGEND_ROW + 20  # more rows + subplot titles
    assert all(a.font.size == common.SUBPLOT_TITLE_SIZE for a in fig.layout.annotations)


def test_figures_fit_the_notebook_and_titles_fit_the_figure():
    fig = common.style(_two_traces(), "word " * 60, width=1400)
    assert fig.layout.width == common.MAX_WIDTH
    lines = fig.layout.title.text.split("<br>")
    assert len(lines) > 1 and fig.layout.title.font.size >= common.SMALL
    room = common.MAX_WIDTH - 80
    assert all(common.text_width(line, fig.layout.title.font.size) <= room for line in lines)
    short = common.style(_two_traces(), "short")
    assert short.layout.title.text == "short" and short.layout.title.font.size == common.TITLE_SIZE


def test_log_axes_label_decades_or_1_2_5_steps():
    wide = _two_traces().update_traces(x=[0.1, 1e5])
    wide.update_xaxes(type="log")
    common.style(wide, "t")
    assert wide.layout.xaxis.tickvals == (0.1, 1, 10, 100, 1000, 10_000, 100_000)
    assert wide.layout.xaxis.ticktext == ("0.1", "1", "10", "100", "1k", "10k", "100k")
    assert wide.layout.xaxis.minor.dtick == "D1"  # small unlabelled ticks between decades
    narrow = _two_traces().update_traces(x=[16, 1000])
    narrow.update_xaxes(type="log")
    common.style(narrow, "t")
    assert narrow.layout.xaxis.tickvals == (20, 50, 100, 200, 500, 1000)
    assert narrow.layout.xaxis.ticktext[-1] == "1k"
    chosen = common.log_axis(_two_traces(), "xaxis", values=[128, 256, 512, 1024])
    assert chosen.layout.xaxis.ticktext == ("128", "256", "512", "1,024")
    assert chosen.layout.xaxis.type == "log"
    with pytest.raises(ValueError, match="labels"):
        common.log_axis(_two_traces(), "xaxis", values=[1, 2], labels=["one"])


def test_log_axis_finds_a_subplot_and_labels_every_tick():
    # (moved from lessons 07/08/11/12's own tick helper, now folded into common.log_axis)
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, specs=[[{}, {"secondary_y": True}]])
    fig.add_trace(go.Scatter(x=[1, 2], y=[6, 40]), 1, 1)
    fig.add_trace(go.Scatter(x=[1, 2000], y=[100, 5_000]), 1, 2)
    fig.add_trace(go.Scatter(x=[1, 2], y=[None, 0, -1, 3, 30]), 1, 2, secondary_y=True)
    common.log_axis(fig, "y", row=1, col=1)  # a short range: labelled 1-2-5 steps
    assert fig.layout.yaxis.type == "log" and fig.layout.yaxis.tickvals == (5, 10, 20, 50)
    assert fig.layout.yaxis.ticktext == ("5", "10", "20", "50")
    common.log_axis(fig, "x", row=1, col=2)  # three decades or more: every decade, "1k"
    assert fig.layout.xaxis2.type == "log" and fig.layout.xaxis2.ticktext == ("1", "10", "100",
                                                                             "1k", "10k")
    assert fig.layout.xaxis.type is None  # the other subplot's axis is left alone
    common.log_axis(fig, "y", row=1, col=2)
    assert fig.layout.yaxis2.ticktext == ("100", "200", "500", "1k", "2k", "5k")
    common.log_axis(fig, "y", row=1, col=2, secondary_y=True)  # None, 0 and < 0 are not drawn
    assert fig.layout.yaxis3.tickvals == (5, 10, 20)  # covers 3 … 30
    assert common.log_axis(go.Figure(), "y").layout.yaxis.type == "log"  # "y" is "yaxis"
    with pytest.raises(ValueError, match="axis"):
        common.log_axis(fig, "zaxis")


def test_token_label():
    assert common.token_label("\n") == "⏎" and common.token_label(" the") == "␣the"
    assert common.token_label("\\xff") == "<0xFF>" and common.token_label("\x13") == "<0x13>"
    assert common.token_label("\t") == "⇥" and common.token_label("") == "(nothing)"
    assert common.token_label("ROMEO") == "ROMEO" and common.token_label("é") == "é"


def test_precision_options_run_from_32_to_4_bits():
    opts = common.precision_options(["int4", "bf16", "fp32", "int8", "fp16"])
    assert [v for _, v in opts] == ["fp32", "bf16", "fp16", "int8", "int4"]
    assert opts[0][0] == "fp32 · 32 bit" and opts[-1][0] == "int4 · 4 bit"
    s = common.control("select", "weights", options=opts, value="int8")
    assert s.value == "int8" and s.label == "int8 · 8 bit"
    with pytest.raises(ValueError, match="precision"):
        common.precision_options(["fp64"])


def test_setup_uses_colab_renderer_only_on_colab(monkeypatch):
    import sys
    import types

    import plotly.io as pio

    from minifer_course.lessons import common

    common.setup()
    assert pio.renderers.default == "plotly_mimetype"
    calls = []
    colab = types.ModuleType("google.colab")
    colab.output = types.SimpleNamespace(enable_custom_widget_manager=lambda: calls.append(1))
    monkeypatch.setitem(sys.modules, "google", types.ModuleType("google"))
    monkeypatch.setitem(sys.modules, "google.colab", colab)
    try:
        common.setup()
        assert pio.renderers.default == "colab" and calls == [1]
    finally:
        monkeypatch.delitem(sys.modules, "google.colab")
        common.setup()
    assert pio.renderers.default == "plotly_mimetype"
