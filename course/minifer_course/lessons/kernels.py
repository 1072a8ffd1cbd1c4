"""Kernels: how much of a decode step is not arithmetic (claim OPT-1), and what a tiled,
FlashAttention-style attention saves in memory traffic (claim OPT-2).

OPT-1 is measured with a *twin*: the same model with every matrix shrunk to a few columns
(``n_embd = 2 × n_head``). It runs the same operations in the same order — the same Python, the
same dispatches, the same kernel launches — but with almost no arithmetic and almost no bytes,
so its step time is the part of a real step that is *not* arithmetic. Its share of the real
model's step is that model's overhead. `torch.compile` fuses the small operations between the
matmuls into a few kernels and runs the whole step from one compiled graph: the twin's step
shrinks, and so does the overhead share. Where inductor cannot run (no C++ compiler, an
unsupported platform), :func:`compiled_step` returns the reason instead of raising.

OPT-2's bytes are counted for one head's attention in fp32 (:func:`attention_bytes`): the
plain version writes the ``T × T`` score matrix to memory and reads it back (for the softmax,
then for the product with V); the tiled version streams K and V past each block of queries and
writes only the output, keeping each tile's scores in registers or on-chip memory.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from minifer.cache import StaticKVCache
from minifer.config import GPTConfig
from minifer.fast.compiled import compiled_decode
from minifer.fast.decode import LeanStep
from minifer.generation import decode_step, prefill
from minifer.model import GPT


def twin(config: GPTConfig) -> GPTConfig:
    """`config` with the same layers and heads but ``n_embd = 2 × n_head`` (two dims per
    head): the same graph of operations with next to no arithmetic in it."""
    return config.replace(n_embd=2 * config.n_head)


def step_ms(model: torch.nn.Module, *, context: int = 32, steps: int = 40,
            step: Callable | None = None, fixed_shape: bool = False) -> float:
    """Median time (ms) of one batch-1 decode step with `context` tokens cached.

    The cache is sized ``context + 2`` and rewound after every step, so each step sees the
    same context (and the compiled, fixed-shape step the same shapes). `step` is a compiled
    step from :func:`compiled_step`, by default the eager lean step `generate` runs;
    `fixed_shape` runs that in the compiled one's shape (attention over every cache slot
    through a mask).
    """
    if context < 1 or steps < 1:
        raise ValueError(f"context and steps must be >= 1, got {context} and {steps}")
    device = next(model.parameters()).device
    cache = StaticKVCache.for_model(model, 1, context + 2)
    ids = torch.randint(0, model.config.vocab_size, (1, context),
                        generator=torch.Generator().manual_seed(0)).to(device)
    token = torch.zeros(1, dtype=torch.long, device=device)
    step = step or LeanStep(fixed_shape=fixed_shape)
    times = []
    with torch.inference_mode():
        prefill(model, ids, cache)
        for i in range(steps + 3):  # 3 warm-up steps
            cache.pos = context
            t0 = time.perf_counter()
            decode_step(model, token, cache, step=step)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= 3:
                times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def compiled_step(model: torch.nn.Module, context: int = 32) -> tuple[Callable | None, str]:
    """`minifer.generation.compiled_decode` for `model`, compiled now (one step at `context`).

    Returns ``(step, "")``, or ``(None, reason)`` where `torch.compile` does not work here
    (inductor needs a C++ compiler on a CPU): the lesson then says so and goes on eagerly.
    """
    try:
        step = compiled_decode(model)
        step_ms(model, context=context, steps=1, step=step)
        return step, ""
    except Exception as exc:  # noqa: BLE001 — any failure means "not available here"
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


def overhead_rows(configs: dict[str, GPTConfig], *, context: int = 32, steps: int = 40,
                  seed: int = 0) -> list[dict]:
    """One row per named model: its eager decode step, its twin's, and the twin's share.

    Models are built from `configs` with random weights (timings do not depend on the values).
    """
    rows = []
    for name, config in configs.items():
        model, shadow = GPT.from_config(config, seed=seed), GPT.from_config(twin(config), seed=seed)
        real, bare = step_ms(model, context=context, steps=steps), \
            step_ms(shadow, context=context, steps=steps)
        row = {"model": name, "parameters": model.num_params(), "step ms": real,
               "twin step ms": bare, "outside arithmetic": min(bare / real, 1.0)}
        rows.append(row)
    return rows


def measure_compiled(config: GPTConfig, *, context: int = 32, steps: int = 15, rounds: int = 4,
                     seed: int = 0) -> dict:
    """The OPT-1 comparison for one model: eager and compiled steps of it and its twin.

    Eager runs the compiled step's shape too (``fixed_shape``), so compiled and eager differ
    only in how the operations run. The four are timed turn about, `rounds` times, and each
    keeps its best round (load on a shared machine only ever adds time). Returns the times
    (ms), the overhead share of each, and ``reason`` (non-empty, and no compiled numbers,
    where `torch.compile` failed here).
    """
    model, shadow = GPT.from_config(config, seed=seed), GPT.from_config(twin(config), seed=seed)
    runs: dict[str, Callable[[], float]] = {
        "eager": lambda: step_ms(model, context=context, steps=steps, fixed_shape=True),
        "eager twin": lambda: step_ms(shadow, context=context, steps=steps, fixed_shape=True)}
    reason = ""
    for label, m in (("compiled", model), ("compiled twin", shadow)):
        fn, reason = compiled_step(m, context)
        if fn is None:
            break
        runs[label] = lambda m=m, fn=fn: step_ms(m, context=context, steps=steps, step=fn)
    if reason:
        runs = {k: v for k, v in runs.items() if k.startswith("eager")}
    best = {k: f() for k, f in runs.items()}  # the first round also warms every path
    for _ in range(rounds - 1):
        for k, f in runs.items():
            best[k] = min(best[k], f())
    out = dict(best, reason=reason)
    for kind in ("eager", "compiled"):
        if kind in out:
            out[f"{kind} share"] = min(out[f"{kind} twin"] / out[kind], 1.0)
    return out


def compile_sentence(result: dict) -> str:
    """What compiling did, in words, from :func:`measure_compiled`'s numbers."""
    if result["reason"]:
        return f"torch.compile could not run here ({result['reason']})."
    e, c = result["eager"], result["compiled"]
    change = (f"{e / c:.2f}× faster" if c < e else f"no faster ({c / e:.2f}× eager's time)")
    return (f"Compiled, the step took {c:.3f} ms instead of {e:.3f} ms ({change}); its twin, "
            f"nearly all overhead, {result['compiled twin']:.3f} ms instead of "
            f"{result['eager twin']:.3f} ms. The share outside the arithmetic went from "
            f"{result['eager share']:.0%} to {result['compiled share']:.0%}.")


