"""Where code runs: pick the best device, and wait for it.

GPUs run asynchronously: a kernel launch returns before the work is done. Anything that reads a
clock must first `sync` the device, or it times the launch instead of the work.
"""

from __future__ import annotations

import torch


def as_device(device: str | torch.device) -> torch.device:
    """`device` as a `torch.device`, with a clear error for names torch does not know."""
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a torch device such as 'cpu', 'cuda', 'cuda:0' or "
                         f"'mps', got {device!r}") from None


def default_device() -> torch.device:
    """The best device here: CUDA when present, then Apple's MPS, then the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def sync(device: str | torch.device = "cpu") -> None:
    """Wait until ``device`` has finished all queued work (no-op on the CPU, which is synchronous)."""
    dev = as_device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type == "mps":
        torch.mps.synchronize()
