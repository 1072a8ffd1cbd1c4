"""The lessons' diagrams: drawn by tools/draw_diagrams.py, committed as SVG, shown by each lesson."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import xml.etree.ElementTree as ET

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
DIAGRAMS = NOTEBOOKS / "diagrams"
SVG = "{http://www.w3.org/2000/svg}"


def _draw_module():
    spec = importlib.util.spec_from_file_location("draw_diagrams", ROOT / "tools" / "draw_diagrams.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_diagrams_are_what_the_script_draws(tmp_path: pathlib.Path) -> None:
    draw = _draw_module()
    written = draw.draw_all(tmp_path)
    assert sorted(p.name for p in written) == sorted(p.name for p in DIAGRAMS.glob("*.svg")), \
        "notebooks/diagrams/ and tools/draw_diagrams.py disagree: run python tools/draw_diagrams.py"
    for path in written:
        assert path.read_text() == (DIAGRAMS / path.name).read_text(), \
            f"{path.name} is stale: run python tools/draw_diagrams.py"


@pytest.mark.parametrize("path", sorted(DIAGRAMS.glob("*.svg")), ids=lambda p: p.name)
def test_diagram_is_valid_svg_with_a_title(path: pathlib.Path) -> None:
    root = ET.parse(path).getroot()
    assert root.tag == f"{SVG}svg"
    title = root.find(f"{SVG}title")
    assert title is not None and len(title.text.strip()) > 20  # read by screen readers
    assert len(root.findall(f".//{SVG}text")) >= 5


LESSONS = sorted(p for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb") if not p.name.startswith("00_"))


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_every_lesson_shows_its_diagram(lesson: pathlib.Path) -> None:
    number = lesson.name[:2]
    expected = [p.name for p in DIAGRAMS.glob(f"{number}_*.svg")]
    assert expected, f"no diagram for lesson {number} in notebooks/diagrams/"
    cells = json.loads(lesson.read_text())["cells"]
    markdown = "".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    for name in expected:
        assert f"](diagrams/{name})" in markdown, f"{lesson.name} does not show diagrams/{name}"


def test_the_diagrams_numbers_are_computed_by_minifer() -> None:
    """The int8 row is `quantize_int8`'s (0.12 / (0.50 / 127) = 30.48 rounds to 30, w' = 0.118)
    and the top-p inset keeps what `apply_top_p` keeps; the committed SVGs show those numbers."""
    draw = _draw_module()
    w, q, back, scale = draw.int8_row(draw.INT8_ROW)
    assert q == [30, -127, 8, 64] and abs(scale - 0.5 / 127) < 1e-9
    quant = (DIAGRAMS / "09_quantization.svg").read_text()
    for v in q:
        assert f">{v}<" in quant
    assert ">0.118<" in quant and ">0.122<" not in quant
    kept = draw.top_p_kept(draw.TOP_P_HEIGHTS, draw.TOP_P)
    probs = sorted((h / sum(draw.TOP_P_HEIGHTS) for h in draw.TOP_P_HEIGHTS), reverse=True)
    assert sum(probs[:kept]) >= draw.TOP_P > sum(probs[:kept - 1])  # the smallest such set: 5
    assert f"{kept} kept" in (DIAGRAMS / "06_sampling.svg").read_text()
