"""The package's layout keeps its promises: every module imports on its own (no import cycle),
no module reaches into another's private names, and the engine never imports the course's
plotting libraries."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "minifer"
COURSE = pathlib.Path(__file__).resolve().parents[1] / "course" / "minifer_course"
MODULES = sorted(
    ".".join(("minifer", *p.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")
    for p in PACKAGE.rglob("*.py")
    if p.name != "__main__.py"
)


@pytest.mark.parametrize("module", MODULES)
def test_every_module_imports_first_in_a_fresh_interpreter(module):
    # Importing a module first, alone, is what exposes an import cycle.
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True, timeout=120)


def _imported_names(path: pathlib.Path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level > 0 or (node.module or "").startswith("minifer")):
            for alias in node.names:
                yield node.lineno, alias.name


def test_no_module_imports_another_modules_private_names():
    bad = [f"{p.relative_to(PACKAGE.parent)}:{line} imports {name}"
           for p in PACKAGE.rglob("*.py") for line, name in _imported_names(p)
           if name.startswith("_") and not name.startswith("__")]
    assert not bad, "\n".join(bad)


def test_no_module_uses_another_modules_private_attributes():
    """`module._name` on an imported minifer module is a private import by another road."""
    bad = []
    for p in PACKAGE.rglob("*.py"):
        tree = ast.parse(p.read_text(encoding="utf-8"))
        aliases = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                   and (n.level > 0 or (n.module or "").startswith("minifer")) for a in n.names}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                bad.append(f"{p.relative_to(PACKAGE.parent)}:{node.lineno} uses "
                           f"{node.value.id}.{node.attr}")
    assert not bad, "\n".join(bad)


def test_the_engine_never_imports_plotly_or_widgets():
    code = ("import sys, importlib\n"
            f"for m in {MODULES!r}: importlib.import_module(m)\n"
            "bad = {'plotly', 'ipywidgets'} & set(sys.modules)\n"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_users_names_stay_importable_from_the_top_level():
    import minifer as mf

    for name in ("GPT", "GPTConfig", "SamplingParams", "generate", "stream", "prefill",
                 "decode_step", "quantize", "model_bytes", "speculative_generate",
                 "PromptLookupDrafter", "load_pretrained", "StaticKVCache",
                 "Completion", "TokenEvent", "TextStopper", "Sequence", "ByteTokenizer",
                 "Tokenizer", "default_device", "PRESETS"):
        assert hasattr(mf, name), name
    assert callable(mf.generate) and callable(mf.quantize)
    import minifer.generation
    import minifer.quantization

    assert mf.generate is minifer.generation.generate
    assert mf.quantize is minifer.quantization.quantize


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = (root.name, *path.relative_to(root).with_suffix("").parts)
    return ".".join(parts).removesuffix(".__init__")


def import_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """Which of the package's modules each module imports, anywhere in its file: at the top,
    inside a function (a lazy import still closes a cycle, only later), or under a condition.

    ``from . import x`` counts as importing the submodule ``x`` when there is one, else the
    package; ``from .m import name`` as importing ``m`` (and ``m.name`` if that is a module).
    """
    paths = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in paths}
    for mod, path in paths.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                subs = [f"{source}.{a.name}" for a in node.names]
                if node.module is None and all(t in paths for t in subs):
                    targets = subs  # ``from . import x``: the submodule x, not the package
                else:
                    targets = [source] + subs
            else:
                continue
            graph[mod] |= {t for t in targets if t in paths and t != mod}
    return graph


def import_cycles(root: pathlib.Path) -> list[list[str]]:
    """Every cycle of `import_graph` (one per strongly connected group of modules), each as
    the modules in it, sorted."""
    graph = import_graph(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def test_no_import_cycle_even_through_imports_inside_functions():
    # A fresh interpreter (above) only sees cycles among top-level imports; an import placed
    # inside a function hides a cycle until that function runs.
    cycles = import_cycles(PACKAGE)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_cycle_through_a_function_level_import(tmp_path):
    pkg = tmp_path / "cyclic"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import helper\n")
    (pkg / "b.py").write_text("def helper():\n    from .sub import c\n    return c.X\n")
    (pkg / "sub" / "c.py").write_text("from .. import a\nX = 1\n")
    (pkg / "d.py").write_text("from . import a\n")  # imports into the cycle, is not part of it
    assert import_cycles(pkg) == [["cyclic.a", "cyclic.b", "cyclic.sub.c"]]
    (pkg / "b.py").write_text("def helper():\n    return 1\n")
    assert import_cycles(pkg) == []


def test_no_lesson_imports_a_benchmark_command():
    """The lessons measure through `minifer_course.bench`'s library modules, never its command line."""
    graph = import_graph(COURSE)
    bad = [f"{m} imports {t}" for m, ts in graph.items() if m.startswith("minifer_course.lessons")
           for t in ts if t.startswith(("minifer_course.bench.commands", "minifer_course.bench.__main__"))]
    assert not bad, "\n".join(bad)


