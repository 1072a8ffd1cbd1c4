"""The lessons' shared helpers: one rounding helper, one control helper, one panel contract."""

from __future__ import annotations

import ast
import pathlib

import ipywidgets as widgets
import plotly.graph_objects as go
import pytest

from minifer.lessons import common

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
    assert "update_layout" not in " ".join(calls) or "style" in calls, path.name
