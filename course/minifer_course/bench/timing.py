"""Honest timing: warm up, synchronise the device, repeat, report the median.

Three habits make a timing trustworthy:

* **warm-up** — the first calls pay for lazy initialisation, memory allocation and (on GPUs)
  kernel selection; they are run but not counted;
* **synchronise** — GPU calls return before the work is done, so the clock is read only after
  :func:`sync` waits for the device;
* **median of repeats** — one slow run (another process, a page fault) should not move the result.

When several things are compared, :func:`round_robin` times them in turn (a, b, c, a, b, c, …)
so a slow spell of the machine hits all of them alike, and their ratio survives a busy machine.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from minifer.checks import check_int
from minifer.device import as_device, sync

__all__ = ["Timing", "sync", "time_fn", "round_robin"]


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
    _check_counts(warmup, repeats)
    dev = as_device(device)
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


def round_robin(fns: Sequence[Callable[[], object]], *, warmup: int = 1, repeats: int = 5,
                calls: int = 1, device: str | torch.device = "cpu") -> list[float]:
    """Median seconds per call of each function, timed in turn (a, b, c, a, b, c, …).

    Each of `repeats` rounds times `calls` consecutive calls of every function (after `warmup`
    uncounted rounds), with the device synchronised around each timing; returns the median
    over rounds of the seconds per call, one per function.
    """
    _check_counts(warmup, repeats)
    check_int("calls", calls, 1)
    dev = as_device(device)
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            sync(dev)
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            sync(dev)
            times[i].append((time.perf_counter() - start) / calls)
    return [statistics.median(t) for t in times]


def _check_counts(warmup: int, repeats: int) -> None:
    check_int("warmup", warmup, 0)
    check_int("repeats", repeats, 1)
