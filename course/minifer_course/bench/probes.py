"""Probes: what the roofline needs to know about *this* machine, measured.

Memory bandwidth (bytes/s, :func:`measure_bandwidth`) and matmul throughput (FLOP/s,
:func:`measure_matmul_flops`), and from them a `roofline.Hardware` for this machine
(:func:`measure_hardware`, or :func:`this_machine`, measured once per process).
``python -m minifer_course.bench probe`` prints them. Numbers in "GB/s" are decimal (1e9 bytes).

`minifer_course.roofline` is pure arithmetic and never measures: it takes the `Hardware` built here.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable

import torch

from minifer.checks import check_int
from minifer.device import as_device

from ..roofline import GiB, Hardware
from .timing import time_fn

__all__ = ["measure_bandwidth", "measure_matmul_flops", "measure_hardware", "this_machine"]


def _dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtype must be a torch dtype or a name like 'float32', 'bfloat16', "
                         f"'float16', got {dtype!r}")
    return value


def measure_bandwidth(device: str | torch.device = "cpu", nbytes: int = 128 * 2**20, *,
                      warmup: int = 1, repeats: int = 5) -> float:
    """Memory bandwidth in bytes/s: copy an ``nbytes`` buffer into another and count
    2 × nbytes moved (one read, one write) per median copy time.

    Like a decode step, a copy does almost no arithmetic per byte, so it runs at the speed of
    memory. Keep ``nbytes`` well above the last-level cache (128 MiB by default) or the probe
    measures the cache instead.
    """
    check_int("nbytes", nbytes, 4)
    dev = as_device(device)
    n = nbytes // 4
    with torch.inference_mode():
        src = torch.ones(n, dtype=torch.float32, device=dev)
        dst = torch.empty_like(src)
        timing = time_fn(lambda: dst.copy_(src), warmup=warmup, repeats=repeats, device=dev)
    return 2 * n * 4 / timing.median_s


def measure_matmul_flops(device: str | torch.device = "cpu", n: int = 2048,
                         dtype: torch.dtype | str = torch.float32, *, warmup: int = 2,
                         repeats: int = 5) -> float:
    """Matmul throughput in FLOP/s: an ``n × n`` by ``n × n`` product costs 2n³ FLOPs.

    A large square matmul is the most arithmetic-dense thing a model does, so this approaches
    the machine's practical peak (n=2048: 17 GFLOP).
    """
    check_int("n", n, 1)
    dev, dt = as_device(device), _dtype(dtype)
    with torch.inference_mode():
        gen = torch.Generator(device="cpu").manual_seed(0)
        a = torch.randn(n, n, generator=gen).to(device=dev, dtype=dt)
        b = torch.randn(n, n, generator=gen).to(device=dev, dtype=dt)
        timing = time_fn(lambda: a @ b, warmup=warmup, repeats=repeats, device=dev)
    return 2 * n**3 / timing.median_s


def measure_hardware(device: str = "cpu", *, name: str | None = None,
                     precisions: Iterable[str] = ("fp32",)) -> Hardware:
    """This machine as a roofline `Hardware`, measured with the probes (about a second).

    The result is what *this* machine sustains (a copy-bandwidth probe and a big matmul), not a
    spec-sheet peak, so treat it as a realistic ceiling. ``memory_bytes`` is the total RAM (CPU)
    or device memory (CUDA).
    """
    dtypes = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
    flops = {}
    for p in precisions:
        if p not in dtypes:
            raise ValueError(f"precisions must be drawn from {list(dtypes)}, got {p!r}")
        flops[p] = measure_matmul_flops(device=device, dtype=dtypes[p])
    return Hardware(name=name or f"this machine ({device}, measured)",
                    bandwidth=measure_bandwidth(device=device),
                    flops=flops, memory_bytes=_device_memory_bytes(device))


@functools.lru_cache(maxsize=1)
def this_machine() -> Hardware:
    """This machine's CPU, measured once per process (lessons share it)."""
    return measure_hardware("cpu", name="this-machine")


def _device_memory_bytes(device: str) -> float:
    """Total memory of ``device`` in bytes: RAM for the CPU, device memory for CUDA."""
    if str(device).startswith("cuda"):
        return float(torch.cuda.get_device_properties(device).total_memory)
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # not POSIX: a guess that keeps the math going
        return 8.0 * GiB
