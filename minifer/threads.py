"""How many CPU threads torch should use, on a machine other programs may be using too.

Eager decoding runs ~150 small operations per token, and torch splits each one across its
threads, which then wait for each other at the end of every operation. When another program
holds one of the cores, the thread that landed there arrives late at *every* one of those
waits, and a 2-thread decode can run several times slower than a 1-thread one
(`python -m minifer.bench threads` measures it). Students' laptops are such machines.

`auto_threads` picks the number of cores that are idle right now (read from the kernel's CPU
counters over a short interval, not the load average, which trails by a minute), and
`apply_threads` sets it: ``threads="auto"`` on the benchmark commands. A thread count set once
cannot follow a load that starts later; ``OMP_WAIT_POLICY=passive`` (set before torch starts)
makes threads sleep instead of spinning while they wait, which costs a little on an idle machine
and is measured beside it.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from .checks import check_int

__all__ = ["cpu_times", "idle_cpus", "auto_threads", "apply_threads", "parse_threads"]


def cpu_times() -> tuple[float, float] | None:
    """(idle, total) CPU time since boot over all cores, in clock ticks (Linux /proc/stat;
    None elsewhere)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [float(x) for x in fields[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0.0)  # idle + iowait
    total = sum(ticks[:8])  # user nice system idle iowait irq softirq steal (not guest: in user)
    return idle, total


def idle_cpus(interval: float = 0.2, cpus: int | None = None) -> float:
    """How many of the machine's `cpus` cores were idle over the next `interval` seconds.

    Where the kernel's counters cannot be read, falls back to ``cpus - load average``, and
    to `cpus` where there is no load average either.
    """
    cpus = cpus or os.cpu_count() or 1
    before = cpu_times()
    if before is not None:
        time.sleep(interval)
        after = cpu_times()
        if after is not None and after[1] > before[1]:
            share = (after[0] - before[0]) / (after[1] - before[1])
            return max(0.0, min(1.0, share)) * cpus
    try:
        return max(0.0, cpus - os.getloadavg()[0])
    except (OSError, AttributeError):
        return float(cpus)


def auto_threads(idle: float | None = None, cpus: int | None = None) -> int:
    """The thread count for a machine with `idle` idle cores of `cpus`: the idle cores, rounded,
    at least 1 and at most `cpus` (measured with `idle_cpus` when not given)."""
    cpus = cpus or os.cpu_count() or 1
    idle = idle_cpus(cpus=cpus) if idle is None else idle
    return max(1, min(cpus, int(idle + 0.5)))


def parse_threads(value: str) -> int | str:
    """A ``--threads`` option's value: a positive integer or ``auto`` (for argparse's `type=`)."""
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(
            f"threads must be a positive integer or 'auto', got {value!r}")
    return n


def apply_threads(threads: int | str | None) -> int:
    """Set torch's CPU thread count: an integer as given, ``"auto"`` from `auto_threads`, None
    leaves torch's choice. Returns the count in force."""
    if threads == "auto":
        threads = auto_threads()
    if threads is not None:
        check_int("threads", threads, 1)
        torch.set_num_threads(threads)
    return torch.get_num_threads()
