"""The README, the course's front page, tells the truth.

- Its API tour runs: every ```python block right after a ``<!-- tour -->`` line is run, in order,
  in one fresh Python process (the blocks keep small ``max_new_tokens``).
- Its Binder and Colab links are made from pyproject.toml's repository URL
  (`tools/course_links.py --check`), and every lesson has a Colab link.
- Its course map lists, for each lesson, the claims that lesson cites.
- The Colab install cell (`tools/colab_cell.py`) is inserted once, before the first code cell,
  and outside Colab runs without output.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tool_modules import load_module, load_tool

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TOUR_RE = re.compile(r"^<!-- tour -->\n```python\n(.*?)^```", re.M | re.S)


course_links = load_tool("course_links")
colab_cell = load_tool("colab_cell")
claims = load_module(ROOT / "tests" / "test_claims.py", "_claims_checker")


def tour_blocks(text: str) -> list[str]:
    return TOUR_RE.findall(text)


def test_tour_runs():
    blocks = tour_blocks(README.read_text(encoding="utf-8"))
    assert len(blocks) >= 3, f"the README's tour has {len(blocks)} tested blocks"
    for block in blocks:
        for n in map(int, re.findall(r"max_new_tokens=(\d+)", block)):
            assert n <= 32, "keep the tour quick: max_new_tokens ≤ 32"
    code = "import torch\ntorch.set_num_threads(1)\n" + "\n".join(blocks)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "target passes" in run.stdout and "memory-bound" in run.stdout, run.stdout


def test_tour_extraction_needs_the_marker():
    text = "<!-- tour -->\n```python\nprint(1)\n```\n\n```python\nprint(2)\n```\n"
    assert tour_blocks(text) == ["print(1)\n"]


def test_course_links_up_to_date():
    problems = course_links.problems(README.read_text(encoding="utf-8"))
    assert not problems, "\n".join(problems)


def test_course_links_check_can_fail(tmp_path):
    readme = README.read_text(encoding="utf-8")
    url = course_links.repo_url()
    moved = readme.replace(f"github/{course_links.slug(url)}/", "github/someone/else/", 1)
    assert moved != readme
    assert any("not made from" in p for p in course_links.problems(moved))
    assert course_links.rewrite(moved, url) == readme  # and the rewrite repairs it
    lesson = "notebooks/03_kv_cache.ipynb"
    dropped = readme.replace(course_links.colab_url(url, lesson), "https://example.org")
    assert f"README.md has no Colab link for {lesson}" in course_links.problems(dropped)
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    text = re.sub(r'^Repository = ".*"$', 'Repository = "http://example.org/x"', text, flags=re.M)
    (tmp_path / "pyproject.toml").write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match="Repository must be"):
        course_links.repo_url(tmp_path)


def _map_rows(text: str) -> dict[str, str]:
    """{notebook file name: claims cell} of the README's course map."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"\| \[\d\d · [^\]]+\]\(notebooks/(\d\d_[\w-]+\.ipynb)\)", line)
        if m:
            rows[m.group(1)] = line.strip().strip("|").split("|")[2]
    return rows


def test_course_map_lists_each_lessons_claims():
    rows = _map_rows(README.read_text(encoding="utf-8"))
    cited, _ = claims.notebook_citations(claims.lesson_paths())
    assert set(rows) == {p.name for p in claims.lesson_paths()}, "one course-map row per lesson"
    for name, cell in rows.items():
        listed = claims.expand_ranges(cell)
        assert listed == cited.get(name, set()), (
            f"{name}: the README lists {sorted(listed)}, the notebook cites "
            f"{sorted(cited.get(name, set()))}")


# --- the Colab install cell --------------------------------------------------------------------


def test_colab_cell_inserted_once(tmp_path):
    import nbformat

    copy = tmp_path / "00_quickstart.ipynb"
    shutil.copy(ROOT / "notebooks" / "00_quickstart.ipynb", copy)
    nb = nbformat.read(copy, as_version=4)
    nb.cells = [c for c in nb.cells if colab_cell.TAG not in c.metadata.get("tags", [])]
    first_code = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
    url = course_links.repo_url()
    assert colab_cell.ensure_cell(nb, url)
    cell = nb.cells[first_code]
    assert colab_cell.TAG in cell.metadata["tags"] and f"git+{url}" in cell.source
    assert all(c.cell_type == "markdown" for c in nb.cells[:first_code])  # title stays on top
    nbformat.validate(nb)
    nbformat.write(nb, copy)
    again = nbformat.read(copy, as_version=4)
    assert not colab_cell.ensure_cell(again, url)  # idempotent
    assert colab_cell.ensure_cell(again, "https://github.com/other/fork")  # refreshed, not added
    assert sum(colab_cell._is_colab_cell(c) for c in again.cells) == 1
    assert colab_cell.main(["--check", str(copy)]) == 0


def test_colab_cell_is_silent_outside_colab(tmp_path):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(colab_cell.cell_source(course_links.repo_url()))]
    NotebookClient(nb, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    assert nb.cells[0].outputs == []


def test_colab_cell_installs_on_colab(monkeypatch):
    from IPython.core.inputtransformer2 import TransformerManager

    url = course_links.repo_url()
    code = TransformerManager().transform_cell(colab_cell.cell_source(url))
    calls = []

    class Shell:
        def run_line_magic(self, name, line):
            calls.append((name, line))

    monkeypatch.setitem(sys.modules, "google.colab", type(sys)("google.colab"))
    exec(code, {"get_ipython": Shell})
    assert calls == [("pip", f'install --quiet "minifer[{colab_cell.EXTRA}] @ git+{url}" '
                             f'"minifer-course @ git+{url}#subdirectory=course"')]
    # the course package the cell installs is the one in this repository, under that name
    course = (pathlib.Path(__file__).resolve().parents[1] / "course" / "pyproject.toml").read_text()
    assert 'name = "minifer-course"' in course
    extras = json.dumps(_extras())
    assert f'"{colab_cell.EXTRA}"' in extras, "pyproject.toml has no such extra"


def _extras() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        pytest.skip("tomllib needs Python 3.11")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
