"""minifer's matrix-vector kernels (`native.NativeKernel`): refused on a CPU without their
instructions or where ``ATEN_CPU_CAPABILITY`` asks for an older CPU's kernels; a failed build
warns once, says why, and the call computes the readable reference instead."""

from __future__ import annotations

import pytest
import torch

from minifer.fast import bf16_gemv, int8_gemv, native
from minifer.quantization import quantize_int8


def _int8_call():
    g = torch.Generator().manual_seed(0)
    q, s = quantize_int8(torch.randn(16, 64, generator=g) * 0.05)
    x, b = torch.randn(1, 64, generator=g), torch.randn(16, generator=g)
    return (x, q, s, q.sum(1, dtype=torch.int32), b), int8_gemv.w8a8_reference(x, q, s, b)


def _bf16_call():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(16, 64, generator=g) * 0.05).bfloat16()
    x, b = torch.randn(1, 64, generator=g).bfloat16(), torch.randn(16, generator=g).bfloat16()
    return (x, w, b), bf16_gemv.bf16_reference(x, w, b)


@pytest.mark.parametrize("kernel, flag, instead, call", [
    (int8_gemv.Int8Gemv, "avx512_vnni", "torch._int_mm", _int8_call),
    (bf16_gemv.Bf16Gemv, "avx512_bf16", "oneDNN", _bf16_call),
])
def test_another_cpu_or_a_failed_build_keeps_to_the_reference(monkeypatch, kernel, flag,
                                                              instead, call):
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f"}))
    assert flag in kernel.problem()
    monkeypatch.setattr(native, "cpu_flags", lambda: kernel.flags)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert "ATEN_CPU_CAPABILITY=avx2" in kernel.problem()
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    monkeypatch.setattr(native, "build_tools_problem", lambda: None)

    def no_compiler(*args, **kwargs):
        raise OSError("no C++ compiler")

    monkeypatch.setattr(native, "build", no_compiler)
    k = kernel()
    with pytest.warns(RuntimeWarning, match=f"{k.kernel} kernel could not be built.*no C\\+\\+ "
                      f"compiler.*{instead}"):
        assert not k.available()
    assert "OSError" in k.error and not k.available()  # decided once
    args, want = call()
    assert torch.equal(k(*args), want)


def test_a_build_on_torch_for_cuda_without_cuda_prints_nothing(tmp_path):
    """A CUDA build of torch (PyPI's) on a machine without CUDA logs "No CUDA runtime is found"
    when torch.utils.cpp_extension is imported: build() keeps that line out of a lesson's output
    (nbval fails a cell on any stderr)."""
    import subprocess
    import sys

    code = (
        "import logging, pathlib, torch\n"
        "torch.cuda.is_available = lambda: False\n"  # torch built for CUDA, a machine without it
        "torch.cuda._is_compiled, torch.version.cuda = (lambda: True), '12.0'\n"
        "seen = []\n"
        "class Keep(logging.Handler):\n"
        "    def emit(self, record): seen.append(record.getMessage())\n"
        "logging.getLogger('torch.utils.cpp_extension').addHandler(Keep())\n"
        "from minifer.fast import native\n"
        "try:\n"
        "    native.build('minifer_missing', pathlib.Path('missing.cpp'), [])\n"
        "except Exception:\n"
        "    pass\n"
        "import torch.utils.cpp_extension\n"
        "assert torch.utils.cpp_extension.CUDA_HOME, 'CUDA_HOME was not found: the test tests nothing'\n"
        "print(seen)\n")
    env = {"PATH": "/usr/bin:/bin", "CUDA_HOME": str(tmp_path), "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
    assert "CUDA" not in out.stderr, out.stderr
