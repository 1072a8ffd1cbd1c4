"""Every lesson has a solutions notebook that answers each of its exercises, and links to it.

The convention, checked both ways:
- a lesson (``notebooks/NN_name.ipynb``) lists its exercises in a markdown cell under a heading
  ``## Exercises``, one numbered item each (``1. …``, ``2. …``) up to the next heading;
- its solutions notebook is ``notebooks/solutions/NN_name_solutions.ipynb`` and answers exercise
  *n* under a markdown heading ``## Exercise n``, once for each of 1 … the lesson's count;
- the lesson's exercises cell links to the solutions notebook, which links back to the lesson.
The notebooks' cells are run, and their answers asserted, by ``pytest --nbval``.
"""

import pathlib
import re

import nbformat
import pytest

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
SOLUTIONS = NOTEBOOKS / "solutions"
LESSONS = sorted(NOTEBOOKS.glob("[0-9]*.ipynb"))

EXERCISES_HEADING = re.compile(r"^#{1,6}\s+Exercises\s*$", re.M)
HEADING = re.compile(r"^#{1,6}\s", re.M)
ITEM = re.compile(r"^(\d+)\.\s", re.M)
SOLUTION_HEADING = re.compile(r"^##\s+Exercise\s+(\d+)\b", re.M)


def markdown(path: pathlib.Path) -> list[str]:
    return [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "markdown"]


def solutions_path(lesson: pathlib.Path) -> pathlib.Path:
    return SOLUTIONS / f"{lesson.stem}_solutions.ipynb"


def exercises_section(lesson: pathlib.Path) -> str:
    """The text from the lesson's "Exercises" heading to the next heading (or the cell's end)."""
    for source in markdown(lesson):
        m = EXERCISES_HEADING.search(source)
        if m:
            rest = source[m.end():]
            nxt = HEADING.search(rest)
            return rest[: nxt.start()] if nxt else rest
    raise AssertionError(f"{lesson.name}: no '## Exercises' heading in a markdown cell")


def exercise_numbers(lesson: pathlib.Path) -> list[int]:
    return [int(n) for n in ITEM.findall(exercises_section(lesson))]


def answered_numbers(solutions: pathlib.Path) -> list[int]:
    return [int(n) for source in markdown(solutions) for n in SOLUTION_HEADING.findall(source)]


def test_the_lessons_are_found():
    assert len(LESSONS) >= 12, [p.name for p in LESSONS]


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_lesson_lists_two_or_three_numbered_exercises(lesson):
    numbers = exercise_numbers(lesson)
    assert numbers == list(range(1, len(numbers) + 1)) and 2 <= len(numbers) <= 3, numbers


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_every_exercise_has_exactly_one_solution(lesson):
    solutions = solutions_path(lesson)
    assert solutions.exists(), f"{lesson.name} has no solutions notebook {solutions.name}"
    assert sorted(answered_numbers(solutions)) == exercise_numbers(lesson), \
        f"{solutions.name} answers {answered_numbers(solutions)}, {lesson.name} lists {exercise_numbers(lesson)}"


def test_every_solutions_notebook_belongs_to_a_lesson():
    expected = {solutions_path(p).name for p in LESSONS}
    found = {p.name for p in SOLUTIONS.glob("*.ipynb")}
    assert found <= expected, f"solutions without a lesson: {sorted(found - expected)}"


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_lesson_and_solutions_link_each_other(lesson):
    target = f"(solutions/{solutions_path(lesson).name})"
    assert target in exercises_section(lesson), f"{lesson.name}'s exercises do not link {target}"
    back = f"(../{lesson.name})"
    assert any(back in source for source in markdown(solutions_path(lesson))), \
        f"{solutions_path(lesson).name} does not link back to {lesson.name}"


def test_solution_headings_sit_in_markdown_not_code():
    """A heading inside a code cell (a comment) would not be counted: keep the convention visible."""
    for path in SOLUTIONS.glob("*.ipynb"):
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type == "code":
                assert not SOLUTION_HEADING.search(cell.source), f"{path.name}: heading in a code cell"


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_lesson_ends_with_what_you_saw_then_exercises(lesson):
    """The summary and the exercises close the lesson: its last cell is markdown with a
    "What you saw" heading followed by "Exercises", and no earlier cell has either (a section
    added after them, or a lost heading, would leave the summary stranded mid-lesson)."""
    cells = nbformat.read(lesson, as_version=4).cells
    saw = re.compile(r"^#{1,6}\s+What you saw\s*$", re.M)
    last = cells[-1]
    assert last.cell_type == "markdown", f"{lesson.name}: the last cell is {last.cell_type}"
    s, e = saw.search(last.source), EXERCISES_HEADING.search(last.source)
    assert s and e and s.start() < e.start(), \
        f"{lesson.name}: the last cell needs '## What you saw' then '## Exercises'"
    later = HEADING.search(last.source, s.end())
    assert later and later.start() == e.start(), \
        f"{lesson.name}: another heading sits between the summary and the exercises"
    for i, c in enumerate(cells[:-1]):
        assert not (saw.search(c.source) or EXERCISES_HEADING.search(c.source)), \
            f"{lesson.name}: cell {i} has the summary or exercises heading before the end"
