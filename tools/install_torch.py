"""Install PyTorch into the current environment if it is missing, choosing the right build.

With an NVIDIA driver present (nvidia-smi answers) the default build from PyPI, which bundles
CUDA, is installed. Everywhere else the CPU-only build is taken from PyTorch's CPU wheel index:
it is ~200 MB instead of several GB. Set TORCH_SPEC (e.g. "torch==2.13.0") or
TORCH_INDEX_URL to override; an already installed torch in the supported range (pyproject.toml)
is left alone.
"""

import os
import shutil
import subprocess
import sys

MIN_VERSION, MAX_VERSION = (2, 4), (2, 15)  # as pyproject.toml: torch>=2.4,<2.15


def installed_version() -> tuple[int, ...] | None:
    try:
        import torch
    except ImportError:
        return None
    return tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


def has_nvidia_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    return bool(smi) and subprocess.run([smi], capture_output=True).returncode == 0


def main() -> int:
    version = installed_version()
    if version is not None and MIN_VERSION <= version < MAX_VERSION:
        print(f"torch {'.'.join(map(str, version))} already installed")
        return 0
    spec = os.environ.get("TORCH_SPEC", "torch>=2.4,<2.15")
    cmd = [sys.executable, "-m", "pip", "install", spec]
    index = os.environ.get("TORCH_INDEX_URL")
    if index is None and not has_nvidia_gpu():
        index = "https://download.pytorch.org/whl/cpu"
    if index:
        cmd += ["--index-url", index, "--extra-index-url", "https://pypi.org/simple"]
    print("+", " ".join(cmd), flush=True)
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
