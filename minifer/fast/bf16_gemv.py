"""bf16 at batch 1: a matrix-vector kernel for the CPU's AVX512-BF16 instructions.

A decode step at batch 1 is the time to read the weights, half of fp32's bytes in bf16, which
oneDNN's bf16 product (`minifer.fast.prepack`) can read slower than fp32.

Reference: `bf16_reference`, float32 products and sums of the bf16 numbers, rounded once to
bf16. ``csrc/bf16_gemv.cpp`` computes that with ``vdpbf16ps`` over torch's threads (its sums in
another order: equal to float32 rounding). `Bf16Gemv` builds it when first needed, on CPUs with
AVX512-BF16; elsewhere, or where the build fails (it warns once), the layer keeps to oneDNN."""

from __future__ import annotations

from pathlib import Path

import torch

from .native import NativeKernel

__all__ = ["bf16_reference", "Bf16Gemv", "GEMV"]

SOURCE = Path(__file__).with_name("csrc") / "bf16_gemv.cpp"
BF16_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"})


def bf16_reference(x: torch.Tensor, w: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ wᵀ + bias`` for bf16 ``x`` [M, K], ``w`` [N, K]: float32 arithmetic, one rounding
    to bf16 at the end (what torch's own bf16 linear does too)."""
    y = x.float() @ w.float().t()
    return (y if bias is None else y + bias.float()).to(torch.bfloat16)


class Bf16Gemv(NativeKernel):
    """The C++ kernel where this CPU has AVX512-BF16 and it builds; `available()` says whether.

    Call it like `bf16_reference`, on contiguous bf16 tensors. `error` says why a build failed."""

    kernel, source, flags = "bf16_gemv", SOURCE, BF16_FLAGS
    cflags, isa = ["-march=x86-64-v4", "-mavx512bf16"], "avx512bf16"
    namespace, op = "minifer_bf16", "gemv"
    instead = "bf16 layers at batch 1 run in oneDNN"

    @staticmethod
    def shape(x, w, bias):
        return x.new_empty(x.shape[0], w.shape[0])

    def __call__(self, x: torch.Tensor, w: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        if not self.available():
            return bf16_reference(x, w, bias)
        return torch.ops.minifer_bf16.gemv(x.contiguous(), w, bias)


GEMV = Bf16Gemv()  # one per process: every layer shares its build
