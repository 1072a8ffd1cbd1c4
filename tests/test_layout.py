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
    engine = [m for m in MODULES if not m.startswith("minifer.lessons")]
    code = ("import sys, importlib\n"
            f"for m in {engine!r}: importlib.import_module(m)\n"
            "bad = {'plotly', 'ipywidgets'} & set(sys.modules)\n"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_users_names_stay_importable_from_the_top_level():
    import minifer as mf

    for name in ("GPT", "GPTConfig", "SamplingParams", "generate", "stream", "prefill",
                 "decode_step", "quantize", "model_bytes", "speculative_generate",
                 "PromptLookupDrafter", "load_pretrained", "perplexity", "StaticKVCache",
                 "Completion", "TokenEvent", "TextStopper", "Sequence", "ByteTokenizer",
                 "Tokenizer", "default_device", "PRESETS"):
        assert hasattr(mf, name), name
    assert callable(mf.generate) and callable(mf.quantize)
    import minifer.generation
    import minifer.quantization

    assert mf.generate is minifer.generation.generate
    assert mf.quantize is minifer.quantization.quantize
