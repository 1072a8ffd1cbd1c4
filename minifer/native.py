"""Building minifer's C++ kernels: what the CPU offers, and one cached build per kernel and CPU.

minifer ships two small kernels as C++ sources (``serve/csrc/paged_decode.cpp``,
``csrc/int8_gemv.cpp``). `torch.utils.cpp_extension` compiles each the first time a process
needs it (seconds) and caches the build on disk for later processes. The build's name holds the
torch version and the vector instructions it was built for, so a cache shared by machines of
different CPUs never loads a build made for another. Every caller keeps a pure-torch path for
where no build is possible (no compiler or ninja, another architecture).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
from pathlib import Path

import torch

__all__ = ["cpu_flags", "vector_isa", "build", "build_name", "build_tools_problem", "reason"]


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags of this CPU as Linux lists them (empty where it does not)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    match = re.search(r"^flags\s*:(.*)$", text, re.MULTILINE)
    return frozenset(match.group(1).split()) if match else frozenset()


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
    """Compile `source` (or load its cached build) and register the operators it defines."""
    from torch.utils.cpp_extension import load

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
