"""W8A8 faster, with the same numbers: minifer's VNNI kernels, else ``torch._int_mm``.

Reference: `minifer.quantization.w8a8_reference`: quantize each row of ``x`` to int8 with its
own scale, multiply-add in integers (exact sums), scale back. Both kernels here compute exactly
that, bit for bit, so a W8A8 layer gives the same numbers at every batch size.

- One row (batch 1): ``csrc/int8_gemv.cpp``, an AVX-512 VNNI (``vpdpbusd``) matrix-vector
  kernel over torch's threads, built by `Int8Gemv` when first needed (`minifer.fast.native`)
  on CPUs with VNNI, unless ``ATEN_CPU_CAPABILITY`` asks for AVX2 or less. Elsewhere, or where
  the build fails (it warns once), one row goes the way of many.
- More rows: `Int8Gemv` too, over a copy of the weight packed in blocks of
  16 columns (made at the first batched call); without VNNI (or inside `torch.compile`),
  `w8a8_int_mm`, ``torch._int_mm`` (oneDNN's int8 GEMM) where its sums are exact here
  (`INT_MM_EXACT`); else the reference itself."""

from __future__ import annotations

from pathlib import Path

import torch

from ..quantization import quantize_rows, w8a8_reference
from .avx2 import AVX2
from .native import NativeKernel

__all__ = ["w8a8_reference", "w8a8_int_mm", "Int8Gemv", "GEMV", "quantize_rows", "int8_matmul"]

SOURCE = Path(__file__).with_name("csrc") / "int8_gemv.cpp"
VNNI_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"})


def _int_mm_exact() -> bool:
    """Does ``torch._int_mm`` return exact sums here? (Some builds add pairs of products in
    int16 and clip them.) Checked once, on a few shapes."""
    try:
        g = torch.Generator().manual_seed(0)
        cases = [(torch.full((4, 64), -127, dtype=torch.int8),) * 2]  # pair sums past int16
        cases += [(torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8),
                   torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8))
                  for m, k, n in ((1, 64, 16), (4, 256, 32), (17, 128, 8))]
        return all(torch.equal(torch._int_mm(a, b.t()), a.int() @ b.int().t()) for a, b in cases)
    except Exception:  # noqa: BLE001 — a torch or CPU without it
        return False


INT_MM_EXACT = _int_mm_exact()


def w8a8_int_mm(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """`w8a8_reference` with the integer product in ``torch._int_mm`` (int8 × int8 → int32, the
    same sums where `INT_MM_EXACT`, else the reference), which `torch.compile` can trace."""
    if not INT_MM_EXACT or x.shape[1] < 2:
        return w8a8_reference(x, w, scales, bias)
    q, s = quantize_rows(x)
    y = torch._int_mm(q, w.t()).float() * s[:, None] * scales.float()
    return y if bias is None else y + bias.float()


class Int8Gemv(NativeKernel):
    """The C++ kernels where this CPU has VNNI and they build; `available()` says whether.

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
        """Several rows read a copy of `w` in 16-column blocks (packed once, kept on `w`)."""
        if not self.available():
            return w8a8_reference(x, w, scales, bias)
        x = x.float().contiguous()
        if x.shape[0] == 1 or torch.compiler.is_compiling():
            return torch.ops.minifer_int8.gemv(x, w, scales, rowsum, bias)
        version, packed = getattr(w, "_vnni_blocks", (None, None))
        if version != w._version:
            packed = torch.ops.minifer_int8.pack(w)
            w._vnni_blocks = (w._version, packed)
        return torch.ops.minifer_int8.gemm(x, packed, scales, rowsum, bias)


GEMV = Int8Gemv()  # one per process: every layer shares its build


def int8_matmul(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, rowsum: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor | None:
    """The `minifer.hooks.int8_matmul` of the speed-up package: `w8a8_reference`'s numbers from
    the VNNI kernels where they run, else the AVX2 kernel (`fast.avx2`), else ``torch._int_mm``
    where its sums are exact; None leaves it to the reference."""
    if GEMV.available() and (x.shape[0] == 1 or not torch.compiler.is_compiling()):
        return GEMV(x, w, scales, rowsum, bias)
    if not torch.compiler.is_compiling() and AVX2.available():  # a CPU without VNNI
        return AVX2.w8a8(x, w, scales, bias)
    return w8a8_int_mm(x, w, scales, bias) if INT_MM_EXACT else None
