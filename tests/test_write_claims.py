"""CLAIMS.md's measured (‡) numbers, its machine line and the README's runtime column are
written by tools/write_claims.py from the stored notebook outputs: they must equal what a fresh
run of the script writes (no notebook is executed here)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from tool_modules import load_tool

ROOT = Path(__file__).resolve().parents[1]
wc = load_tool("write_claims")


def test_claims_and_readme_equal_the_stored_outputs():
    runs = wc.recorded()
    assert runs, "no lesson records its measured figures (minifer_course.lessons.common.record)"
    claims = wc.CLAIMS.read_text(encoding="utf-8")
    new, problems = wc.write_claims(claims, runs)
    assert not problems, "\n".join(problems)
    assert new == claims, "notebooks/CLAIMS.md disagrees with the stored outputs: " \
        "run python tools/write_claims.py"
    readme = wc.README.read_text(encoding="utf-8")
    new, problems = wc.write_readme(readme, json.loads(wc.RUNTIMES.read_text()))
    assert not problems, "\n".join(problems)
    assert new == readme, "README's runtime column disagrees with notebooks/RUNTIMES.json: " \
        "run python tools/write_claims.py"


def test_every_measured_claim_quotes_the_run():
    """A claim row that marks a number ‡ (measured) takes its numbers from a lesson's record."""
    rows = [line for line in wc.CLAIMS.read_text(encoding="utf-8").splitlines()
            if re.match(r"\| [A-Z]+-\d+ \|", line) and "‡" in line]
    typed = [line.split(" | ")[0].strip("| ") for line in rows if not wc.FIGURE_RE.search(line)]
    assert not typed, f"claims with ‡ numbers typed by hand, not written from a record: {typed}"


def _copy(tmp_path: Path) -> Path:
    (tmp_path / "notebooks").mkdir()
    for path in wc.NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"):
        shutil.copy(path, tmp_path / "notebooks" / path.name)
    for name in ("CLAIMS.md", "RUNTIMES.json"):
        shutil.copy(wc.NOTEBOOKS / name, tmp_path / "notebooks" / name)
    shutil.copy(wc.README, tmp_path / "README.md")
    return tmp_path


def test_the_check_passes_on_a_copy(tmp_path):
    assert wc.main(["--check", "--root", str(_copy(tmp_path))]) == 0


def test_a_changed_stored_number_fails_the_check(tmp_path, capsys):
    root = _copy(tmp_path)
    lesson, run = sorted(wc.recorded(root / "notebooks").items())[0]
    name, value = sorted(run["figures"].items())[0]
    path = root / "notebooks" / run["notebook"]
    nb = json.loads(path.read_text(encoding="utf-8"))
    changed = 0
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            lines = wc._text(out.get("text", "")).splitlines(keepends=True)
            for i, line in enumerate(lines):
                if line.startswith(wc.TAG):
                    row = json.loads(line[len(wc.TAG):])
                    if name in row["figures"]:
                        row["figures"][name] = value + "7"
                        lines[i] = wc.TAG + json.dumps(row, ensure_ascii=False) + "\n"
                        changed += 1
            if changed:
                out["text"] = lines
    assert changed
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    assert wc.main(["--check", "--root", str(root)]) == 1
    assert "CLAIMS.md disagrees" in capsys.readouterr().err
    # the script repairs it, and then the check passes
    assert wc.main(["--root", str(root)]) == 0
    assert f"<!--{lesson}.{name}-->{value}7<!--/-->" in (root / "notebooks" / "CLAIMS.md").read_text()
    assert wc.main(["--check", "--root", str(root)]) == 0


def test_a_changed_runtime_fails_the_check(tmp_path, capsys):
    root = _copy(tmp_path)
    runtimes = json.loads((root / "notebooks" / "RUNTIMES.json").read_text())
    runtimes["notebooks"][0]["with_kernel_start_s"] += 5
    (root / "notebooks" / "RUNTIMES.json").write_text(json.dumps(runtimes))
    assert wc.main(["--check", "--root", str(root)]) == 1
    assert "README.md disagrees" in capsys.readouterr().err


def test_a_marker_without_a_record_is_reported():
    _, problems = wc.write_claims("x <!--99.nothing-->1<!--/--> <!--machine--><!--/-->", {})
    assert problems == ["CLAIMS.md quotes 99.nothing, which lesson 99's stored outputs do not record"]


@pytest.mark.parametrize("loads", [[1.0], [1.0, 3.5]])
def test_machine_line_names_the_cpu_and_date(loads):
    machine = {"cpu": "Some CPU", "flags": ["avx2", "avx512_vnni"], "cpus": 2, "threads": 1,
               "torch": "2.13.0+cpu", "date": "2026-12-05"}
    runs = {f"0{i}": {"figures": {}, "machine": {**machine, "load_1min": x}}
            for i, x in enumerate(loads)}
    line = wc.machine_line(runs)
    assert "2-core Some CPU (features: AVX2, AVX-512 VNNI)" in line and "2026-12-05" in line
    assert "torch 2.13.0+cpu" in line and "1 thread when" in line


def test_a_record_under_another_lesson_number_is_refused(tmp_path):
    """A lesson renumbered without its ``record("NN", ...)``: its figures would land in another
    lesson's markers, so reading the records fails and names the notebook."""
    root = _copy(tmp_path)
    lesson, run = sorted(wc.recorded(root / "notebooks").items())[0]
    path = root / "notebooks" / run["notebook"]
    text = path.read_text(encoding="utf-8")
    tag = f'\\"lesson\\": \\"{lesson}\\"'
    assert tag in text
    path.write_text(text.replace(tag, tag.replace(lesson, "99")), encoding="utf-8")
    with pytest.raises(ValueError, match=run["notebook"]):
        wc.recorded(root / "notebooks")
