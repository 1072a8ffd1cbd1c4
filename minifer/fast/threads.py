"""How many CPU threads torch should use, on a machine other programs may be using too.

Eager decoding runs many small operations per token, and torch's threads wait for each other at
the end of every one. When another program holds one of the cores, the thread that landed there
arrives late at *every* wait, and a 2-thread decode can run several times slower than a 1-thread
one. Students' laptops are such machines.

`auto_threads` picks the cores idle right now (the kernel's CPU counters over a short interval,
not the lagging load average); `apply_threads` sets it. A count set once cannot follow a load
that starts later, so with ``threads="auto"`` a long-running loop (`serving_threads`,
`generation_threads`) keeps a `ThreadGovernor`, which re-sets the count between steps: one
fewer as soon as its threads wait for a core, one back after a second of work in which the
*other* programs left a core free. ``OMP_WAIT_POLICY=passive`` makes waiting threads sleep."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..checks import check_threads

__all__ = ["cpu_times", "run_queue_wait", "idle_cpus", "auto_threads", "apply_threads",
           "ThreadGovernor", "shared_governor", "generation_threads", "serving_threads"]


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
    to `cpus` where there is no load average either."""
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


def apply_threads(threads: int | str | None) -> int:
    """Set torch's CPU thread count: an integer as given, ``"auto"`` from `auto_threads`, None
    leaves torch's choice. Returns the count in force."""
    if threads == "auto":
        threads = auto_threads()
    if threads is not None:
        check_threads(threads)
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def run_queue_wait() -> float | None:
    """Seconds this process's threads have spent ready to run but waiting for a core, summed
    over its threads (Linux ``/proc/self/task/*/schedstat``; None elsewhere; always 0 where the
    kernel keeps no scheduler statistics).

    It is the direct sign of a core taken by someone else. The CPU counters (`cpu_times`) see
    it late: spinning threads crowd the other program out, so it shows as less than it wants."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    total, found = 0, False
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])  # run time, run-queue wait (ns), time slices
            found = True
        except (OSError, IndexError, ValueError):  # the thread ended meanwhile
            continue
    return total / 1e9 if found else None


@dataclass(frozen=True)
class _Reading:
    clock: float  # seconds
    idle_ticks: float  # the machine's, since boot
    total_ticks: float
    own_cpu_s: float  # this process's CPU time
    waited_s: float  # this process's threads' run-queue wait (0 where unknown)


@dataclass
class _Window:
    """The work between readings over a stretch of them, summed."""
    wall_s: float = 0.0
    total_ticks: float = 0.0
    idle_ticks: float = 0.0
    own_cpu_s: float = 0.0
    waited_s: float = 0.0

    def add(self, before: _Reading, after: _Reading) -> None:
        self.wall_s += after.clock - before.clock
        self.total_ticks += after.total_ticks - before.total_ticks
        self.idle_ticks += after.idle_ticks - before.idle_ticks
        self.own_cpu_s += after.own_cpu_s - before.own_cpu_s
        self.waited_s += max(0.0, after.waited_s - before.waited_s)  # an ended thread's leaves


# Our threads waiting for a core this much of the time (cores' worth): another program wants
# about half a core or more; threads alone wait next to nothing.
CONTENDED = 0.35


class ThreadGovernor:
    """Keeps torch's thread count at the number of cores other programs leave free.

    Call `maybe_adjust()` between steps of work; at most every `sample_s` it reads the kernel's
    CPU counters, this process's CPU time and its threads' wait for a core. Two signals decide:

    - *Our threads wait for a core* (`run_queue_wait`) `CONTENDED` of a `sample_s` or more: one
      thread fewer at once (a load that starts must be met within a fraction of a second).
    - *The cores the others used* (all busy time less our own): once the readings cover
      `period_s` of work, `auto_threads` of what they left, at most `ceiling`: a thread back
      when a core comes free, fewer where the wait cannot be read; a `quick_s` already showing
      the others clearly on a core we use (a quarter core over the rounding) decides at once.

    A decision holds until the next one. `pause()` when work stops and `resume()` when it starts
    again leave the pause out. Where the counters cannot be read it never changes anything."""

    def __init__(self, cpus: int | None = None, period_s: float = 1.0, *,
                 counters=cpu_times, own_cpu_s=time.process_time, waited_s=run_queue_wait,
                 clock=time.monotonic, ticks_per_s: float | None = None,
                 sample_s: float = 0.05, quick_s: float = 0.1) -> None:
        self.cpus = cpus or os.cpu_count() or 1
        self.period_s, self.sample_s, self.quick_s = period_s, sample_s, quick_s
        self._counters, self._own, self._waited, self._clock = counters, own_cpu_s, waited_s, clock
        if ticks_per_s is None:
            try:
                ticks_per_s = float(os.sysconf("SC_CLK_TCK"))
            except (ValueError, OSError, AttributeError):
                ticks_per_s = 100.0
        self._hz = ticks_per_s
        self._mark: _Reading | None = None
        self._lock = threading.Lock()  # ranks of tensor parallelism in threads share it
        self._window = _Window()  # since the last decision
        self._recent = _Window()  # the last `quick_s`
        self.decided: int | None = None  # the count decided last, before a caller's ceiling
        self.others_busy: float | None = None  # cores the others used over the last window
        self.waiting: float | None = None  # cores' worth of our threads' wait, last window
        self.changes = 0

    def _read(self) -> _Reading | None:
        counters = self._counters()
        if counters is None:
            return None
        waited = self._waited()
        return _Reading(self._clock(), counters[0], counters[1], self._own(),
                        0.0 if waited is None else waited)

    def resume(self) -> None:
        """Work starts again after a pause: the pause is not counted."""
        with self._lock:
            self._mark = self._read()

    def pause(self) -> None:
        """Work stops for now: the work since the last reading counts (for a short call, it is
        all there is), and may decide the count for the next `resume`."""
        with self._lock:
            reading = self._read() if self._mark is not None else None
            if reading is not None:
                self._count(self._mark, reading)
            self._mark = None

    def _count(self, before: _Reading, after: _Reading) -> None:
        self._window.add(before, after)
        self._recent.add(before, after)
        self._decide()

    def maybe_adjust(self, ceiling: int | None = None) -> int | None:
        """Read the counters if `sample_s` has passed, decide again when a window shows a
        reason to, and set the decided count (at most `ceiling`, the count a caller chose);
        returns the new count when it changed it."""
        with self._lock:
            if self._mark is None or self._clock() - self._mark.clock >= self.sample_s:
                reading = self._read()
                if reading is not None:
                    if self._mark is not None:
                        self._count(self._mark, reading)
                    self._mark = reading
            if self.decided is None:
                return None
            want = self.decided if ceiling is None else min(self.decided, ceiling)
            if want == torch.get_num_threads():
                return None
            torch.set_num_threads(want)
            self.changes += 1
            return want

    def _decide(self) -> None:
        """Decide if the last readings (from `sample_s` on: the wait is read to the nanosecond)
        or the window since the last decision show a reason to. The recent readings start
        again after each look at them, the window at a decision."""
        recent, window = self._recent, self._window
        if recent.wall_s < min(self.sample_s, self.quick_s, self.period_s) or recent.wall_s <= 0:
            return
        now = torch.get_num_threads()
        waiting = recent.waited_s / recent.wall_s
        if waiting >= CONTENDED and now > 1:
            decided, others = now - 1, self._others(recent)
        elif recent.wall_s < min(self.quick_s, self.period_s):
            return  # the clock ticks need a longer look
        else:
            others = self._others(recent)
            if auto_threads(idle=self.cpus - others + 0.25, cpus=self.cpus) < now:
                decided = auto_threads(idle=self.cpus - others, cpus=self.cpus)
            elif window.wall_s >= self.period_s:
                others, waiting = self._others(window), window.waited_s / window.wall_s
                decided = auto_threads(idle=self.cpus - others, cpus=self.cpus)
            else:
                self._recent = _Window()
                return
        self.decided, self.others_busy, self.waiting = decided, others, waiting
        self._window, self._recent = _Window(), _Window()

    def _others(self, w: _Window) -> float:
        """Cores the other programs used over `w`: all busy time less our own."""
        if w.total_ticks <= 0:
            return 0.0
        elapsed = w.total_ticks / self._hz / self.cpus  # seconds of wall time the counters cover
        busy = (w.total_ticks - w.idle_ticks) / self._hz
        return min(float(self.cpus), max(0.0, busy - w.own_cpu_s) / elapsed)


_shared: ThreadGovernor | None = None
GENERATE_PERIOD_S = 1.0  # long enough that a brief burst of another program is not a busy core


def shared_governor() -> ThreadGovernor:
    """The process's one `ThreadGovernor` for ``generate(threads="auto")``, deciding after every
    `GENERATE_PERIOD_S` of work. It is kept between calls, so a program that generates many
    short answers still gets its decisions; the count it sets stays in force after the call,
    as the server's does."""
    global _shared
    _shared = ThreadGovernor(period_s=GENERATE_PERIOD_S) if _shared is None else _shared
    return _shared


@contextlib.contextmanager
def generation_threads(threads: int | str | None, device: torch.device | str = "cpu"
                       ) -> Iterator[Callable[[], None]]:
    """`hooks.generation_threads` of the speed-up package: as the plain hook, an integer fixes
    torch's count for the call and None leaves it; ``"auto"``: the shared governor, up to every
    idle core, asked before every step (the hook the loop calls)."""
    if threads == "auto":
        governor = shared_governor()
        governor.resume()  # the pause since its last call is not counted
        governor.maybe_adjust()
        try:
            yield governor.maybe_adjust
        finally:
            governor.pause()  # the steps since its last reading count (a short call has no other)
        return
    restore = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(check_threads(threads))
    try:
        yield _no_adjustment
    finally:
        torch.set_num_threads(restore)


def _no_adjustment() -> None:
    """Between steps with a fixed count: nothing to do."""


def serving_threads(threads: int | str | None) -> Callable[[], int | None]:
    """`hooks.serving_threads` of the speed-up package: as the plain hook, and ``"auto"``: the
    idle cores now, then a `ThreadGovernor` asked between steps (its new count, or None)."""
    apply_threads(threads)
    return ThreadGovernor().maybe_adjust if threads == "auto" else (lambda: None)
