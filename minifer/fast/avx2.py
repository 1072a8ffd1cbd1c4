"""W8A8, bf16 and few-row fp32 products on AVX2 (``csrc/avx2_gemm.cpp``), equal to references:

- ``w8a8``: `minifer.quantization.w8a8_reference` bit for bit (int8 widened to int16, ``vpmaddwd``:
  exact int32 sums): without VNNI minifer had no W8A8 kernel;
- ``bf16``: `bf16_gemv.bf16_reference` to float32 rounding, where oneDNN packs no bf16 (AMD Zen
  1-3, Intel before Ice Lake) and a bf16 layer ran torch's generic product, slower than fp32;
- ``f32``: `F.linear` to float32 rounding, for up to `f32_rows` rows on a row-major weight
  (`fast.layout`'s layers): it streams the weight at the memory's speed; oneDNN re-blocks it.

`AVX2` builds it when first needed where the CPU has AVX2 and FMA. Elsewhere, or where the build
fails (it warns once), the layers keep to torch."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from .native import NativeKernel, cpu_flags

__all__ = ["Avx2Gemm", "AVX2"]


class Avx2Gemm(NativeKernel):
    """The C++ kernels where this CPU has AVX2 and FMA (`available()`; `error`: why not)."""

    kernel, source = "avx2_gemm", Path(__file__).with_name("csrc") / "avx2_gemm.cpp"
    flags, cflags, isa = frozenset({"avx2", "fma"}), ["-march=x86-64-v3", "-ffp-contract=off"], "avx2"
    namespace, op = "minifer_avx2", "w8a8"
    instead = "int8, bf16 and fp32 layers run torch's kernels"
    older = ("default", "zvector", "vsx")  # ATEN_CPU_CAPABILITY=avx2 is this kernel's own level

    @staticmethod
    def shape(x, w, scales, bias):
        return x.new_empty(x.shape[0], w.shape[0])

    def w8a8(self, x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor,
             bias: torch.Tensor | None = None) -> torch.Tensor:
        """`w8a8_reference(x, w, scales, bias)`'s numbers: x [M, K] float, w int8 [N, K]."""
        return torch.ops.minifer_avx2.w8a8(x.float().contiguous(), w, scales.float(),
                                           None if bias is None else bias.float())

    def bf16(self, x: torch.Tensor, w: torch.Tensor,
             bias: torch.Tensor | None = None) -> torch.Tensor:
        """`bf16_reference(x, w, bias)` to float32 rounding: x [M, K], w [N, K] bf16."""
        return torch.ops.minifer_avx2.bf16(x, w.contiguous(), bias)

    @functools.cached_property
    def f32_rows(self) -> int:
        """The most rows fp32 layers give `f32` (then oneDNN is faster): 16 on AVX-512, else 4."""
        capability = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()  # as AVX-512 kernels refuse
        return 16 if "avx512f" in cpu_flags() and capability not in NativeKernel.older else 4

    def f32(self, x: torch.Tensor, w: torch.Tensor,
            bias: torch.Tensor | None = None) -> torch.Tensor:
        """`F.linear(x, w, bias)` to float32 rounding: x [M, K], w [N, K] float32 row-major."""
        return torch.ops.minifer_avx2.f32(x.contiguous(), w.contiguous(), bias, self.f32_rows > 4)


AVX2 = Avx2Gemm()  # one per process: every layer shares its build