# ---- OPT-2: bytes moved by attention ----------------------------------------------------------
def attention_bytes(tokens: int, head_dim: int, *, block: int = 128, causal: bool = True,
                    bytes_per_value: int = 4) -> dict[str, int]:
    """Bytes one head's attention over `tokens` tokens moves to and from main memory, two ways.

    - ``plain``: ``S = Q Kᵀ`` reads Q and K and writes the ``T × T`` scores; the softmax reads
      them and writes P; ``P V`` reads P and V and writes the output: the score matrix crosses
      memory four times (a causal mask does not shrink the written-out matrix).
    - ``tiled``: one block of `block` queries at a time — read it, stream the blocks of K and V
      it needs (with `causal`, only those up to its own position), write its output. The
      scores of a tile stay on chip; K and V are read once per query block, which is why
      bigger blocks (more on-chip memory) move fewer bytes.

    ``score matrix`` is the size of one ``T × T`` matrix.
    """
    if tokens < 1 or head_dim < 1 or block < 1 or bytes_per_value < 1:
        raise ValueError(f"tokens, head_dim, block and bytes_per_value must be >= 1, got "
                         f"{tokens}, {head_dim}, {block}, {bytes_per_value}")
    t, d, b = tokens, head_dim, bytes_per_value
    plain = (4 * t * d + 4 * t * t) * b
    kv_rows = sum(min(i + block, t) if causal else t for i in range(0, t, block))
    tiled = (2 * t * d + 2 * kv_rows * d) * b
    return {"plain": plain, "tiled": tiled, "score matrix": t * t * b}
