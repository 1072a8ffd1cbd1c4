"""Honest timing: warm up, synchronise the device, repeat, report the median.

Three habits make a timing trustworthy:

* **warm-up** — the first calls pay for lazy initialisation, memory allocation and (on GPUs)
  kernel selection; they are run but not counted;
* **synchronise** — GPU calls return before the work is done, so the clock is read only after
  :func:`sync` waits for the device;
* **median of repeats** — one slow run (another process, a page fault) should not move the result.

Two probes measure what the roofline needs to know about *this* machine: memory bandwidth
(bytes/s, :func:`measure_bandwidth`) and matmul throughput (FLOP/s, :func:`measure_matmul_flops`).
``python -m minifer.bench probe`` prints both. Numbers in "GB/s" are decimal (1e9 bytes).
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .device import as_device as _device
from .device import sync

__all__ = ["Timing", "sync", "time_fn", "measure_bandwidth", "measure_matmul_flops",
           "Command", "COMMANDS", "COMMAND_MODULES", "register_command", "main"]


@dataclass(frozen=True)
class Timing:
    """The counted runs of :func:`time_fn` (seconds). ``median_s`` is the number to report."""

    times: tuple[float, ...]
    warmup: int

    @property
    def repeats(self) -> int:
        return len(self.times)

    @property
    def median_s(self) -> float:
        return statistics.median(self.times)

    @property
    def min_s(self) -> float:
        return min(self.times)

    @property
    def max_s(self) -> float:
        return max(self.times)

    @property
    def mean_s(self) -> float:
        return statistics.fmean(self.times)

    @property
    def median_ms(self) -> float:
        return self.median_s * 1e3

    def __str__(self) -> str:
        return (f"median {self.median_ms:.3f} ms (min {self.min_s * 1e3:.3f}, "
                f"max {self.max_s * 1e3:.3f}, {self.repeats} runs after {self.warmup} warm-up)")


def time_fn(fn: Callable[[], object], *, warmup: int = 2, repeats: int = 5,
            device: str | torch.device = "cpu") -> Timing:
    """Call ``fn()`` ``warmup`` times uncounted, then ``repeats`` times, each timed with the
    device synchronised before and after; returns all counted times (report the median)."""
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an integer >= 0, got {warmup!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    dev = _device(device)
    for _ in range(warmup):
        fn()
    sync(dev)
    times = []
    for _ in range(repeats):
        sync(dev)
        start = time.perf_counter()
        fn()
        sync(dev)
        times.append(time.perf_counter() - start)
    return Timing(times=tuple(times), warmup=warmup)


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
    memory. Keep ``nbytes`` well above the last-level cache (128 MiB by default; about 0.5 s on a
    2-core laptop) or the probe measures the cache instead.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 4:
        raise ValueError(f"nbytes must be an integer >= 4, got {nbytes!r}")
    dev = _device(device)
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
    the machine's practical peak (n=2048: 17 GFLOP, well under a second on a laptop CPU).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    dev, dt = _device(device), _dtype(dtype)
    with torch.inference_mode():
        gen = torch.Generator(device="cpu").manual_seed(0)
        a = torch.randn(n, n, generator=gen).to(device=dev, dtype=dt)
        b = torch.randn(n, n, generator=gen).to(device=dev, dtype=dt)
        timing = time_fn(lambda: a @ b, warmup=warmup, repeats=repeats, device=dev)
    return 2 * n**3 / timing.median_s


# --------------------------------------------------------------------------------------------
# Command line: `python -m minifer.bench <command>`. Other modules add commands with
# `register_command` (e.g. decode, quant, spec) so one entry point runs every benchmark.
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Command:
    """A subcommand: ``add_arguments(parser)`` declares its options, ``run(args)`` does it."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int | None]


COMMANDS: dict[str, Command] = {}

# Modules that call `register_command` when imported; `main` imports them before parsing.
COMMAND_MODULES: tuple[str, ...] = ("minifer.bench_decode", "minifer.bench_quant", "minifer.bench_spec")


def register_command(name: str, help: str,
                     add_arguments: Callable[[argparse.ArgumentParser], None],
                     run: Callable[[argparse.Namespace], int | None]) -> None:
    """Add a ``python -m minifer.bench NAME`` subcommand."""
    COMMANDS[name] = Command(help=help, add_arguments=add_arguments, run=run)


def _probe_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    parser.add_argument("--size-mib", type=int, default=128,
                        help="bandwidth probe buffer size in MiB (default: 128)")
    parser.add_argument("--n", type=int, default=2048, help="matmul size n (default: 2048)")
    parser.add_argument("--dtype", default="float32",
                        help="matmul dtype: float32, bfloat16, float16 (default: float32)")
    parser.add_argument("--repeats", type=int, default=5, help="counted runs (default: 5)")


def _probe_run(args: argparse.Namespace) -> int:
    bw = measure_bandwidth(args.device, args.size_mib * 2**20, repeats=args.repeats)
    flops = measure_matmul_flops(args.device, args.n, args.dtype, repeats=args.repeats)
    print(f"device            {args.device} ({torch.get_num_threads()} threads)")
    print(f"memory bandwidth  {bw / 1e9:.1f} GB/s  (copy of {args.size_mib} MiB)")
    print(f"matmul            {flops / 1e9:.1f} GFLOP/s  ({args.n}x{args.n}, {args.dtype})")
    print(f"ridge point       {flops / bw:.1f} FLOP/byte")
    return 0


register_command("probe", "measure memory bandwidth and matmul FLOP/s of this machine",
                 _probe_arguments, _probe_run)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m minifer.bench``; returns the exit status."""
    for module in COMMAND_MODULES:
        importlib.import_module(module)
    parser = argparse.ArgumentParser(prog="python -m minifer.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, cmd in COMMANDS.items():
        cmd.add_arguments(sub.add_parser(name, help=cmd.help, description=cmd.help))
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return COMMANDS[args.command].run(args) or 0


if __name__ == "__main__":
    # Run the registry of the importable `minifer.bench`, the one other modules register into
    # (under `python -m` this file is also loaded as `__main__`, with a registry of its own).
    from minifer.bench import main as _main

    sys.exit(_main())
