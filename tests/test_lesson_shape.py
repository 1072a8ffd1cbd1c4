"""Issue 55's shape of a lesson (tools/lesson_shape.py), checked on the saved notebooks 01 … 12:
the learner's own code comes before the first lesson helper is used, no code cell is over 20
lines, and at least 3 stored figures carry data.

Every lesson passes today, so PENDING is empty and any violation fails. (A lesson being rebuilt
may be listed there with its violations, word for word: the test then lists them (xfail)
instead of failing, fails on any other violation, and fails once a pending one is fixed, so
that PENDING only shrinks.)"""

from __future__ import annotations

import nbformat
import pytest
from tool_modules import load_tool

ls = load_tool("lesson_shape")
LESSONS = ls.lessons()

PENDING: dict[str, list[str]] = {}  # every lesson passes (tools/lesson_shape.py --check)


def test_the_lessons_are_01_to_12():
    assert [p.name[:2] for p in LESSONS] == [f"{n:02d}" for n in range(1, 13)]
    assert set(PENDING) <= {p.name for p in LESSONS}


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_lesson_shape(lesson):
    found = ls.shape(lesson).violations()
    pending = PENDING.get(lesson.name, [])
    new = [v for v in found if v not in pending]
    assert not new, f"{lesson.name}: " + "; ".join(new)
    fixed = [v for v in pending if v not in found]
    assert not fixed, f"{lesson.name}: fixed, remove from PENDING: " + "; ".join(fixed)
    if pending:
        pytest.xfail(f"{lesson.name}, pending: " + "; ".join(pending))


def _notebook(tmp_path, cells):
    nb = nbformat.v4.new_notebook()
    nb.cells = cells
    path = tmp_path / "01_x.ipynb"
    nbformat.write(nb, path)
    return path


def _figure_output():
    return nbformat.v4.new_output("display_data", data={
        "application/vnd.plotly.v1+json": {"data": []}, "image/png": "eA=="})


def test_the_rules_on_a_small_notebook(tmp_path):
    diagram = nbformat.v4.new_code_cell('diagram("01_x")', outputs=[nbformat.v4.new_output(
        "execute_result", data={"image/svg+xml": "<svg/>", "text/plain": "x"}, execution_count=1)])
    cells = [
        nbformat.v4.new_markdown_cell("# a lesson"),
        nbformat.v4.new_code_cell("%pip install x\nfrom minifer_course.lessons import generation as L\n"
                                  "from minifer_course.lessons.common import diagram, table"),
        diagram,
        nbformat.v4.new_code_cell("print(table([]))"),  # plumbing: not a helper
        nbformat.v4.new_code_cell("x = L.top_tokens(1)", outputs=[_figure_output()]),
        nbformat.v4.new_code_cell("def mine():\n    return 1\n" + "y = 1\n" * 20),
    ]
    s = ls.shape(_notebook(tmp_path, cells))
    assert (s.first_learner, s.first_helper, s.helper_use) == (5, 4, "L.top_tokens")
    assert (s.longest, s.longest_at, s.figures) == (22, 5, 1)
    assert s.violations() == [
        "(a) helper L.top_tokens used in cell 4, before the first learner code in cell 5",
        "(b) cell 5 has 22 lines (> 20)", "(c) 1 data figures (< 3)"]
    assert ls.main(["--check", str(tmp_path / "01_x.ipynb")]) == 1
    cells[4], cells[5] = nbformat.v4.new_code_cell("def mine():\n    return 1"), cells[4]
    cells += [nbformat.v4.new_code_cell("from minifer_course.lessons.kv_cache import f\nf()",
                                        outputs=[_figure_output(), _figure_output()])]
    s = ls.shape(_notebook(tmp_path, cells))
    assert (s.first_learner, s.first_helper, s.longest, s.figures) == (4, 5, 3, 3)
    assert s.violations() == [] and ls.main(["--check", str(tmp_path / "01_x.ipynb")]) == 0