# The core: the engine a learner reads. Its speed-ups (minifer.fast) plug in at minifer.hooks.
CORE = sorted(p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py")


def test_the_core_never_imports_the_speed_up_package():
    """The arrows run one way: `minifer.fast` imports the core and fills `minifer.hooks`; no core
    module imports `minifer.fast` (only the package's front door, `minifer/__init__.py`, plugs
    it in)."""
    graph = import_graph(PACKAGE)
    bad = [f"minifer.{m} imports {t}" for m in CORE for t in sorted(graph[f"minifer.{m}"])
           if t == "minifer.fast" or t.startswith("minifer.fast.")]
    assert not bad, "\n".join(bad)
    assert "hooks" in CORE and "generation" in CORE and "threads" not in CORE


# The floors of the package, lowest first: each may import the floors below it, never above.
# `minifer.fast` stands beside them: it imports the core and the engine and fills
# `minifer.hooks`; only the package's front door, `minifer/__init__.py`, imports it (to plug it
# in) and the lazy `LLMEngine` above the core.
FLOORS = ["minifer", "minifer.engine", "minifer.distributed", "minifer.serve"]


def _floor(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and (PACKAGE / parts[1]).is_dir() else "minifer"


def test_no_import_runs_up_the_floors_and_no_two_folders_import_each_other():
    graph = import_graph(PACKAGE)
    up, ties = [], set()
    for m, targets in graph.items():
        if m == "minifer":  # the front door assembles the package
            continue
        for t in targets:
            a, b = _floor(m), _floor(t)
            if a == b:
                continue
            ties.add((a, b))
            if b == "minifer.fast" or (a in FLOORS and FLOORS.index(b) > FLOORS.index(a)):
                up.append(f"{m} imports {t}")
    assert not up, "\n".join(up)
    two_way = sorted(f"{a} <-> {b}" for a, b in ties if (b, a) in ties and a < b)
    assert not two_way, two_way


def test_the_engine_never_imports_the_course():
    graph = import_graph(PACKAGE)
    text = " ".join(p.read_text(encoding="utf-8") for p in PACKAGE.rglob("*.py"))
    assert "import minifer_course" not in text and "from minifer_course" not in text
    assert all(not t.startswith("minifer_course") for ts in graph.values() for t in ts)


def _function_lengths(root: pathlib.Path):
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
                yield path.relative_to(root.parent), node.name, node.end_lineno - first + 1


def test_no_function_of_the_engine_is_over_60_lines():
    long = [f"{p} {name}: {n} lines" for p, name, n in _function_lengths(PACKAGE) if n > 60]
    assert not long, "\n".join(long)


def test_the_installed_package_stays_compact():
    """`minifer/` is what ``pip install`` puts in site-packages: the engine, 13,000 lines of
    Python at most (the course's helpers and the benchmarks live in course/)."""
    lines = sum(len(p.read_text(encoding="utf-8").splitlines()) for p in PACKAGE.rglob("*.py"))
    assert lines <= 13_000, f"minifer/ has {lines:,} lines of Python"
