"""Fail if a notebook has code cells that were never executed: nbval silently skips the
output comparison for such cells (execution_count is None), so an unexecuted notebook passes."""
import sys

import nbformat

bad = []
for path in sys.argv[1:]:
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        if cell.execution_count is None and "NBVAL_SKIP" not in cell.source:
            bad.append(f"{path}: code cell {i} has no stored execution")
print("\n".join(bad) or "all code cells executed")
sys.exit(1 if bad else 0)
