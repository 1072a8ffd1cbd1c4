"""BENCHMARKS.md is a page a user reads: short, its links and the sections other files cite
resolve, and the raw results it names are in benchmarks/ as JSON."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "BENCHMARKS.md"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_page_is_short():
    assert len(PAGE.read_text().splitlines()) <= 400


def test_its_anchors_resolve():
    text = PAGE.read_text()
    anchors = {_slug(h) for h in re.findall(r"^#{1,4} (.+)$", text, re.M)}
    links = re.findall(r"\]\(#([^)]+)\)", text)
    assert links and set(links) <= anchors, set(links) - anchors


def test_sections_cited_elsewhere_exist():
    headings = re.findall(r"^#{2,4} (.+)$", PAGE.read_text(), re.M)
    cited = set()
    for path in [ROOT / "README.md", *ROOT.glob("minifer/**/*.py"), *ROOT.glob("notebooks/*.ipynb")]:
        text = path.read_text().replace('\\"', '"').replace("\\n", " ")
        for name in re.findall(r'BENCHMARKS\.md, "([^"]+)"', text):
            cited.add((path.name, " ".join(name.split())))
    assert cited  # README and the package cite sections by name
    for where, name in cited:
        assert any(h.startswith(name) for h in headings), (where, name)


def test_the_raw_results_it_names_are_there():
    text = PAGE.read_text()
    named = {n for n in re.findall(r"`(benchmarks/[^`]+\.json)`", text) if "<" not in n}
    assert named  # (a name with <placeholders> is where a future run goes)
    for pattern in named:
        files = list(ROOT.glob(pattern))
        assert files, pattern
        for f in files:
            data = json.loads(f.read_text())
            assert "records" in data or "machine" in data, f
