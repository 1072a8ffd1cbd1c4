"""The course's claims file and its lessons agree.

`notebooks/CLAIMS.md` lists every claim the course makes, each in a table row whose first cell is
its ID (e.g. ``KV-3``) and whose ``lesson`` cell links the notebooks that reproduce it. A lesson
notebook *cites* a claim when its text says so in this form (the badge form the lessons use):

    Claim KV-3              Claims PD-8, BATCH-2          Claims KV-4 … KV-6 and KV-10

that is, the word ``Claim``/``Claims`` (any case, optionally in ``**bold**``) followed by a list of
IDs joined by ``,``, ``and``, ``&`` or a range mark (``…`` or ``...``); a range ``KV-4 … KV-6``
stands for KV-4, KV-5 and KV-6. A bare ID without the word (``(PD-1)`` in a summary, a code
comment) is a *mention*: it does not make the notebook a lesson of that claim, but it must still
name a listed claim.

Citations are read from executed lesson notebooks only (every code cell has a stored execution,
as `tools/check_executed.py` demands): markdown cells, code cells and the text that code cells
printed or displayed (prose generated from a run counts). The test fails when
- a listed claim is cited by no executed notebook;
- a notebook cites or mentions an ID that the claims file does not list;
- a claim's ``lesson`` column disagrees with the notebooks that cite it.

A claim whose *reproduces* cell starts with ``pending`` (its lesson is not written yet, e.g.
one that belongs to a later issue) is the one exception to the first rule: it must link no
lesson and no notebook may cite it; once a lesson cites it, its row must say how it reproduces.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
CLAIMS_FILE = NOTEBOOKS / "CLAIMS.md"

PREFIXES = ("REQ", "PD", "KV", "BATCH", "QUANT", "SPEC", "SAMP", "MET", "PAR", "OPT")
ID = rf"(?:{'|'.join(PREFIXES)})-\d+"
ID_RE = re.compile(rf"(?<![\w-])({ID})(?![\w-])")
_JOIN = r"\s*(?:,|\band\b|&|…|\.\.\.)\s*"
CITATION_RE = re.compile(rf"\bclaims?\b\**\s+\**({ID}(?:\**{_JOIN}\**{ID})*)", re.IGNORECASE)
RANGE_RE = re.compile(rf"({ID})\**\s*(?:…|\.\.\.)\s*\**({ID})")
LESSON_LINK_RE = re.compile(r"\(([^()\s]*?(\d\d_[\w-]+\.ipynb))\)")


def _split(claim_id: str) -> tuple[str, int]:
    prefix, number = claim_id.rsplit("-", 1)
    return prefix, int(number)


def expand_ranges(text: str) -> set[str]:
    """The IDs a citation list names, with ``A-2 … A-5`` expanded to A-2, A-3, A-4, A-5."""
    ids = set(ID_RE.findall(text))
    for first, last in RANGE_RE.findall(text):
        (p1, n1), (p2, n2) = _split(first), _split(last)
        if p1 != p2 or n2 < n1:
            raise ValueError(f"bad claim range {first} … {last}: same prefix, ascending")
        ids.update(f"{p1}-{n}" for n in range(n1, n2 + 1))
    return ids


def cited_ids(text: str) -> set[str]:
    """IDs cited in the ``Claim(s) …`` form in `text`."""
    ids: set[str] = set()
    for match in CITATION_RE.finditer(text):
        ids |= expand_ranges(match.group(1))
    return ids


def mentioned_ids(text: str) -> set[str]:
    """Every ID-shaped token in `text` (ranges expanded), cited or not."""
    return expand_ranges(text)


def is_executed(nb: dict) -> bool:
    """Every code cell has a stored execution (cells marked NBVAL_SKIP, or tagged nbval-skip,
    excepted)."""
    return all(cell.get("execution_count") is not None or "NBVAL_SKIP" in _source(cell)
               or "nbval-skip" in cell.get("metadata", {}).get("tags", [])
               for cell in nb["cells"] if cell["cell_type"] == "code")


def _source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _joined(value) -> str:
    return "".join(value) if isinstance(value, list) else str(value)


def notebook_text(nb: dict) -> str:
    """What a reader of the executed notebook reads: cell sources and text outputs."""
    parts = []
    for cell in nb["cells"]:
        parts.append(_source(cell))
        for out in cell.get("outputs", []):
            if "text" in out:
                parts.append(_joined(out["text"]))
            for mime in ("text/markdown", "text/plain"):
                if mime in out.get("data", {}):
                    parts.append(_joined(out["data"][mime]))
    return "\n".join(parts)


def notebook_citations(paths) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """{notebook name: IDs cited} and {notebook name: IDs mentioned} of the executed notebooks."""
    cited, mentioned = {}, {}
    for path in paths:
        nb = json.loads(Path(path).read_text(encoding="utf-8"))
        if not is_executed(nb):
            continue
        text = notebook_text(nb)
        cited[Path(path).name] = cited_ids(text)
        mentioned[Path(path).name] = mentioned_ids(text)
    return cited, mentioned


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


PENDING = "pending"


def parse_claims(markdown: str) -> dict[str, set[str]]:
    """{claim ID: notebook file names in its ``lesson`` column} from the claims file's tables.

    A table row belongs to a claim when its first cell is exactly one ID (bold allowed). The
    ``lesson`` column is found by its header. An ID listed twice is an error.
    """
    return {claim_id: lessons for claim_id, (lessons, _) in parse_rows(markdown).items()}


def pending_claims(markdown: str) -> set[str]:
    """The IDs whose ``reproduces`` cell starts with the word ``pending``."""
    return {claim_id for claim_id, (_, status) in parse_rows(markdown).items()
            if status.lower().startswith(PENDING)}


def parse_rows(markdown: str) -> dict[str, tuple[set[str], str]]:
    """{claim ID: (lesson file names, reproduces cell)}; the reproduces cell is "" where the
    table has no such column."""
    claims: dict[str, tuple[set[str], str]] = {}
    lesson_col = status_col = None
    for line in markdown.splitlines():
        if not line.lstrip().startswith("|"):
            lesson_col = None if not line.strip() else lesson_col
            continue
        cells = _cells(line)
        names = [c.lower() for c in cells]
        if "lesson" in names or "lessons" in names:
            lesson_col = names.index("lesson") if "lesson" in names else names.index("lessons")
            status_col = names.index("reproduces") if "reproduces" in names else None
            continue
        first = cells[0].strip("*").strip()
        if not re.fullmatch(ID, first):
            continue
        if lesson_col is None or lesson_col >= len(cells):
            raise ValueError(f"claim row {first} has no lesson column: {line!r}")
        if first in claims:
            raise ValueError(f"claim {first} is listed twice")
        status = cells[status_col].strip("*").strip() if status_col is not None \
            and status_col < len(cells) else ""
        claims[first] = ({m.group(2) for m in LESSON_LINK_RE.finditer(cells[lesson_col])}, status)
    return claims


def check(claims: dict[str, set[str]], cited: dict[str, set[str]],
          mentioned: dict[str, set[str]], pending: set[str] = frozenset()) -> list[str]:
    """The disagreements between the claims file and the notebooks, as sentences.

    `pending`: listed claims not reproduced yet (see the module docstring)."""
    problems = []
    listed = set(claims)
    for name in sorted(mentioned):
        for claim_id in sorted(mentioned[name] - listed, key=_split):
            problems.append(f"{name} names {claim_id}, which notebooks/CLAIMS.md does not list")
    for claim_id in sorted(listed, key=_split):
        where = {name for name, ids in cited.items() if claim_id in ids}
        if claim_id in pending:
            if where or claims[claim_id]:
                problems.append(f"{claim_id} is marked pending but is cited in {sorted(where)} "
                                f"and links {sorted(claims[claim_id])}: say how it reproduces")
            continue
        if not where:
            problems.append(f"{claim_id} is listed but no executed notebook cites it "
                            f"(as 'Claim {claim_id}')")
        elif where != claims[claim_id]:
            problems.append(f"{claim_id}: lesson column links {sorted(claims[claim_id])}, "
                            f"but it is cited in {sorted(where)}")
    return problems


def lesson_paths() -> list[Path]:
    return sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


# --- the real course -------------------------------------------------------------------------


def test_claims_file_lists_ids():
    claims = parse_claims(CLAIMS_FILE.read_text(encoding="utf-8"))
    assert len(claims) >= 50, f"only {len(claims)} claim rows parsed from {CLAIMS_FILE}"
    for claim_id, lessons in claims.items():
        for name in lessons:
            assert (NOTEBOOKS / name).exists(), f"{claim_id} links {name}, which does not exist"


def test_claims_and_notebooks_agree():
    text = CLAIMS_FILE.read_text(encoding="utf-8")
    claims = parse_claims(text)
    cited, mentioned = notebook_citations(lesson_paths())
    assert cited, "no executed lesson notebook found"
    problems = check(claims, cited, mentioned, pending_claims(text))
    assert not problems, "\n".join(problems)


# --- the checker itself can fail --------------------------------------------------------------


def test_citation_forms():
    text = ("(**Claim KV-1**); Claims PD-8, BATCH-2; claims KV-4 … KV-6 and KV-10;"
            " (**Claims KV-5, KV-6,\n  KV-8**); Claims SPEC-1 ... SPEC-3")
    assert cited_ids(text) == {"KV-1", "PD-8", "BATCH-2", "KV-4", "KV-5", "KV-6", "KV-10",
                               "KV-8", "SPEC-1", "SPEC-2", "SPEC-3"}
    # bare IDs are mentions, not citations; a claim's own wording is no citation either
    bare = "the summary (PD-1); # QUANT-2, section 6; the claim's reference run (PD-3); KV-10x"
    assert cited_ids(bare) == set()
    assert mentioned_ids(bare) == {"PD-1", "QUANT-2", "PD-3"}
    with pytest.raises(ValueError, match="bad claim range"):
        cited_ids("Claims KV-6 … KV-4")


CLAIMS_MD = """\
| ID | claim | lesson |
|---|---|---|
| **KV-1** | keys never change | [03](03_kv.ipynb) |
| KV-2 | identical output | [03](03_kv.ipynb), [05](05_mem.ipynb) |
| KV-3 | linear vs quadratic | [03](03_kv.ipynb) |
"""


def _notebook(tmp_path: Path, name: str, markdown: str, executed: bool = True) -> Path:
    nb = {"cells": [
        {"cell_type": "markdown", "metadata": {}, "source": markdown},
        {"cell_type": "code", "metadata": {}, "source": "print(1)", "outputs": [],
         "execution_count": 1 if executed else None},
    ], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / name
    path.write_text(json.dumps(nb), encoding="utf-8")
    return path


def test_checker_accepts_a_consistent_course(tmp_path):
    paths = [_notebook(tmp_path, "03_kv.ipynb", "**Claims KV-1 … KV-3**"),
             _notebook(tmp_path, "05_mem.ipynb", "(Claim KV-2), see also (KV-3)")]
    assert check(parse_claims(CLAIMS_MD), *notebook_citations(paths)) == []


def test_checker_finds_each_kind_of_disagreement(tmp_path):
    paths = [_notebook(tmp_path, "03_kv.ipynb", "Claims KV-1, KV-2 and KV-9; see PD-1"),
             _notebook(tmp_path, "05_mem.ipynb", "Claim KV-3")]
    problems = check(parse_claims(CLAIMS_MD), *notebook_citations(paths))
    assert any("names KV-9" in p for p in problems)  # cited, not listed
    assert any("names PD-1" in p for p in problems)  # mentioned, not listed
    assert any(p.startswith("KV-2: lesson column") for p in problems)  # 05 does not cite it
    assert any(p.startswith("KV-3: lesson column") for p in problems)  # 05, not 03, cites it
    assert len(problems) == 4, problems


def test_unexecuted_notebooks_do_not_count(tmp_path):
    paths = [_notebook(tmp_path, "03_kv.ipynb", "Claims KV-1 … KV-3", executed=False),
             _notebook(tmp_path, "05_mem.ipynb", "Claim KV-2")]
    problems = check(parse_claims(CLAIMS_MD), *notebook_citations(paths))
    assert "KV-1 is listed but no executed notebook cites it (as 'Claim KV-1')" in problems
    assert len(problems) == 3, problems


PENDING_MD = CLAIMS_MD.replace("| ID | claim | lesson |\n|---|---|---|",
                               "| ID | claim | lesson | reproduces |\n|---|---|---|---|") \
    .replace("[03](03_kv.ipynb) |\n", "[03](03_kv.ipynb) | yes |\n") \
    .replace("[05](05_mem.ipynb) |\n", "[05](05_mem.ipynb) | yes |\n") \
    + "| KV-4 | not written yet |  | pending (a later lesson) |\n"


def test_a_pending_claim_needs_no_lesson_but_must_not_be_cited(tmp_path):
    assert pending_claims(PENDING_MD) == {"KV-4"} and pending_claims(CLAIMS_MD) == set()
    claims = parse_claims(PENDING_MD)
    assert claims["KV-4"] == set() and claims["KV-2"] == {"03_kv.ipynb", "05_mem.ipynb"}
    paths = [_notebook(tmp_path, "03_kv.ipynb", "**Claims KV-1 … KV-3**"),
             _notebook(tmp_path, "05_mem.ipynb", "(Claim KV-2), see also (KV-3)")]
    assert check(claims, *notebook_citations(paths), pending_claims(PENDING_MD)) == []
    # without the pending mark the same row is a claim no lesson cites
    assert check(claims, *notebook_citations(paths)) == [
        "KV-4 is listed but no executed notebook cites it (as 'Claim KV-4')"]
    # a pending claim that a lesson cites must say how it reproduces
    paths.append(_notebook(tmp_path, "07_x.ipynb", "Claim KV-4"))
    problems = check(claims, *notebook_citations(paths), pending_claims(PENDING_MD))
    assert len(problems) == 1 and problems[0].startswith("KV-4 is marked pending"), problems


def test_claims_parser_rejects_a_duplicate_row():
    with pytest.raises(ValueError, match="listed twice"):
        parse_claims(CLAIMS_MD + "| KV-1 | again | [03](03_kv.ipynb) |\n")
