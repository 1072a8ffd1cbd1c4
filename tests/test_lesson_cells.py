"""What a learner reads is the lesson: nbval's markers (ignore a timing cell's output, skip a cell)
are cell tags (``nbval-ignore-output``, ``nbval-skip``), which nbval reads as it reads the
``# NBVAL_...`` comments and JupyterLab keeps out of the code."""

import pathlib
import re

import nbformat
import pytest

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
ALL = sorted(NOTEBOOKS.glob("[0-9]*.ipynb")) + sorted((NOTEBOOKS / "solutions").glob("*.ipynb"))
MARKER = re.compile(r"^\s*#\s*NBVAL_[A-Z_]+\s*$", re.M)


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.stem)
def test_nbval_markers_are_tags_not_code(path: pathlib.Path) -> None:
    cells = nbformat.read(path, as_version=4).cells
    marked = [i for i, c in enumerate(cells) if c.cell_type == "code" and MARKER.search(c.source)]
    assert not marked, f"{path.name}: cells {marked} carry an nbval comment; use a cell tag"
