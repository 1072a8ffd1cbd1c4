"""The lessons' diagrams: drawn by tools/draw_diagrams.py, committed as SVG package data, shown by
each lesson from a code cell whose stored output is the picture (so it shows without a kernel and
on Colab), with every text fitting its box in the widest common fallback font."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import xml.etree.ElementTree as ET

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
DIAGRAMS = ROOT / "course" / "minifer_course" / "lessons" / "diagrams"
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
        "course/minifer_course/lessons/diagrams/ and tools/draw_diagrams.py disagree: run python tools/draw_diagrams.py"
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


def test_every_text_fits_its_box_in_dejavu_sans() -> None:
    draw = _draw_module()
    for name, make in draw.DIAGRAMS.items():
        assert make().overflowing() == [], name
    wide = draw.Canvas(100, 50, "a canvas to test the check")
    wide.box(10, 10, 40, 20, "far too long a label")
    assert len(wide.overflowing()) == 1
    # DejaVu Sans sets "m" wider than "i": 974 and 278 thousandths of an em
    assert draw.text_width("m", 10) == 9.74 and draw.text_width("i", 10) == 2.78


def test_no_claim_ids_inside_the_pictures() -> None:
    for path in DIAGRAMS.glob("*.svg"):
        texts = [t.text or "" for t in ET.parse(path).getroot().iter(f"{SVG}text")]
        assert not [t for t in texts if re.search(r"\b[A-Z]{2,5}-\d+\b", t)], path.name


def _shown(lesson: pathlib.Path) -> dict[str, str]:
    """name -> the stored SVG of each `diagram("name")` code cell of the lesson."""
    shown = {}
    for c in json.loads(lesson.read_text())["cells"]:
        m = re.search(r'diagram\("([0-9a-z_]+)"\)', "".join(c["source"]))
        if c["cell_type"] == "code" and m:
            outputs = [o["data"]["image/svg+xml"] for o in c.get("outputs", [])
                       if "image/svg+xml" in o.get("data", {})]
            shown[m.group(1)] = "".join(outputs[0]) if outputs else ""
    return shown


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_every_lesson_shows_its_diagram_from_a_code_cell(lesson: pathlib.Path) -> None:
    number = lesson.name[:2]
    expected = sorted(p.stem for p in DIAGRAMS.glob(f"{number}_*.svg"))
    assert expected, f"no diagram for lesson {number} in course/minifer_course/lessons/diagrams/"
    shown = _shown(lesson)
    text = lesson.read_text()
    assert "](diagrams/" not in text, f"{lesson.name} links an image by a relative path"
    for name in expected:
        assert name in shown, f'{lesson.name} does not show diagram("{name}")'
        # the stored output is the picture itself, as the package draws it today
        assert shown[name], f'{lesson.name}: diagram("{name}") has no stored SVG output'
        assert ET.canonicalize(shown[name]) == ET.canonicalize((DIAGRAMS / f"{name}.svg")
                                                               .read_text()), name


def test_diagram_refuses_an_unknown_name() -> None:
    from minifer_course.lessons.common import diagram

    assert "<svg" in diagram("01_generation_loop").data
    with pytest.raises(ValueError, match="01_generation_loop"):
        diagram("01_generation")


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
