"""Fail if a notebook is not saved as `make notebooks` saves it:

- a code cell that was never executed: nbval silently skips the output comparison for such
  cells (execution_count is None), so an unexecuted notebook passes;
- a plotly figure or a slider panel without its static PNG: GitHub and nbviewer would show
  nothing there (see tools/static_figures.py).

Needs neither a kernel, nor kaleido, nor a browser.
"""

import pathlib
import sys

import nbformat

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import static_figures  # noqa: E402  (a sibling module, not a package)


def problems(path: str) -> list[str]:
    nb = nbformat.read(path, as_version=4)
    bad = []
    for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        skipped = "NBVAL_SKIP" in cell.source or "nbval-skip" in cell.metadata.get("tags", [])
        if cell.execution_count is None and not skipped:
            bad.append(f"{path}: code cell {i} has no stored execution")
    for i, what in static_figures.missing(nb):
        if what == static_figures.NO_ALT:
            bad.append(f"{path}: code cell {i}: a static PNG has no alt text (re-run it with "
                       f"tools/run_notebooks.py)")
        else:
            bad.append(f"{path}: code cell {i}: {what} has no static PNG for readers without a kernel")
    return bad


if __name__ == "__main__":
    bad = [line for path in sys.argv[1:] for line in problems(path)]
    if bad:
        print("\n".join(bad))
        print("\nre-execute these notebooks with `make notebooks` (or, for one notebook, "
              "`cd notebooks && ../.venv/bin/python ../tools/run_notebooks.py NN_x.ipynb`)")
    else:
        print("all code cells executed, every figure has its static view")
    sys.exit(1 if bad else 0)
