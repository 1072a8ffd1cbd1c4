"""How minifer runs fast on a CPU: every speed-up, each beside the reference it must equal.

The core (`minifer.model`, `generation`, `sampling`, ...) is the readable engine; it calls the
plain functions of one seam, `minifer.hooks`. This package fills that seam with faster versions
(`install`, which ``import minifer`` runs) and holds the speed-ups a user asks for by name:

| speed-up | reference it equals | plugs in at |
|---|---|---|
| `threads`: the thread governor, with ``threads="auto"`` (fewer threads while other programs hold cores) | torch's thread count as set | `hooks.generation_threads`, `hooks.serving_threads` |
| `decode`: the lean decode step (no per-step checks, the write slot in a tensor; fixed-shape for compiling) | the forward pass ``model(tokens, cache=cache)`` | `hooks.decode_function` |
| `compiled`: the decode step compiled by `torch.compile` (frozen weights on a CPU) | the eager lean step | `hooks.decode_function` (``compile=True``) |
| `argmax`: the greedy argmax in chunks | ``logits.argmax(-1)`` | `hooks.argmax` |
| `layout`: column-major linear weights, or fp32 layers on oneDNN where MKL runs its generic code (a non-Intel CPU) | torch's row-major layout, `F.linear` | `hooks.lay_out_weights` |
| `prepack`: linear weights prepacked for oneDNN | `F.linear` | `minifer.prepack(model)`; bf16: `hooks.prepare_bf16` |
| `paged`: the serving step's attention planned once per step, decode rows batched | `PackedBatch.attend_rows` | `hooks.packed_attention` |
| `int8_gemv`: minifer's AVX512-VNNI kernels for int8 rows (one; several, packed) | `int8_gemv.w8a8_reference` | `hooks.int8_matmul` (W8A8 layers) |
| `bf16_gemv`: minifer's AVX512-BF16 kernel for one bf16 row | `bf16_gemv.bf16_reference` | prepacked bf16 layers |
| `avx2`: W8A8 and bf16 rows on CPUs with AVX2 but not those AVX-512 kernels; a few fp32 rows (16 with AVX-512, else 4) on `layout`'s oneDNN layers | their references, `F.linear` | `hooks.int8_matmul`, bf16 and `layout`'s layers |
| `paged_attention`: decode attention in C++, each row as alone (generate's cache; the engine's pool) | SDPA, a padded batch row by row | `hooks.decode_attention` |
| `invariant`: batch-invariant kernels (token-wise layers in fixed blocks of rows, attention one query at a time) | the model's own layers | `hooks.batch_invariant` (``batch_invariant=True``) |
| `native`: the C++ build of those kernels | | |

With the speed-ups off (``with minifer.fast.disabled():``, or ``MINIFER_SPEEDUPS=0`` in the
environment before ``import minifer``) everything works the same way, with the same greedy
tokens, only slower: the code that runs is then the code you read.
A bf16 model gets prepacked layers by default where oneDNN packs bf16 (plain bf16 decodes
slower than fp32 at batch 1), at the cost of a second copy of the weights (`minifer.fast.prepack`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from .. import hooks
from .argmax import first_argmax
from .compiled import decode_function
from .int8_gemv import int8_matmul
from .invariant import batch_invariant
from .layout import lay_out_weights
from .paged import packed_attention
from .paged_attention import decode_attention
from .prepack import prepare_bf16
from .threads import generation_threads, serving_threads

__all__ = ["install", "disabled", "installed"]

SEAM = ("argmax", "batch_invariant", "decode_attention", "decode_function", "generation_threads",
        "int8_matmul", "lay_out_weights", "packed_attention", "prepare_bf16", "serving_threads")
_PLAIN = {name: getattr(hooks, name) for name in SEAM}
_FAST = dict(zip(SEAM, (first_argmax, batch_invariant, decode_attention, decode_function,
                        generation_threads, int8_matmul, lay_out_weights, packed_attention,
                        prepare_bf16, serving_threads)))


def install() -> None:
    """Put the speed-ups into `minifer.hooks` (unless ``MINIFER_SPEEDUPS=0``)."""
    if os.environ.get("MINIFER_SPEEDUPS", "1") != "0":
        for name, fn in _FAST.items():
            setattr(hooks, name, fn)


def installed() -> bool:
    """Whether the seam holds the speed-ups now."""
    return all(getattr(hooks, name) is fn for name, fn in _FAST.items())


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run the core's plain reference path inside the block; the seam is restored after."""
    before = {name: getattr(hooks, name) for name in SEAM}
    for name, fn in _PLAIN.items():
        setattr(hooks, name, fn)
    try:
        yield
    finally:
        for name, fn in before.items():
            setattr(hooks, name, fn)
