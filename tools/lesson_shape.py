"""The shape every lesson (notebooks/01_*.ipynb … 12_*.ipynb) keeps, read from the saved
notebooks (nothing is executed):

(a) the learner writes first: the first code cell with a top-level ``def`` or ``class`` comes
    before the first use of the course's lesson helpers (a name bound by importing from
    ``minifer_course.lessons``, e.g. ``from minifer_course.lessons import generation as L``);
    importing is not a use. ``minifer_course.lessons.common`` (``setup``, ``diagram``,
    ``table``, ``on_device``, ``record`` …) is the course's plumbing, not a helper that teaches;
(b) no code cell is longer than 20 lines;
(c) at least 3 stored figures carry data: outputs with a plotly figure or an image (the static
    PNG of a figure or of a slider panel); a lesson's diagram (an SVG) does not count.

    python tools/lesson_shape.py [--check] [notebooks/NN_x.ipynb ...]

prints one row per lesson; with ``--check`` it also lists the violations and exits 1 if any.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import pathlib
import re
import sys

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
HELPERS = "minifer_course.lessons"
PLUMBING = {"common"}  # modules of HELPERS that do not count as helpers (see the docstring)
MAX_LINES = 20
MIN_FIGURES = 3
FIGURE_TYPES = ("application/vnd.plotly.v1+json", "image/png", "image/jpeg")
MAGIC = re.compile(r"^(\s*)[%!]")


def lessons(folder: pathlib.Path = NOTEBOOKS) -> list[pathlib.Path]:
    """The numbered lessons 01 … 12 (not 00, 13, 14, nor the solutions)."""
    return sorted(p for p in folder.glob("[0-9][0-9]_*.ipynb") if 1 <= int(p.name[:2]) <= 12)


@dataclasses.dataclass
class Shape:
    name: str
    first_learner: int | None  # cell index (all cells, markdown included) of the first def/class
    first_helper: int | None  # cell index of the first use of a lesson helper
    helper_use: str  # the name first used there, e.g. "L.next_token_figure"
    longest: int  # lines of the longest code cell
    longest_at: int  # its cell index
    figures: int
    long_cells: list[tuple[int, int]]  # (cell index, lines) of each cell over MAX_LINES

    def violations(self) -> list[str]:
        bad = []
        if self.first_learner is None:
            bad.append("(a) no cell defines a function or class")
        elif self.first_helper is not None and self.first_helper < self.first_learner:
            bad.append(f"(a) helper {self.helper_use} used in cell {self.first_helper}, before the "
                       f"first learner code in cell {self.first_learner}")
        bad += [f"(b) cell {i} has {n} lines (> {MAX_LINES})" for i, n in self.long_cells]
        if self.figures < MIN_FIGURES:
            bad.append(f"(c) {self.figures} data figures (< {MIN_FIGURES})")
        return bad


def parse(source: str) -> ast.Module:
    """A code cell as Python: IPython's `%magic` and `!shell` lines become `pass`."""
    return ast.parse("\n".join(MAGIC.sub(r"\1pass  # ", line) for line in source.splitlines()))


def helper_names(tree: ast.AST) -> set[str]:
    """Names an import in `tree` binds to a lesson helper (module or object)."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == HELPERS:  # from minifer_course.lessons import generation as L
                bound |= {a.asname or a.name for a in node.names if a.name not in PLUMBING}
            elif node.module.startswith(HELPERS + "."):  # from ….lessons.generation import x
                if node.module[len(HELPERS) + 1:].split(".")[0] not in PLUMBING:
                    bound |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            for a in node.names:
                sub = a.name[len(HELPERS) + 1:].split(".")[0] if a.name.startswith(HELPERS + ".") else None
                if sub and sub not in PLUMBING and a.asname:
                    bound.add(a.asname)
    return bound


def first_use(tree: ast.AST, names: set[str]) -> str | None:
    """The first (in source order) use of one of `names` in `tree`, as it reads: "L.panel"."""
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in names:
            uses.append((node.lineno, node.col_offset, 0, f"{node.value.id}.{node.attr}"))
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in names:
            uses.append((node.lineno, node.col_offset, 1, node.id))
    return min(uses)[-1] if uses else None


def shape(path: pathlib.Path) -> Shape:
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    helpers: set[str] = set()
    first_learner = first_helper = None
    helper_use, long_cells, figures = "", [], 0
    longest, longest_at = 0, -1
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        lines = len(source.splitlines())
        if lines > longest:
            longest, longest_at = lines, i
        if lines > MAX_LINES:
            long_cells.append((i, lines))
        tree = parse(source)
        if first_learner is None and any(
                isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) for n in tree.body):
            first_learner = i
        helpers |= helper_names(tree)
        if first_helper is None:
            use = first_use(tree, helpers)
            if use:
                first_helper, helper_use = i, use
        figures += sum(any(t in out.get("data", {}) for t in FIGURE_TYPES) for out in cell.get("outputs", []))
    return Shape(path.name, first_learner, first_helper, helper_use, longest, longest_at, figures,
                 long_cells)


def table(shapes: list[Shape]) -> str:
    rows = [("lesson", "first learner cell", "first helper use", "longest cell (lines @ cell)",
             "figures")]
    for s in shapes:
        helper = f"{s.first_helper} ({s.helper_use})" if s.first_helper is not None else "-"
        rows.append((s.name, str(s.first_learner if s.first_learner is not None else "-"), helper,
                     f"{s.longest} @ {s.longest_at}", str(s.figures)))
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("notebooks", nargs="*", type=pathlib.Path, help="default: every lesson 01 … 12")
    ap.add_argument("--check", action="store_true", help="list the violations; exit 1 if any")
    args = ap.parse_args(argv)
    shapes = [shape(p) for p in (args.notebooks or lessons())]
    print(table(shapes))
    bad = [f"{s.name}: {v}" for s in shapes for v in s.violations()]
    if bad:
        print(f"\n{len(bad)} violation(s):\n" + "\n".join(bad))
    return 1 if args.check and bad else 0


if __name__ == "__main__":
    sys.exit(main())
