"""Prefill versus decode, measured: ``python -m minifer_course.bench decode``.

Times the reference model (or any preset) on this machine the way the course's claims state
their reference figures:

* prefill of a 512-token prompt: ms and prompt tokens/s (claim PD-3);
* one decode step at a short context: ms per token and tokens/s (PD-3);
* one decode step for batch 1, 8, 32, 64 at that context: ms per step and total tokens/s
  (BATCH-1: the step reads the weights once however many sequences share it);
* whole generations with and without the KV cache at 32 and 128 new tokens: ms per new token
  (KV-3: without the cache every step recomputes the whole sequence).

Every figure is the median of several runs after warm-up (:func:`minifer_course.bench.timing.time_fn`).
The functions are plain and importable, so the lessons time things exactly as the command does
(`commands.decode` is the command line; `reference.DECODE` the claims' figures).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from minifer import hooks
from minifer.cache import StaticKVCache
from minifer.checks import check_int
from minifer.config import GPTConfig
from minifer.generation import decode_step, generate, prefill
from minifer.model import GPT
from minifer.sampling import SamplingParams

from .common import busy_warning, random_ids
from .reference import DECODE
from .timing import Timing, time_fn

__all__ = ["random_ids", "time_prefill", "time_decode_step", "time_generation", "BatchStep",
           "CacheComparison", "DecodeBench", "run", "format_report", "busy_warning", "REFERENCE"]

REFERENCE = DECODE  # the claims' figures, printed beside this machine's


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _check_fits(model: torch.nn.Module, tokens: int, what: str) -> None:
    ctx = model.config.context_length
    check_int(what, tokens, 1, ctx, why=" (the model's context)")


def time_prefill(model: torch.nn.Module, prompt_tokens: int, batch: int = 1, *,
                 warmup: int = 1, repeats: int = 3, seed: int = 0) -> Timing:
    """Time one prefill of ``batch`` prompts of ``prompt_tokens`` tokens (cache reset each run).

    ``prompt_tokens / median_s`` is the prefill throughput; the time is the TTFT minus sampling.
    """
    _check_fits(model, prompt_tokens, "prompt_tokens")
    dev = _model_device(model)
    ids = random_ids(batch, prompt_tokens, model.config.vocab_size, seed, dev)
    cache = StaticKVCache.for_model(model, batch, prompt_tokens)

    def run() -> None:
        cache.reset()
        prefill(model, ids, cache)

    with torch.inference_mode():
        return time_fn(run, warmup=warmup, repeats=repeats, device=dev)


def time_decode_step(model: torch.nn.Module, batch: int = 1, context: int = 64, *,
                     warmup: int = 2, repeats: int = 10, seed: int = 0,
                     step: Callable | None = None) -> Timing:
    """Time one decode step of ``batch`` sequences that each have ``context`` cached tokens.

    The cache is filled once, by a prefill of one sequence copied into every row (a step's cost
    does not depend on what the cache holds, and a batch-64 prefill would cost far more than
    the steps it sets up); every timed step appends one token per sequence and then rolls it
    back, so each step sees exactly ``context`` earlier tokens. `step`: a compiled step
    (`minifer.fast.compiled.compiled_decode`) to time instead of the eager one `generate` runs.
    """
    _check_fits(model, context + 1, "context + 1")
    dev = _model_device(model)
    ids = random_ids(1, context, model.config.vocab_size, seed, dev)
    one = StaticKVCache.for_model(model, 1, context + 1)
    cache = StaticKVCache.for_model(model, batch, context + 1)
    with torch.inference_mode():
        logits = prefill(model, ids, one)
        for name in ("k", "v", "k_scale", "v_scale"):
            for dst, src in zip(getattr(cache, name, ()), getattr(one, name, ())):
                dst.copy_(src.expand_as(dst))
        cache.advance(one.pos)
        tokens = logits.argmax(-1).expand(batch).contiguous()
        step = step or hooks.decode_function(model, cache, False)

        def run() -> None:
            decode_step(model, tokens, cache, step=step)
            cache.rollback(1)

        return time_fn(run, warmup=warmup, repeats=repeats, device=dev)


def time_generation(model: torch.nn.Module, prompt_tokens: int, new_tokens: int, *,
                    use_cache: bool = True, warmup: int = 1, repeats: int = 3,
                    seed: int = 0) -> Timing:
    """Time a whole greedy generation (prefill + ``new_tokens`` tokens, EOS ignored).

    ``use_cache=False`` takes :func:`minifer.generate`'s reference path, which recomputes the
    whole sequence for every new token. Divide by ``new_tokens`` for ms per token. Each
    warm-up run generates only a few tokens (it exercises the same code, far more cheaply).
    """
    _check_fits(model, prompt_tokens + new_tokens, "prompt_tokens + new_tokens")
    ids = random_ids(1, prompt_tokens, model.config.vocab_size, seed)[0].tolist()
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    short = SamplingParams(temperature=0, max_new_tokens=min(new_tokens, 4), ignore_eos=True)
    for _ in range(warmup):  # a short generation warms the same code path at a fraction of the cost
        generate(model, [ids], short, use_cache=use_cache)
    return time_fn(lambda: generate(model, [ids], params, use_cache=use_cache),
                         warmup=0, repeats=repeats, device=_model_device(model))


@dataclass(frozen=True)
class BatchStep:
    batch: int
    step_s: float

    @property
    def tokens_per_s(self) -> float:
        """All sequences together: each makes one token per step."""
        return self.batch / self.step_s


@dataclass(frozen=True)
class CacheComparison:
    prompt_tokens: int
    new_tokens: int
    with_cache_s: float  # whole generation, median
    without_cache_s: float

    @property
    def with_ms_per_token(self) -> float:
        return self.with_cache_s / self.new_tokens * 1e3

    @property
    def without_ms_per_token(self) -> float:
        return self.without_cache_s / self.new_tokens * 1e3

    @property
    def speedup(self) -> float:
        return self.without_cache_s / self.with_cache_s


@dataclass(frozen=True)
class DecodeBench:
    """Everything ``python -m minifer_course.bench decode`` measures (seconds; medians)."""

    model: str
    params: int
    device: str
    threads: int
    prefill_tokens: int
    prefill_s: float
    context: int
    decode_s: float
    batches: tuple[BatchStep, ...]
    cache: tuple[CacheComparison, ...]

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_s

    @property
    def decode_tokens_per_s(self) -> float:
        return 1 / self.decode_s


def run(preset: str | GPTConfig = "reference", *, prefill_tokens: int = 512, context: int = 64,
        batches: Sequence[int] = (1, 8, 32, 64), new_tokens: Sequence[int] = (32, 128),
        prompt_tokens: int = 64, repeats: int = 3, seed: int = 0,
        device: str = "cpu") -> DecodeBench:
    """Measure the model ``preset`` (random weights, fp32) on ``device``; see the module doc."""
    model = GPT.from_config(preset, seed=seed, device=device)
    name = preset if isinstance(preset, str) else "custom"
    # One throwaway pass pays for lazy initialisation before anything is timed.
    time_prefill(model, min(16, model.config.context_length), warmup=1, repeats=1, seed=seed)
    pre = time_prefill(model, prefill_tokens, warmup=1, repeats=repeats, seed=seed)
    dec = time_decode_step(model, 1, context, warmup=2, repeats=max(5, 3 * repeats), seed=seed)
    steps = tuple(BatchStep(b, time_decode_step(model, b, context, warmup=2,
                                                repeats=max(3, 2 * repeats), seed=seed).median_s)
                  for b in batches)
    cache = []
    for n in new_tokens:
        times = [time_generation(model, prompt_tokens, n, use_cache=uc, warmup=1,
                                 repeats=repeats, seed=seed).median_s for uc in (True, False)]
        cache.append(CacheComparison(prompt_tokens, n, *times))
    return DecodeBench(model=name, params=model.num_params(), device=str(device),
                       threads=torch.get_num_threads(), prefill_tokens=prefill_tokens,
                       prefill_s=pre.median_s, context=context, decode_s=dec.median_s,
                       batches=steps, cache=tuple(cache))


def format_report(r: DecodeBench, reference: bool | None = None) -> str:
    """The benchmark as aligned text; ``reference`` adds the claims' figures (default: for the
    reference model only)."""
    ref = REFERENCE if (r.model == "reference" if reference is None else reference) else None

    def beside(text: str) -> str:
        return f"   [claims: {text}]" if ref else ""

    lines = [f"decode benchmark: {r.model} model ({r.params:,} parameters, fp32) on {r.device}, "
             f"{r.threads} thread(s); medians after warm-up"]
    lines.append(f"prefill {r.prefill_tokens:>5} tokens     {r.prefill_s * 1e3:9.1f} ms       "
                 f"{r.prefill_tokens_per_s:9,.0f} tokens/s"
                 + beside(f"{ref['prefill_512_ms']} ms, {ref['prefill_tok_s']:,} tokens/s"
                          if ref else ""))
    lines.append(f"decode  context {r.context:<5}    {r.decode_s * 1e3:9.2f} ms/token "
                 f"{r.decode_tokens_per_s:9,.0f} tokens/s"
                 + beside(f"{ref['decode_ms']} ms, {ref['decode_tok_s']} tokens/s" if ref else ""))
    lines.append(f"prefill / decode throughput: {r.prefill_tokens_per_s / r.decode_tokens_per_s:.1f}x"
                 + beside(f"{ref['prefill_tok_s'] / ref['decode_tok_s']:.1f}x" if ref else ""))
    if r.batches:
        base = r.batches[0].step_s
        lines.append(f"decode steps at context {r.context} (each sequence makes one token "
                     f"per step):")
        for s in r.batches:
            claim = ""
            if ref and s.batch in ref["batch_ms"]:
                claim = beside(f"{ref['batch_ms'][s.batch]} ms, "
                               f"{ref['batch_tok_s'][s.batch]} tokens/s")
            lines.append(f"  batch {s.batch:>4}  {s.step_s * 1e3:9.2f} ms/step  "
                         f"{s.tokens_per_s:9,.0f} tokens/s total  step x{s.step_s / base:5.1f}"
                         + claim)
    if r.cache:
        lines.append(f"KV cache vs recomputing everything (greedy, {r.cache[0].prompt_tokens}-token "
                     f"prompt, whole generation / new tokens):")
        for c in r.cache:
            claim = ""
            if ref and c.new_tokens in ref["cache_ms"]:
                w, wo = ref["cache_ms"][c.new_tokens]
                claim = beside(f"{w} vs {wo} ms/token")
            lines.append(f"  {c.new_tokens:>4} new tokens  {c.with_ms_per_token:8.2f} vs "
                         f"{c.without_ms_per_token:8.2f} ms/token   no cache x{c.speedup:.1f} "
                         f"slower" + claim)
    return "\n".join(lines)
