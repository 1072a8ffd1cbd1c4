"""Give each lesson notebook a first code cell that installs minifer on Google Colab only.

Colab opens a notebook straight from GitHub, without this package. The inserted cell installs it
(with the lessons' Colab extra) and the course's helpers (`course/`, minifer-course) from the repository named in pyproject.toml's
``[project.urls] Repository``; anywhere else it does nothing and prints nothing, so a local
kernel, Binder and the tests run it as a no-op.

The cell goes before the notebook's first code cell (after the title and objectives) and is
tagged ``colab-install``; running the script again replaces that cell instead of adding another,
so it is idempotent and picks up a changed URL. A new cell has no stored execution: re-execute
the notebooks afterwards (``make notebooks``).

Usage:
    python tools/colab_cell.py notebooks/[0-9]*.ipynb
    python tools/colab_cell.py --check notebooks/[0-9]*.ipynb   # exit 1 if a cell is missing or stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parent))
from course_links import repo_url  # noqa: E402

TAG = "colab-install"
EXTRA = "colab"


def cell_source(url: str) -> str:
    return ("# On Google Colab, install minifer first (about a minute); elsewhere this does nothing.\n"
            "import sys\n"
            "\n"
            'if "google.colab" in sys.modules:\n'
            f'    %pip install --quiet "minifer[{EXTRA}] @ git+{url}" '
            f'"minifer-course @ git+{url}#subdirectory=course"\n')


def _is_colab_cell(cell) -> bool:
    return cell.cell_type == "code" and TAG in cell.get("metadata", {}).get("tags", [])


def ensure_cell(nb, url: str) -> bool:
    """Insert or refresh the Colab cell in `nb`; True if `nb` changed."""
    source = cell_source(url)
    existing = [i for i, c in enumerate(nb.cells) if _is_colab_cell(c)]
    for i in existing[1:][::-1]:  # never more than one
        del nb.cells[i]
    if existing:
        cell = nb.cells[existing[0]]
        if cell.source == source and len(existing) == 1:
            return False
        cell.source = source
        cell.outputs, cell.execution_count = [], None
        return True
    cell = nbformat.v4.new_code_cell(source, metadata={"tags": [TAG]})
    cell.pop("id", None)  # let nbformat assign ids only where the notebook uses them
    if nb.nbformat_minor >= 5:
        cell.id = "colab-install"
    first_code = next((i for i, c in enumerate(nb.cells) if c.cell_type == "code"), len(nb.cells))
    nb.cells.insert(first_code, cell)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--check", action="store_true", help="report, change nothing")
    args = parser.parse_args(argv)
    url = repo_url()
    stale = []
    for path in args.notebooks:
        nb = nbformat.read(path, as_version=4)
        if ensure_cell(nb, url):
            stale.append(path)
            if not args.check:
                nbformat.write(nb, path)
                print(f"{path}: Colab install cell written")
    if args.check:
        print("\n".join(f"{p}: Colab install cell missing or stale" for p in stale)
              or "every notebook has its Colab install cell")
        return 1 if stale else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
