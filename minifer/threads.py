"""How many CPU threads torch should use, on a machine other programs may be using too.

Eager decoding runs ~150 small operations per token, and torch splits each one across its
threads, which then wait for each other at the end of every operation. When another program
holds one of the cores, the thread that landed there arrives late at *every* one of those
waits, and a 2-thread decode can run several times slower than a 1-thread one
(`python -m minifer.bench threads` measures it). Students' laptops are such machines.

`auto_threads` picks the number of cores that are idle right now (read from the kernel's CPU
counters over a short interval, not the load average, which trails by a minute), and
`apply_threads` sets it: ``threads="auto"`` on the benchmark commands. A count set once cannot
follow a load that starts later, so a long-running program (the server) keeps a
`ThreadGovernor`, which looks again every second at how many cores *other* programs used (all
busy time less this process's own) and re-sets the count between steps. `generate` on a CPU
uses one too, deciding every second of work, by default only to go *below* the count
in force (a busy core takes a thread away, and gives it back when it is free again; a count
you set is a ceiling, restored after the call); ``threads=n`` fixes the count, and
``threads="auto"`` lets it use every idle core.
``OMP_WAIT_POLICY=passive`` (set before torch starts) makes threads sleep instead of spinning
while they wait; `python -m minifer.bench threads` measures it beside the counts.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from .checks import check_int

__all__ = ["cpu_times", "idle_cpus", "auto_threads", "apply_threads", "parse_threads",
           "ThreadGovernor", "shared_governor"]


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


class ThreadGovernor:
    """Keeps torch's thread count at the number of cores other programs leave free.

    Call `maybe_adjust()` between steps of work. At most every `sample_s` it reads the kernel's
    CPU counters and this process's CPU time (else it only reads the clock); once the readings
    cover `period_s` of work, the cores the *others* used over them (all busy time less our
    own) decide the count: `auto_threads` of what they left, at most `ceiling`. That decision
    holds, and is applied at every call, until the next one. Call `resume()` when work starts
    again after a pause (each `generate` call does): what other programs did while we were not
    running says little about now, so the pause is left out and the last decision stands.
    `maybe_adjust` returns the new count when it changed it. Where the counters cannot be read
    it never changes anything.
    """

    def __init__(self, cpus: int | None = None, period_s: float = 1.0, *,
                 counters=cpu_times, own_cpu_s=time.process_time, clock=time.monotonic,
                 ticks_per_s: float | None = None, sample_s: float = 0.05) -> None:
        self.cpus = cpus or os.cpu_count() or 1
        self.period_s, self.sample_s = period_s, sample_s
        self._counters, self._own, self._clock = counters, own_cpu_s, clock
        if ticks_per_s is None:
            try:
                ticks_per_s = float(os.sysconf("SC_CLK_TCK"))
            except (ValueError, OSError, AttributeError):
                ticks_per_s = 100.0
        self._hz = ticks_per_s
        # the last reading: (clock, (idle, total) ticks, own CPU seconds)
        self._mark: tuple[float, tuple[float, float], float] | None = None
        self._window = [0.0, 0.0, 0.0, 0.0]  # since the last decision: total, idle ticks, own s, wall s
        self.others_busy: float | None = None  # cores the others used over the last period
        self.changes = 0

    def _read(self) -> tuple[float, tuple[float, float], float] | None:
        counters = self._counters()
        return None if counters is None else (self._clock(), counters, self._own())

    def resume(self) -> None:
        """Work starts again after a pause: the pause is not counted."""
        self._mark = self._read()

    def maybe_adjust(self, ceiling: int | None = None) -> int | None:
        """Read the counters if `sample_s` has passed, decide again once they cover
        `period_s`, and set the decided count (at most `ceiling`, the count a caller chose);
        returns the new count when it changed it."""
        if self._mark is None or self._clock() - self._mark[0] >= self.sample_s:
            reading = self._read()
            if reading is not None:
                if self._mark is not None:
                    self._count(self._mark, reading)
                self._mark = reading
        if self.others_busy is None:
            return None
        want = auto_threads(idle=self.cpus - self.others_busy, cpus=self.cpus)
        if ceiling is not None:
            want = min(want, ceiling)
        if want == torch.get_num_threads():
            return None
        torch.set_num_threads(want)
        self.changes += 1
        return want

    def _count(self, before, after) -> None:
        """Add the work between two readings to the window; decide when it covers a period."""
        w = self._window
        w[0] += after[1][1] - before[1][1]
        w[1] += after[1][0] - before[1][0]
        w[2] += after[2] - before[2]
        w[3] += after[0] - before[0]
        if w[3] < self.period_s or w[0] <= 0:
            return
        elapsed = w[0] / self._hz / self.cpus  # seconds of wall time the counters cover
        others = max(0.0, (w[0] - w[1]) / self._hz - w[2])
        self.others_busy = min(float(self.cpus), others / elapsed)
        self._window = [0.0, 0.0, 0.0, 0.0]


_shared: ThreadGovernor | None = None
# A second of work, as the server: at 2 cores, 200 clock ticks, so a brief burst of another
# program does not read as a busy core (a quarter second was tried; BENCHMARKS.md).
GENERATE_PERIOD_S = 1.0


def shared_governor() -> ThreadGovernor:
    """The process's one `ThreadGovernor` for `generate` on a CPU, deciding after every
    `GENERATE_PERIOD_S` of work. It is kept between calls, so a program that generates many
    short answers still gets its decisions. By default `generate` only lets it lower the count
    (never above the one in force when the call began, which it restores after); with
    ``threads="auto"`` it may raise it to every idle core, and the count it sets stays in force
    after the call, as the server's does."""
    global _shared
    if _shared is None:
        _shared = ThreadGovernor(period_s=GENERATE_PERIOD_S)
    return _shared
