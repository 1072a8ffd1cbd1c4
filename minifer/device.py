"""Where code runs: pick the best device, and wait for it.

GPUs run asynchronously: a kernel launch returns before the work is done. Anything that reads a
clock must first `sync` the device, or it times the launch instead of the work."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import torch


def as_device(device: str | torch.device | int) -> torch.device:
    """`device` as a `torch.device`, checked to exist here: a name torch does not know, or an
    accelerator this machine (or this torch) lacks, is a ValueError naming `device`."""
    bad = f"device must be a torch device such as 'cpu', 'cuda', 'cuda:0' or 'mps', got {device!r}"
    if isinstance(device, bool) or not isinstance(device, (str, torch.device, int)):
        raise ValueError(bad)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        if isinstance(device, int):
            raise ValueError(f"device={device!r} is not available: an integer names an "
                             f"accelerator, and this machine has none; use 'cpu'") from None
        raise ValueError(bad) from None
    if dev.type not in ("cpu", "meta"):
        _check_available(dev, device)
    return dev


def _check_available(dev: torch.device, device) -> None:
    """A ValueError naming `device` unless this machine has the accelerator `dev`."""
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch is built without CUDA" if torch.version.cuda is None
                   else "no CUDA GPU is visible")
            raise ValueError(f"device={device!r} is not available: {why}; use 'cpu' "
                             f"(or minifer.default_device())")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"device={device!r} is not available: this machine has {count} "
                             f"CUDA device(s), cuda:0 to cuda:{count - 1}")
    elif dev.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise ValueError(f"device={device!r} is not available: Apple's MPS backend is not "
                             f"available here; use 'cpu' (or minifer.default_device())")
    else:
        backend = getattr(torch, dev.type, None)  # e.g. torch.xpu
        available = getattr(backend, "is_available", None)
        if available is not None and not available():
            raise ValueError(f"device={device!r} is not available on this machine; use 'cpu'")


def default_device() -> torch.device:
    """The best device here: CUDA when present, then Apple's MPS, then the CPU."""
    mps = getattr(torch.backends, "mps", None)
    if torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("mps" if mps is not None and mps.is_available() else "cpu")


def sync(device: str | torch.device = "cpu") -> None:
    """Wait until ``device`` has finished all queued work (no-op on the CPU, which is synchronous)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type == "mps":
        torch.mps.synchronize()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags of this CPU as Linux lists them (x86's ``flags``, Arm's
    ``Features``; empty where it does not)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    match = re.search(r"^(?:flags|Features)\s*:(.*)$", text, re.MULTILINE)
    return frozenset(match.group(1).split()) if match else frozenset()


MEMINFO, STATM, SELF_CGROUP = (Path(f"/proc/{n}") for n in ("meminfo", "self/statm", "self/cgroup"))
CGROUP = Path("/sys/fs/cgroup")


def _cgroup_files() -> list[tuple[Path, Path]]:
    """(limit, usage) files of the root memory cgroup and this process's own, v2 and v1."""
    own = [line.split(":", 2) for line in _text(SELF_CGROUP).splitlines()]
    v2 = {""} | {path.strip("/") for _, kinds, path in own if kinds == ""}
    v1 = {""} | {path.strip("/") for _, kinds, path in own if "memory" in kinds.split(",")}
    return ([(CGROUP / d / "memory.max", CGROUP / d / "memory.current") for d in v2] + [
        (CGROUP / "memory" / d / "memory.limit_in_bytes",
         CGROUP / "memory" / d / "memory.usage_in_bytes") for d in v1])


def available_memory(device: str | torch.device = "cpu") -> int:
    """Bytes `device` can still allocate: free GPU memory; on the CPU the least of Linux's
    MemAvailable (else half the RAM), a memory cgroup's limit less its usage (`_cgroup_files`;
    "max" is none) and RLIMIT_AS less this process's virtual size (a container, ``ulimit -v``)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import resource  # POSIX only

    page = os.sysconf("SC_PAGE_SIZE")
    found = re.search(r"^MemAvailable:\s+(\d+) kB", _text(MEMINFO), re.MULTILINE)
    room = [int(found.group(1)) * 1024 if found else os.sysconf("SC_PHYS_PAGES") * page // 2]
    for limit, usage in ((_text(a).strip(), _text(b).strip()) for a, b in _cgroup_files()):
        if limit.isdigit() and usage.isdigit():
            room.append(int(limit) - int(usage))
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft != resource.RLIM_INFINITY:
        room.append(soft - int((_text(STATM).split() or [0])[0]) * page)
    return max(0, min(room))


def _text(path: Path) -> str:
    """`path`'s text ("" where there is no such file)."""
    return path.read_text() if path.is_file() else ""
