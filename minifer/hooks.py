"""The one seam where speed-ups plug into the core.

The core calls the functions below where a faster way exists (argmax, the decode step, thread
counts, W8A8 products, batch-invariant kernels, weight layout, paged attention, new bf16 layers).
Here each is the plain reference; `minifer.fast` (its docstring says how to turn it off) fills
the seam with speed-ups, each tested equal to what it replaces; no core module imports it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from .checks import check_threads

__all__ = ["argmax", "batch_invariant", "decode_attention", "decode_function",
           "generation_threads", "int8_matmul", "lay_out_weights", "packed_attention",
           "prepare_bf16", "serving_threads"]


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """The greedy token of each row of ``(B, V)`` logits: the first index of its maximum."""
    return logits.argmax(dim=-1)  # (B,)


@contextlib.contextmanager
def batch_invariant(model: torch.nn.Module, on: bool) -> Iterator[None]:
    """Around one generation call: with `on`, `model` computes each row as it would alone,
    cached or recomputed (``generate(..., batch_invariant=True)``). Plain: only ``on=False``;
    the kernels that make a row's sums independent of its batch are the speed-up package's
    (`minifer.fast.invariant`), so with the speed-ups off ``on=True`` is a ValueError."""
    if on:
        raise ValueError("batch_invariant=True needs minifer.fast's batch-invariant kernels, "
                         "which are off (MINIFER_SPEEDUPS=0 or inside minifer.fast.disabled())")
    yield


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     starts: list[int] | None) -> torch.Tensor:
    """A decode step's attention, each row as it computes alone: queries `q` ``(B, kv_heads, g,
    hd)`` over the cached `k`, `v` ``(B, kv_heads, S, hd)``, row b over its own slots
    ``starts[b]..`` (None: every slot). One call for an unpadded batch (SDPA keeps its rows
    apart), one per row for a padded one. (`minifer.fast.paged_attention` has a C++ kernel.)"""
    if starts is None:
        return F.scaled_dot_product_attention(q, k, v)
    return torch.cat([F.scaled_dot_product_attention(q[b:b + 1], k[b:b + 1, :, s:],
                                                     v[b:b + 1, :, s:])
                      for b, s in enumerate(starts)])


def decode_function(model: torch.nn.Module, cache, compile: bool | str) -> Callable | None:
    """The decode step a generation call runs (see `generation.decode_step`): None runs the
    forward pass ``model(tokens, cache=cache)``, with ``compile`` or without."""
    return None


@contextlib.contextmanager
def generation_threads(threads: int | str | None, device: torch.device | str
                       ) -> Iterator[Callable[[], None]]:
    """Around one generation call: torch's CPU thread count, and a hook to call between steps.

    Plain: an integer fixes torch's count for the call (restored after it); None or ``"auto"``
    leave it as it is."""
    threads = check_threads(threads)  # a NumPy integer comes back as an int
    restore = None
    if isinstance(threads, int):
        restore = torch.get_num_threads()
        torch.set_num_threads(threads)
    try:
        yield lambda: None
    finally:
        if restore is not None:
            torch.set_num_threads(restore)


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                rowsum: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """A W8A8 layer's product ``x`` [M, K] by its int8 weight, or None: the layer then computes
    `quantization.w8a8_reference`. (`minifer.fast.int8_gemv` gives the same numbers faster.)"""
    return None


def lay_out_weights(model: torch.nn.Module) -> None:
    """Called by a new `GPT` on itself: the weights stay in torch's default layout."""


def packed_attention(pool) -> Callable | None:
    """Called by a new `PagedKVPool`: how the packed steps over it attend. None runs each
    step's per-row reference, `PackedBatch.attend_rows`. (`minifer.fast.paged` returns a
    planner, ``planner(batch)(layer, q)``, that plans a step's reads once for all its layers and
    batches the decode rows; a kernel it uses is built here, when the engine starts.)"""
    return None


def prepare_bf16(model: torch.nn.Module) -> None:
    """Called on a new bf16 model (``quantize(model, "bf16")``, a checkpoint loaded in bf16):
    its layers stay plain `nn.Linear` (`minifer.fast` prepacks them where that is faster)."""


def serving_threads(threads: int | str | None) -> Callable[[], int | None]:
    """Called by the serving engine's loop in its own thread before its first step: torch's
    count there (an integer: that count; None or ``"auto"``: as it is), and the hook the loop
    calls between steps, which returns a new count when it set one, else None."""
    threads = check_threads(threads)
    if isinstance(threads, int):
        torch.set_num_threads(threads)
    return lambda: None
