"""Write the measured numbers of notebooks/CLAIMS.md and the README from the stored run.

    python tools/write_claims.py           # rewrite CLAIMS.md's measured cells and the README
    python tools/write_claims.py --check   # change nothing; exit 1 and list what disagrees

(`make notebooks` runs it after re-executing the lessons.) Where the numbers come from:

- **CLAIMS.md's ‡ numbers**: each lesson that measures something ends with a cell that calls
  ``minifer_course.lessons.common.record("NN", name="value", ...)``; it prints one line
  ``minifer-measured {"lesson": "NN", "figures": {...}, "machine": {...}}`` into the stored
  outputs. In CLAIMS.md a measured number is written between markers,
  ``<!--NN.name-->value<!--/-->`` (invisible when rendered), and this script puts the stored
  figure between them.
- **CLAIMS.md's machine line** (between ``<!--machine-->`` and ``<!--/-->``): the CPU model,
  its timing-relevant features, cores, threads, torch and date that those record lines carry.
- **The README's runtime column** (the course table's last column) and the note under the
  table saying where and when they were measured (between ``<!--runtimes-->`` and ``<!--/-->``):
  from notebooks/RUNTIMES.json, which tools/run_notebooks.py writes when it runs the lessons.

It reads only stored files (no notebook runs) and is idempotent: a second run changes nothing.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
CLAIMS = NOTEBOOKS / "CLAIMS.md"
README = ROOT / "README.md"
RUNTIMES = NOTEBOOKS / "RUNTIMES.json"

TAG = "minifer-measured "  # minifer_course.lessons.common.MEASURED_TAG (not imported: no torch here)
END = "<!--/-->"
FIGURE_RE = re.compile(r"<!--(\d\d)\.(\w+)-->(.*?)" + re.escape(END))
MACHINE_RE = re.compile(r"(<!--machine-->)(.*?)(" + re.escape(END) + ")", re.DOTALL)
RUNTIMES_RE = re.compile(r"(<!--runtimes-->)(.*?)(" + re.escape(END) + ")", re.DOTALL)
COURSE_ROW_RE = re.compile(r"^\| \[(\d\d) · [^\n]*$", re.MULTILINE)

FLAG_NAMES = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_bf16": "AVX-512 BF16",
              "avx512_fp16": "AVX-512 FP16", "avx512_vnni": "AVX-512 VNNI", "avx_vnni": "AVX-VNNI",
              "amx_bf16": "AMX-BF16", "amx_int8": "AMX-INT8", "asimddp": "Arm dot product",
              "sve": "SVE"}


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else str(value)


def recorded(notebooks: Path = NOTEBOOKS) -> dict[str, dict]:
    """{lesson "NN": {"figures": {...}, "machine": {...}, "notebook": name}} from the stored
    outputs of the lessons (several record lines in one lesson are merged, later ones win).
    A ValueError for a record whose lesson is not its notebook's number (a renumbered lesson
    whose ``record("NN", ...)`` was not renumbered with it)."""
    found: dict[str, dict] = {}
    for path in sorted(notebooks.glob("[0-9][0-9]_*.ipynb")):
        nb = json.loads(path.read_text(encoding="utf-8"))
        for cell in nb["cells"]:
            for out in cell.get("outputs", []):
                for line in _text(out.get("text", "")).splitlines():
                    if not line.startswith(TAG):
                        continue
                    row = json.loads(line[len(TAG):])
                    if row["lesson"] != path.name[:2]:
                        raise ValueError(f"{path.name} records its figures as lesson "
                                         f"{row['lesson']!r}: record() must name the notebook's "
                                         f"number, {path.name[:2]!r}")
                    lesson = found.setdefault(row["lesson"], {"figures": {}, "notebook": path.name})
                    lesson["figures"].update(row["figures"])
                    lesson["machine"] = row["machine"]
    return found


def machine_line(runs: dict[str, dict]) -> str:
    """One sentence per distinct machine the lessons' records were measured on."""
    by_machine: dict[tuple, list[str]] = {}
    for lesson in sorted(runs):
        m = runs[lesson]["machine"]
        key = (m["cpu"], tuple(m["flags"]), m["cpus"], m["torch"])
        by_machine.setdefault(key, []).append(lesson)
    parts = []
    for (cpu, flags, cpus, torch), lessons in by_machine.items():
        ms = [runs[n]["machine"] for n in lessons]
        dates = sorted({m["date"] for m in ms})
        threads = sorted({m["threads"] for m in ms})
        loads = [m["load_1min"] for m in ms if m.get("load_1min") is not None]
        named = ", ".join(FLAG_NAMES.get(f, f) for f in flags if f in FLAG_NAMES) or "none listed"
        when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
        span = f"{min(loads):.1f}" if loads and min(loads) == max(loads) else \
            f"{min(loads, default=0):.1f}–{max(loads, default=0):.1f}"
        load = (f"1-minute load average {span} on {cpus} cores when each lesson recorded"
                if loads else "load not recorded")
        parts.append(f"a {cpus}-core {cpu} (features: {named}), torch {torch}, "
                     f"{'/'.join(map(str, threads))} thread{'s' if threads != [1] else ''} when recorded, lessons "
                     f"{', '.join(lessons)} executed {when}, {load}")
    return "; ".join(parts) if parts else "no lesson has recorded its measurements yet"


