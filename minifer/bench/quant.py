"""Bytes and decode speed per precision, measured: ``python -m minifer.bench quant``.

For the reference model (random weights; timings do not depend on their values) in each
precision: the bytes it stores and the decode tokens/s at batch 1 and 32, each as a ratio to
fp32 measured in the same run (median step after warm-up, the variants timed round-robin). int8 and int4 appear
twice: with torch's fused kernels (which read the integers directly) and with the reference
dequantize-then-matmul path (which rebuilds a float weight at every call — honest, and slow).
"""

from __future__ import annotations

import argparse
import warnings
from dataclasses import dataclass

import torch

from ..cache import StaticKVCache
from ..generation import decode_step, prefill
from ..model import GPT
from ..quantization import model_bytes, quantize
from .decode import random_ids
from .timing import round_robin

__all__ = ["VARIANTS", "QuantRow", "variant_model", "time_variants", "run", "format_report"]

# (label, precision, impl) — impl None for the float precisions
VARIANTS: tuple[tuple[str, str, str | None], ...] = (
    ("fp32", "fp32", None),
    ("bf16", "bf16", None),
    ("fp16", "fp16", None),
    ("int8 fused", "int8", "auto"),
    ("int8 dequant", "int8", "reference"),
    ("int4 fused", "int4", "auto"),
    ("int4 dequant", "int4", "reference"),
)


@dataclass(frozen=True)
class QuantRow:
    label: str
    total_bytes: int
    linear_bytes: int
    ms_per_step: dict[int, float]  # batch -> median ms per decode step
    batch_tokens_per_s: dict[int, float]  # batch -> tokens/s (batch / step time)


def variant_model(model: torch.nn.Module, precision: str, impl: str | None,
                  group_size: int = 128) -> torch.nn.Module:
    """`model` in one of the `VARIANTS` (fused falls back to the reference path with a warning)."""
    if impl is None:
        return quantize(model, precision)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantize(model, precision, impl=impl, group_size=group_size)


def _stepper(model: torch.nn.Module, batch: int, context: int):
    """A function that runs one decode step at ``context`` cached tokens (then rolls it back)."""
    ids = random_ids(batch, context, model.config.vocab_size)
    cache = StaticKVCache.for_model(model, batch, context + 1)
    with torch.inference_mode():
        tokens = prefill(model, ids, cache).argmax(-1)

    def step() -> None:
        with torch.inference_mode():
            decode_step(model, tokens, cache)
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


def run(preset: str = "reference", batches: tuple[int, ...] = (1, 32), context: int = 64,
        rounds: int = 5, variants=VARIANTS, group_size: int = 128) -> list[QuantRow]:
    base = GPT.from_config(preset, seed=0)
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="reference", help="model preset (default: reference)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32],
                        help="decode batch sizes (default: 1 32)")
    parser.add_argument("--context", type=int, default=64,
                        help="cached tokens per sequence (default: 64)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="round-robin rounds of 3 steps per variant (default: 5)")
    parser.add_argument("--group-size", type=int, default=128, help="int4 group (default: 128)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def run_command(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"reference decode per precision, {torch.get_num_threads()} threads, "
          f"context {args.context}, torch {torch.__version__}")
    rows = run(args.preset, tuple(args.batches), args.context, args.rounds,
               group_size=args.group_size)
    print(format_report(rows))
    return 0

