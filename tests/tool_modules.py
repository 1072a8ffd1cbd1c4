"""The course's tools are scripts in tools/, not a package: this loads one as a module for
the tests (and any other file by path, e.g. a test module whose helpers another test uses)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def load_module(path: Path, name: str | None = None) -> ModuleType:
    """Execute the file at ``path`` as module ``name`` (default: its stem). The module is put in
    ``sys.modules`` first: dataclasses look their module up there, and the tools import each
    other by name (``import static_figures``), so they then share one copy."""
    name = name or path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_tool(name: str) -> ModuleType:
    """``tools/<name>.py`` as module ``name``."""
    return load_module(TOOLS / f"{name}.py")