def runtime_cell(row: dict) -> str:
    peak_mb = max(row["kernel_peak_rss_mb"], row["tree_peak_rss_mb"])
    return f"{row['with_kernel_start_s']:.0f} s · {peak_mb / 1000:.1f} GB"


def write_claims(text: str, runs: dict[str, dict]) -> tuple[str, list[str]]:
    """CLAIMS.md with its measured numbers and machine line from `runs`; and the problems (a
    marker whose lesson recorded no such figure)."""
    problems = []

    def figure(m: re.Match) -> str:
        lesson, name = m.group(1), m.group(2)
        value = runs.get(lesson, {}).get("figures", {}).get(name)
        if value is None:
            problems.append(f"CLAIMS.md quotes {lesson}.{name}, which lesson {lesson}'s stored "
                            f"outputs do not record")
            return m.group(0)
        return f"<!--{lesson}.{name}-->{value}{END}"

    text = FIGURE_RE.sub(figure, text)
    if not MACHINE_RE.search(text):
        problems.append("CLAIMS.md has no <!--machine-->…<!--/--> line")
    text = MACHINE_RE.sub(lambda m: m.group(1) + machine_line(runs) + m.group(3), text)
    return text, problems


def write_readme(text: str, runtimes: dict) -> tuple[str, list[str]]:
    """README.md with the course table's runtime column from RUNTIMES.json's rows."""
    rows = {r["notebook"][:2]: r for r in runtimes["notebooks"] if "_solutions" not in r["notebook"]}
    problems = []

    def course_row(m: re.Match) -> str:
        lesson, line = m.group(1), m.group(0)
        if lesson not in rows:
            problems.append(f"README's course table lists lesson {lesson}, RUNTIMES.json has no row")
            return line
        cells = line.rstrip().rstrip("|").split(" | ")
        cells[-1] = runtime_cell(rows[lesson])
        return " | ".join(cells) + " |"

    text = COURSE_ROW_RE.sub(course_row, text)
    if not RUNTIMES_RE.search(text):
        problems.append("README has no <!--runtimes-->…<!--/--> note (where the runtimes were measured)")
    return RUNTIMES_RE.sub(lambda m: m.group(1) + runtimes_note(list(rows.values())) + m.group(3),
                           text), problems


def runtimes_note(rows: list[dict]) -> str:
    """Where and when the lessons' runtimes were measured, and how busy the machine was."""
    def lessons(m: str) -> str:
        mine = [r for r in rows if r["machine"] == m]
        dates = ", ".join(sorted({r["date"] for r in mine}))
        return f"lessons {', '.join(sorted(r['notebook'][:2] for r in mine))} on {m} ({dates})"

    where = "; ".join(lessons(m) for m in sorted({r["machine"] for r in rows}))
    loads = [r["load_1min"] for r in rows]
    return (f"{where}; 1-minute load average {min(loads):.1f}–{max(loads):.1f} when each lesson "
            f"finished (above the core count other work inflated the times)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 on a difference")
    ap.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    claims, readme = args.root / "notebooks" / "CLAIMS.md", args.root / "README.md"
    runs = recorded(args.root / "notebooks")
    new_claims, problems = write_claims(claims.read_text(encoding="utf-8"), runs)
    new_readme, more = write_readme(readme.read_text(encoding="utf-8"),
                                    json.loads((args.root / "notebooks" / "RUNTIMES.json").read_text()))
    problems += more
    stale = [p for p, new in ((claims, new_claims), (readme, new_readme))
             if p.read_text(encoding="utf-8") != new]
    for p in problems:
        print(p, file=sys.stderr)
    if args.check:
        for p in stale:
            print(f"{p.relative_to(args.root)} disagrees with the stored outputs: "
                  f"run python tools/write_claims.py", file=sys.stderr)
        return 1 if stale or problems else 0
    for p, new in ((claims, new_claims), (readme, new_readme)):
        if p.read_text(encoding="utf-8") != new:
            p.write_text(new, encoding="utf-8")
            print(f"wrote {p.relative_to(args.root)}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
