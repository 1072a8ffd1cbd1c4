"""Building minifer's C++ kernels: what the CPU offers, and one cached build per kernel and CPU.

`torch.utils.cpp_extension` compiles each of minifer's C++ kernels (``csrc/*.cpp``) the first
time a process needs it and caches the build on disk, named by the torch version and vector
instructions (a cache shared by different CPUs never loads another's build). Every caller keeps
a pure-torch path. `NativeKernel` is what the matrix-vector kernels share: the CPU check, one
build per process, a warning when it fails."""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import re
import shutil
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import torch

from ..device import cpu_flags

__all__ = ["cpu_flags", "vector_isa", "build", "build_name", "build_tools_problem", "reason",
           "NativeKernel"]


def vector_isa() -> tuple[str, list[str]]:
    """The widest vector instructions to build for here, and the compiler flags for them."""
    flags = cpu_flags()
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "avx512", ["-march=x86-64-v4"]
    if {"avx2", "fma", "bmi2"} <= flags:
        return "avx2", ["-march=x86-64-v3"]
    return "base", []


def build_name(kernel: str, isa: str) -> str:
    """The name a build is cached under: the kernel, this torch version and the ISA."""
    version = re.sub(r"\W", "_", torch.__version__)
    return f"minifer_{kernel}_{version}_{isa}"


def build(name: str, source: Path, cflags: list[str]) -> None:
    """Compile `source` (or load its cached build) and register its operators (a CUDA torch
    without CUDA says "No CUDA runtime is found" at the import, logged or printed: kept out)."""
    cpp_log = logging.getLogger("torch.utils.cpp_extension")
    level = cpp_log.level
    cpp_log.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            from torch.utils.cpp_extension import load
    finally:
        cpp_log.setLevel(level)

    load(name=name, sources=[str(source)], extra_cflags=["-O3", "-fopenmp", *cflags],
         extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)


def build_tools_problem() -> str | None:
    """Why a C++ kernel cannot be built here (None: a C++ compiler and ninja are present)."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx!r} is not on PATH)"
    if shutil.which("ninja") is None:
        try:
            import ninja  # noqa: F401  (the PyPI package puts the binary beside Python)
        except ImportError:
            return "no ninja (torch.utils.cpp_extension builds with it: pip install ninja)"
    return None


def reason(exc: Exception) -> str:
    """One line saying why a build or a call failed."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


class NativeKernel:
    """A C++ operator built the first time it is needed, only where this CPU has the instructions
    it is written for; `available()` says whether it runs here, `error` why not.

    A subclass names its source, the CPU flags it needs, its compiler flags and instruction set
    (part of the build's name), the operator (``namespace::op``), what runs instead and the shape
    function `torch.compile` traces through it with. `problem` also refuses where
    ``ATEN_CPU_CAPABILITY`` asks torch for AVX2 or less (``make test-kernels``: an older CPU)."""

    kernel: ClassVar[str]
    source: ClassVar[Path]
    flags: ClassVar[frozenset[str]]
    cflags: ClassVar[list[str]]
    isa: ClassVar[str]
    namespace: ClassVar[str]
    op: ClassVar[str]
    instead: ClassVar[str]
    older: ClassVar[tuple[str, ...]] = ("default", "avx2", "zvector", "vsx")  # capabilities under it

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._native: bool | None = None  # None: not tried yet
        self.error: str | None = None

    @staticmethod
    def shape(*args):
        """The output a call would return, without data (`torch.library.register_fake`)."""
        raise NotImplementedError

    @classmethod
    def problem(cls) -> str | None:
        """Why the kernel is not for this machine (None: it is, if it builds)."""
        if missing := cls.flags - cpu_flags():
            return f"the CPU lacks {', '.join(sorted(missing))}"
        if (capability := os.environ.get("ATEN_CPU_CAPABILITY", "").lower()) in cls.older:
            return f"ATEN_CPU_CAPABILITY={capability} asks for an older CPU's kernels"
        return build_tools_problem()

    def available(self) -> bool:
        """Build (or load the cached build of) the kernel; whether it is usable."""
        if self._native is not None:  # decided: every later call (one per layer) skips the lock
            return self._native
        with self._lock:
            if self._native is None:
                self._native = False
                if (why := self.problem()) is not None:
                    self.error = why
                    return False
                try:
                    build(build_name(self.kernel, self.isa), self.source, self.cflags)
                    self._native = hasattr(getattr(torch.ops, self.namespace), self.op)
                    if self._native:
                        _register_shape(f"{self.namespace}::{self.op}", type(self).shape)
                except Exception as exc:  # no compiler, a failed build: stay correct
                    self.error = reason(exc)
                    warnings.warn(f"the C++ {self.kernel} kernel could not be built "
                                  f"({self.error}); {self.instead}", RuntimeWarning,
                                  stacklevel=3)
            return self._native


@functools.cache
def _register_shape(name: str, shape: Callable) -> None:
    """Once per operator and process: its output's shape, for torch.compile to trace through."""
    torch.library.register_fake(name)(shape)
