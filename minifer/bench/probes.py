"""Probes: what the roofline needs to know about *this* machine, measured.

Memory bandwidth (bytes/s, :func:`measure_bandwidth`) and matmul throughput (FLOP/s,
:func:`measure_matmul_flops`), and from them a `roofline.Hardware` for this machine
(:func:`measure_hardware`, or :func:`this_machine`, measured once per process).
``python -m minifer.bench probe`` prints them. Numbers in "GB/s" are decimal (1e9 bytes).

`minifer.roofline` is pure arithmetic and never measures: it takes the `Hardware` built here.
"""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Iterable

import torch

from ..device import as_device
from ..roofline import GiB, Hardware
from .timing import time_fn

__all__ = ["measure_bandwidth", "measure_matmul_flops", "measure_hardware", "this_machine",
           "add_arguments", "run_command"]


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
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 4:
        raise ValueError(f"nbytes must be an integer >= 4, got {nbytes!r}")
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
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
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


# ---- python -m minifer.bench probe ---------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    parser.add_argument("--size-mib", type=int, default=128,
                        help="bandwidth probe buffer size in MiB (default: 128)")
    parser.add_argument("--n", type=int, default=2048, help="matmul size n (default: 2048)")
    parser.add_argument("--dtype", default="float32",
                        help="matmul dtype: float32, bfloat16, float16 (default: float32)")
    parser.add_argument("--repeats", type=int, default=5, help="counted runs (default: 5)")


def run_command(args: argparse.Namespace) -> int:
    bw = measure_bandwidth(args.device, args.size_mib * 2**20, repeats=args.repeats)
    flops = measure_matmul_flops(args.device, args.n, args.dtype, repeats=args.repeats)
    print(f"device            {args.device} ({torch.get_num_threads()} threads)")
    print(f"memory bandwidth  {bw / 1e9:.1f} GB/s  (copy of {args.size_mib} MiB)")
    print(f"matmul            {flops / 1e9:.1f} GFLOP/s  ({args.n}x{args.n}, {args.dtype})")
    print(f"ridge point       {flops / bw:.1f} FLOP/byte")
    return 0
