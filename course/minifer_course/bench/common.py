"""What every benchmark shares: seeded random inputs and a description of the machine it ran on.

A timing means little without its circumstances, so each benchmark records the CPU, torch's
thread count and the load average (`machine_info`, `loadavg`), and warns before it starts when
other programs already keep the CPUs busy (`busy_warning`). The token ids a benchmark feeds come
from `random_ids`: seeded, since a step's time does not depend on which ids it reads.
"""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import sys
from collections.abc import Iterator

import torch

from minifer.checks import check_int

__all__ = ["random_ids", "busy_warning", "loadavg", "machine_info", "background_load", "cpu_seconds"]


def random_ids(batch: int, tokens: int, vocab_size: int, seed: int = 0,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """``(batch, tokens)`` random token ids, seeded (timings do not depend on which ids)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, tokens), generator=gen).to(device)


def busy_warning(threads: int) -> str | None:
    """A warning when other programs already keep the CPUs busy: torch's threads then wait for
    each other at every operation and CPU timings can come out many times too slow."""
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):  # not available on this platform
        return None
    cpus = os.cpu_count() or 1
    if load + threads <= cpus + 0.5:
        return None
    fewer = max(1, cpus - round(load))
    advice = (f"consider --threads {fewer}" if fewer < threads else
              "expect slower, noisier timings than on an idle machine (ratios measured in one "
              "run hold up better)")
    return (f"note: this machine is busy (load average {load:.1f} on {cpus} CPUs); {threads} "
            f"thread(s) will compete with it and the timings will suffer; {advice}")


def loadavg() -> list[float] | None:
    """The 1, 5 and 15-minute load averages, rounded (None where the platform has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def machine_info() -> dict:
    """CPU model, core count, torch version and threads: what a table's numbers depend on."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu": model, "cpus": os.cpu_count(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "python": platform.python_version()}


@contextlib.contextmanager
def background_load(cores: int, max_s: float = 600.0) -> Iterator[list[int]]:
    """`cores` processes that each keep one core busy while the block runs (each also stops by
    itself after `max_s` seconds, so none outlives a crashed benchmark for long); yields their
    process ids (for `cpu_seconds`)."""
    check_int("cores", cores, 0)
    spin = f"import time\nend = time.monotonic() + {max_s}\nwhile time.monotonic() < end: pass"
    procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(cores)]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def cpu_seconds(pids: list[int], descendants: bool = True) -> float | None:
    """CPU time (user + system, seconds) the processes `pids` have used so far, with their
    descendants' (a server's engine processes), read from ``/proc``; None where there is no
    ``/proc`` (not Linux). Two readings around a run say where the machine's time went: the
    server's CPU per output token, and how much of the cores a background load took."""
    if not os.path.isdir("/proc/self/task"):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    table: dict[int, tuple[int, float]] = {}  # pid -> (parent, cpu seconds)
    for name in os.listdir("/proc") if descendants else map(str, pids):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces
        except OSError:  # gone meanwhile
            continue
        table[int(name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    wanted, frontier = set(pids), list(pids)
    while descendants and frontier:
        parent = frontier.pop()
        for pid, (ppid, _) in table.items():
            if ppid == parent and pid not in wanted:
                wanted.add(pid)
                frontier.append(pid)
    return sum(table[p][1] for p in wanted if p in table)
