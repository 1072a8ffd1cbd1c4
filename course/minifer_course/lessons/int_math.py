"""Lesson 09, integer arithmetic (QUANT-6): int8 × int8 → int32 matmuls are exact; timed against
fp32 and bf16 at a decode and a prefill shape, they show where integer math is faster and where
only the bytes shrink.
"""

from __future__ import annotations

import torch

INT8_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")  # CPU units for int8 dot products (x86)


def int8_units() -> list[str]:
    """The x86 int8 dot-product units this CPU reports (`/proc/cpuinfo` flags), [] if none or
    if the flags cannot be read (not Linux, not x86)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")),
                         [])
    except OSError:
        return []
    return [u for u in INT8_FLAGS if u in flags]


def int8_operands(m: int = 32, k: int = 512, n: int = 64, *, limit: int = 127, seed: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random int8 matrices ``(m × k)`` and ``(k × n)`` with entries in ``[-limit, limit]``."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(-limit, limit + 1, (m, k), generator=g, dtype=torch.int8)
    b = torch.randint(-limit, limit + 1, (k, n), generator=g, dtype=torch.int8)
    return a, b


def pair_saturating_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The int8 product as x86 CPUs without VNNI compute it with ``vpmaddubsw``: ``a`` shifted
    to unsigned (+128), each *pair* of neighbouring products summed in int16 and **saturated**
    there, the pairs summed in int32, the shift taken back out (128 × each column sum of ``b``).

    Exact while no pair sum leaves int16 (|a| ≤ 63 is always safe); past that, sums clip. That
    is why PyTorch's quantized engines keep activations to 7 bits on such CPUs (``reduce_range``),
    and what ``torch._int_mm`` computed on them in older torch (oneDNN's s8 × s8 path in 2.4).
    Written for clarity (it holds m × k × n products in memory): small matrices only.
    """
    au, bl = a.long() + 128, b.long()
    products = au[:, :, None] * bl[None, :, :]  # (m, k, n)
    pairs = (products[:, 0::2] + products[:, 1::2]).clamp(-32768, 32767)
    return (pairs.sum(1) - 128 * bl.sum(0)[None, :]).to(torch.int32)


def int_mm_verdict(kernel: torch.Tensor, exact: torch.Tensor, a: torch.Tensor,
                   b: torch.Tensor) -> str:
    """A sentence: does this torch's ``_int_mm`` output equal the exact product, and if not,
    is its error the int16 pair saturation of :func:`pair_saturating_mm`?"""
    if torch.equal(kernel, exact):
        return f"torch {torch.__version__}: torch._int_mm equals the exact product here."
    off = (kernel.long() - exact.long()).abs().max().item()
    why = ("it equals the int16 pair-saturating product exactly: this kernel sums pairs of "
           "products in 16 bits, which clip for large operands (a CPU without VNNI)"
           if torch.equal(kernel, pair_saturating_mm(a, b)) else "for a reason not modelled here")
    return (f"torch {torch.__version__}: torch._int_mm DIFFERS from the exact product here "
            f"(by up to {off:,}); {why}. The arithmetic is exact; this kernel is not.")


def matmul_rows(shapes: dict[str, tuple[int, int, int]], repeats: int = 3) -> list[dict]:
    """Time ``(M × K) @ (K × N)`` in fp32, bf16 and int8 (``torch._int_mm``, int32 results) for
    each named shape, turn about, each its fastest of `repeats` (after one warm-up).

    Rows: the shape, ms per product in each type, int8's and bf16's speed against fp32, and
    the operand bytes of each (int8's are a quarter of fp32's).
    """
    import time

    rows = []
    g = torch.Generator().manual_seed(0)
    for name, (m, k, n) in shapes.items():
        a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
        ops = {"fp32": (a, b), "bf16": (a.bfloat16(), b.bfloat16()),
               "int8": ((a * 30).round().clamp(-127, 127).to(torch.int8),
                        (b * 30).round().clamp(-127, 127).to(torch.int8))}
        run = {"fp32": torch.matmul, "bf16": torch.matmul, "int8": torch._int_mm}
        best = {t: float("inf") for t in ops}
        for i in range(repeats + 1):
            for t, (x, y) in ops.items():
                t0 = time.perf_counter()
                run[t](x, y)
                if i:  # the first round warms up
                    best[t] = min(best[t], time.perf_counter() - t0)
        rows.append({"shape": f"{name}: {m}×{k} @ {k}×{n}", **{f"{t} ms": 1e3 * best[t] for t in ops},
                     "bf16 × fp32": best["fp32"] / best["bf16"],
                     "int8 × fp32": best["fp32"] / best["int8"],
                     "fp32 MB": (m * k + k * n) * 4 / 1e6, "int8 MB": (m * k + k * n) / 1e6})
    return rows


def int_math_sentence(rows: list[dict], units: list[str]) -> str:
    """Where integer math won and where it did not, from :func:`matmul_rows` on this machine."""
    have = (f"this CPU reports int8 dot-product units ({', '.join(units)})" if units
            else "this CPU reports no int8 dot-product unit (no VNNI, no AMX)")
    parts = [f"{r['shape'].split(':')[0]}: int8 {r['int8 × fp32']:.2f}× fp32's speed"
             for r in rows]
    wins = [r for r in rows if r["int8 × fp32"] > 1]
    verdict = ("integer math beat fp32 at " + ", ".join(r["shape"].split(":")[0] for r in wins)
               if wins else "integer math beat fp32 nowhere here: only the 4× fewer bytes "
                            "remain, which help where a step is bound by reading weights")
    return f"{have}; " + "; ".join(parts) + f" — {verdict}."
