"""Bytes and decode speed per precision, measured: ``python -m minifer_course.bench quant``.

For a model shape (random weights; timings do not depend on their values) in each precision:
the bytes it stores and the decode tokens/s per batch size, each as a ratio to fp32 measured in
the same run (median step after warm-up, the variants timed round-robin).

By default a quick scope answers the issue's question — GPT-2 124M's shape at batch 1 in fp32,
bf16, int8/int4 on torch's fused weight-only kernels (which read the integers directly), int8
W8A8 on the CPU's integer units (``impl="integer"``), and int8 as `quantize` picks it by default
(``impl="auto"``: the faster of the two per layer shape, timed here). ``--full`` adds
fp16, batch 32 and the reference dequantize-then-matmul paths (which rebuild a float weight at
every call — honest, and slow).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from minifer import hooks
from minifer.cache import StaticKVCache
from minifer.generation import decode_step
from minifer.model import GPT
from minifer.quantization import integer_problem, model_bytes, quantize

from .baselines import random_past
from .common import random_ids
from .timing import round_robin

__all__ = ["VARIANTS", "QUICK_VARIANTS", "QuantRow", "variant_model", "time_variants", "run",
           "format_report"]

# (label, precision, impl) — impl None for the float precisions
VARIANTS: tuple[tuple[str, str, str | None], ...] = (
    ("fp32", "fp32", None),
    ("bf16", "bf16", None),
    ("fp16", "fp16", None),
    ("int8 fused", "int8", "fused"),
    ("int8 integer", "int8", "integer"),
    ("int8 auto", "int8", "auto"),
    ("int8 dequant", "int8", "reference"),
    ("int4 fused", "int4", "auto"),
    ("int4 dequant", "int4", "reference"),
)
QUICK_VARIANTS = tuple(v for v in VARIANTS
                       if v[0] in ("fp32", "bf16", "int8 fused", "int8 integer", "int8 auto",
                                   "int4 fused"))


@dataclass(frozen=True)
class QuantRow:
    label: str
    total_bytes: int
    linear_bytes: int
    ms_per_step: dict[int, float]  # batch -> median ms per decode step
    batch_tokens_per_s: dict[int, float]  # batch -> tokens/s (batch / step time)


def variant_model(model: torch.nn.Module, precision: str, impl: str | None,
                  group_size: int = 128) -> torch.nn.Module:
    """`model` in one of the `VARIANTS` (fused falls back to the reference path, layer by layer
    or, without a fused kernel in this torch, entirely)."""
    if impl is None:
        return quantize(model, precision)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return quantize(model, precision, impl=impl, group_size=group_size)
        except RuntimeError:
            if impl != "fused":
                raise
            return quantize(model, precision, impl="reference", group_size=group_size)


def _stepper(model: torch.nn.Module, batch: int, context: int):
    """A function that runs one decode step at ``context`` cached tokens (then rolls it back).

    The cache holds random K/V (`baselines.random_past`) rather than a prefilled prompt: the
    step's work is the same, and a prefill of a big model at a big batch would take longer than
    the timing itself.
    """
    tokens = random_ids(1, batch, model.config.vocab_size)[0]
    cache = StaticKVCache.for_model(model, batch, context + 1)
    with torch.inference_mode():
        for i, (k, v) in enumerate(random_past(model, batch, context)):
            cache.update(i, k, v)
        cache.advance(context)

    lean = hooks.decode_function(model, cache, False)  # the step `generate` runs

    def step() -> None:
        with torch.inference_mode():
            decode_step(model, tokens, cache, step=lean)
        cache.rollback(1)

    return step


def time_variants(models: dict[str, torch.nn.Module], batch: int, context: int = 64,
                  rounds: int = 5, steps: int = 3) -> dict[str, float]:
    """Median seconds per decode step of each model, timed round-robin: every round times
    ``steps`` steps of each model in turn, so a slow spell of the machine hits all of them."""
    steppers = {k: _stepper(m, batch, context) for k, m in models.items()}
    device = next(next(iter(models.values())).parameters()).device
    medians = round_robin(list(steppers.values()), warmup=2, repeats=rounds, calls=steps,
                          device=device)
    return dict(zip(steppers, medians))


def run(preset: str = "gpt2", batches: tuple[int, ...] = (1,), context: int = 64,
        rounds: int = 5, variants=QUICK_VARIANTS, group_size: int = 128) -> list[QuantRow]:
    """Each variant of `preset` (random weights): its bytes, and its decode step timed
    round-robin with the others at every batch size."""
    base = GPT.from_config(preset, seed=0)
    if integer_problem() is not None:  # no quantized engine in this torch build / device
        warnings.warn(f"int8 integer (W8A8) left out: {integer_problem()}", RuntimeWarning,
                      stacklevel=2)
        variants = [v for v in variants if v[2] != "integer"]
    models = {label: variant_model(base, p, impl, group_size) for label, p, impl in variants}
    per_batch = {b: time_variants(models, b, context, rounds) for b in batches}
    rows = []
    for label, model in models.items():
        mb = model_bytes(model)
        ms = {b: per_batch[b][label] * 1e3 for b in batches}
        tps = {b: b / per_batch[b][label] for b in batches}
        rows.append(QuantRow(label, mb.total, mb.linear, ms, tps))
    return rows


def format_report(rows: list[QuantRow]) -> str:
    base = rows[0]
    batches = list(base.ms_per_step)
    head = f"{'precision':<14}{'total MB':>9}{'linear MB':>10}{'x fp32':>7}"
    for b in batches:
        head += f"{f'b={b} tok/s':>13}{'x fp32':>7}"
    lines = [head]
    for r in rows:
        line = (f"{r.label:<14}{r.total_bytes / 1e6:>9.1f}{r.linear_bytes / 1e6:>10.1f}"
                f"{base.linear_bytes / r.linear_bytes:>7.2f}")
        for b in batches:
            line += f"{r.batch_tokens_per_s[b]:>13.1f}{r.batch_tokens_per_s[b] / base.batch_tokens_per_s[b]:>7.2f}"
        lines.append(line)
    lines.append("bytes: 'x fp32' = fp32 linear bytes / these; speed: tokens/s / fp32's tokens/s "
                 "(same run, round-robin, median step after warm-up).")
    return "\n".join(lines)
