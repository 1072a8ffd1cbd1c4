"""The pure parts of tools/browser_test.py: which texts count as drawn over each other or cut off.

(The browser run itself is `make browser-test`; these need neither a browser nor playwright.)
"""

import pytest
from tool_modules import load_tool

bt = load_tool("browser_test")
Box = bt.Box


def test_overlap_is_the_intersection_or_nothing():
    a = Box("title", "t", 0, 0, 100, 20)
    assert bt.overlap(a, Box("legend", "l", 90, 15, 200, 40)) == (10, 5)
    assert bt.overlap(a, Box("legend", "l", 100, 0, 200, 20)) == (0, 0)  # edges touch
    assert bt.overlap(a, Box("legend", "l", 0, 30, 100, 50)) == (0, 0)  # below


def test_a_legend_over_the_title_is_caught_and_one_beside_it_passes():
    title = Box("title", "n=3: a long title", 40, 80, 560, 100)
    over = Box("legend", "a, b", 70, 85, 520, 105)
    below = Box("legend", "a, b", 70, 380, 520, 400)
    assert bt.overlapping([title, over]) == [(title, over)]
    assert bt.overlapping([title, below]) == []


def test_overlaps_within_the_tolerance_pass():
    title = Box("title", "t", 0, 0, 100, 20)
    near = Box("legend", "l", 50, 19, 150, 40)  # one pixel of overlap down
    assert bt.overlapping([title, near], tol=1.0) == []
    assert bt.overlapping([title, near], tol=0.0) == [(title, near)]
    with pytest.raises(ValueError, match="tol"):
        bt.overlapping([title, near], tol=-1)


def test_only_the_checked_kinds_are_compared():
    title = Box("title", "t", 0, 0, 100, 20)
    # two lines of an axis, or a title over a kind that is not checked: not reported
    assert bt.overlapping([title, Box("axis", "x", 0, 0, 100, 20)]) == []
    assert bt.overlapping([title, Box("title", "t2", 0, 0, 100, 20)]) == []
    a1, a2 = Box("annotation", "bf16", 0, 0, 30, 10), Box("annotation", "fp16", 5, 2, 35, 12)
    assert bt.overlapping([a1, a2]) == [(a1, a2)]
    lab1, lab2 = Box("label", "x", 0, 0, 30, 10), Box("label", "y", 5, 2, 35, 12)
    assert bt.overlapping([title, lab1, lab2]) == [(title, lab1), (title, lab2), (lab1, lab2)]


def test_lines_of_one_text_are_not_compared_with_each_other():
    line1 = Box("annotation", "two\nlines", 0, 0, 50, 10, group=3)
    line2 = Box("annotation", "two\nlines", 0, 9, 50, 20, group=3)
    other = Box("annotation", "another", 10, 15, 60, 25, group=4)
    assert bt.overlapping([line1, line2, other]) == [(line2, other)]


def test_cut_off_finds_text_beyond_the_figure():
    frame = (0, 0, 720, 360)
    inside = Box("legend", "l", 600, 10, 719, 30)
    right = Box("legend", "tok/s per us", 600, 10, 760, 30)
    label = Box("label", "x", 700, 10, 760, 30)  # trace labels are clipped by plotly itself
    assert bt.cut_off([inside, right, label], frame) == [right]
    assert bt.cut_off([Box("title", "t", -2, 0, 100, 20)], frame, tol=2) == []
    area = (60, 50, 700, 310)  # a label the plot area cuts off (cliponaxis), and one inside it
    top = Box("label", "int4", 80, 40, 100, 52, clip=area)
    assert bt.cut_off([top, Box("label", "int8", 80, 60, 100, 72, clip=area)], frame) == [top]


def test_stderr_is_an_error_only_with_a_traceback_or_an_exception():
    assert bt.classify_stderr("Traceback (most recent call last):\n ...") == "error"
    assert bt.classify_stderr("Cell In[3], line 1\n    1/\n SyntaxError: invalid syntax") == "error"
    assert bt.classify_stderr("ZeroDivisionError: division by zero") == "error"
    assert bt.classify_stderr("UserWarning: TypedStorage is deprecated") == "warning"
    assert bt.classify_stderr("100%|██████| 10/10") == "warning"


def test_table_aligns_columns():
    out = bt.table([["00_a.ipynb", "1.5"], ["b", "10.25"]], ["notebook", "run s"])
    lines = out.splitlines()
    assert lines[0] == "notebook    run s"
    assert lines[2] == "00_a.ipynb    1.5"
    assert lines[3] == "b           10.25"
