"""W8A8 and bf16 products for CPUs with AVX2 but without AVX-512's int8 and bf16 instructions.

On such a CPU (AMD Zen 1-3, Intel before Ice Lake) oneDNN packs no bf16, so a bf16 layer ran
torch's generic bf16 product, slower than fp32 at any batch; and int8 had no W8A8 kernel of
minifer's. ``csrc/avx2_gemm.cpp`` computes both for any number of rows:

- ``w8a8``: `minifer.quantization.w8a8_reference`, bit for bit (int8 widened to int16,
  ``vpmaddwd``: exact int32 sums);
- ``bf16``: `bf16_gemv.bf16_reference`, float32 products and sums, one rounding to bf16 (sums in
  another order: equal to float32 rounding).

`AVX2` builds it when first needed where the CPU has AVX2 and FMA; the callers use it only
where minifer's AVX-512 kernels do not run. Elsewhere, or where the build fails (it warns
once), the layers keep to torch."""

from __future__ import annotations

from pathlib import Path

import torch

from .native import NativeKernel

__all__ = ["Avx2Gemm", "AVX2"]


class Avx2Gemm(NativeKernel):
    """The C++ kernels where this CPU has AVX2 and FMA; `available()` says whether, `error` why
    a build failed."""

    kernel, source = "avx2_gemm", Path(__file__).with_name("csrc") / "avx2_gemm.cpp"
    flags, cflags, isa = frozenset({"avx2", "fma"}), ["-march=x86-64-v3", "-ffp-contract=off"], "avx2"
    namespace, op = "minifer_avx2", "w8a8"
    instead = "int8 and bf16 layers run torch's kernels"
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


AVX2 = Avx2Gemm()  # one per process: every layer shares its build
