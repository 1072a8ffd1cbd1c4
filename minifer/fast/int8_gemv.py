"""W8A8 faster, with the same numbers: minifer's VNNI kernel for one row, ``torch._int_mm`` for more.

Reference: `minifer.quantization.w8a8_reference`: quantize each row of ``x`` to int8 with its
own scale, multiply-add in integers (exact sums), scale back. Both kernels here compute exactly
that, bit for bit, so a W8A8 layer gives the same numbers at every batch size.

- One row (batch 1): ``csrc/int8_gemv.cpp``, an AVX-512 VNNI (``vpdpbusd``) matrix-vector
  kernel over torch's threads, built by `Int8Gemv` when first needed (`minifer.fast.native`)
  on CPUs with VNNI, unless ``ATEN_CPU_CAPABILITY`` asks for AVX2 or less. Elsewhere, or where
  the build fails (it warns once), one row goes the way of many.
- More rows: `w8a8_int_mm`, the integer product in ``torch._int_mm`` (oneDNN's int8 GEMM),
  where its sums are exact here (`INT_MM_EXACT`); else the reference itself.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..quantization import quantize_rows, w8a8_reference
from .native import NativeKernel

__all__ = ["w8a8_reference", "w8a8_int_mm", "Int8Gemv", "GEMV", "quantize_rows", "int8_matmul"]

SOURCE = Path(__file__).with_name("csrc") / "int8_gemv.cpp"
VNNI_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"})


def _int_mm_exact() -> bool:
    """Does ``torch._int_mm`` return exact sums here? (Some builds add pairs of products in
    int16 and clip them.) Checked once, on random int8 operands of a few shapes, and on
    operands whose pair sums overflow int16."""
    try:
        g = torch.Generator().manual_seed(0)
        cases = [(torch.full((4, 64), -127, dtype=torch.int8),
                  torch.full((64, 4), -127, dtype=torch.int8))]
        for m, k, n in ((1, 64, 16), (4, 256, 32), (17, 128, 8)):
            cases.append((torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8),
                          torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8).t()))
        return all(torch.equal(torch._int_mm(a, b), a.int() @ b.int()) for a, b in cases)
    except Exception:  # noqa: BLE001 — a torch or CPU without it
        return False


INT_MM_EXACT = _int_mm_exact()


def w8a8_int_mm(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """`w8a8_reference` with the integer product in ``torch._int_mm`` (int8 × int8 → int32, the
    same sums), which `torch.compile` can trace; where it is not exact (`INT_MM_EXACT`), the
    reference instead."""
    if not INT_MM_EXACT or x.shape[1] < 2:
        return w8a8_reference(x, w, scales, bias)
    q, s = quantize_rows(x)
    y = torch._int_mm(q, w.t()).float() * s[:, None] * scales.float()
    return y if bias is None else y + bias.float()


class Int8Gemv(NativeKernel):
    """The C++ kernel where this CPU has VNNI and it builds; `available()` says whether.

    Call it like `w8a8_reference`, with ``rowsum = w.sum(1)`` in int32 (the kernel feeds ``x``
    in as unsigned bytes and takes ``128 * rowsum`` off again). `error` says why a build failed."""

    kernel, source, flags = "int8_gemv", SOURCE, VNNI_FLAGS
    cflags, isa = ["-march=x86-64-v4", "-mavx512vnni", "-ffp-contract=off"], "avx512vnni"
    namespace, op = "minifer_int8", "gemv"
    instead = "int8 layers at batch 1 compute the same numbers with torch._int_mm"

    @staticmethod
    def shape(x, w, scales, rowsum, bias):
        return x.new_empty(x.shape[0], w.shape[0])

    def __call__(self, x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor,
                 rowsum: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not self.available():
            return w8a8_reference(x, w, scales, bias)
        return torch.ops.minifer_int8.gemv(x.float().contiguous(), w, scales, rowsum, bias)


GEMV = Int8Gemv()  # one per process: every layer shares its build


def int8_matmul(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, rowsum: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor | None:
    """The `minifer.hooks.int8_matmul` of the speed-up package: `w8a8_reference`'s numbers,
    one row on the VNNI kernel where there is one, more rows in ``torch._int_mm`` where its
    sums are exact; None leaves it to the reference."""
    if x.shape[0] == 1 and GEMV.available():
        return GEMV(x, w, scales, rowsum, bias)
    if INT_MM_EXACT:
        return w8a8_int_mm(x, w, scales, bias)
    return None
