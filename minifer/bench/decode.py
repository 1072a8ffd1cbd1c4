"""Prefill versus decode, measured: ``python -m minifer.bench decode``.

Times the reference model (or any preset) on this machine the way the course's claims state
their reference figures:

* prefill of a 512-token prompt: ms and prompt tokens/s (claim PD-3);
* one decode step at a short context: ms per token and tokens/s (PD-3);
* one decode step for batch 1, 8, 32, 64 at that context: ms per step and total tokens/s
  (BATCH-1: the step reads the weights once however many sequences share it);
* whole generations with and without the KV cache at 32 and 128 new tokens: ms per new token
  (KV-3: without the cache every step recomputes the whole sequence).

Every figure is the median of several runs after warm-up (:func:`minifer.bench.timing.time_fn`).
The functions are plain and importable, so the lessons time things exactly as the command does.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..cache import StaticKVCache
from ..config import GPTConfig
from ..generation import decode_step, generate, prefill
from ..model import GPT
from ..sampling import SamplingParams
from .timing import Timing, time_fn

__all__ = ["random_ids", "time_prefill", "time_decode_step", "time_generation", "BatchStep",
           "CacheComparison", "DecodeBench", "run", "format_report", "busy_warning", "REFERENCE"]

# The claims' reference figures (a 4-thread laptop CPU, the reference model in fp32).
REFERENCE = {
    "prefill_512_ms": 147.0, "prefill_tok_s": 3480, "decode_ms": 11.1, "decode_tok_s": 90,
    "batch_ms": {1: 6.7, 8: 20.6, 32: 47.9, 64: 73.9},
    "batch_tok_s": {1: 150, 8: 388, 32: 667, 64: 866},
    "cache_ms": {32: (7.3, 34.2), 128: (6.6, 46.5)},  # (with cache, without) ms per token
}


def random_ids(batch: int, tokens: int, vocab_size: int, seed: int = 0,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """``(batch, tokens)`` random token ids, seeded (timings do not depend on which ids)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, tokens), generator=gen).to(device)


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _check_fits(model: torch.nn.Module, tokens: int, what: str) -> None:
    ctx = model.config.context_length
    if not isinstance(tokens, int) or not 1 <= tokens <= ctx:
        raise ValueError(f"{what} must be an integer in [1, {ctx}] (the model's context), "
                         f"got {tokens!r}")


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
                     warmup: int = 2, repeats: int = 10, seed: int = 0) -> Timing:
    """Time one decode step of ``batch`` sequences that each have ``context`` cached tokens.

    The cache is filled once by a prefill; every timed step appends one token per sequence and
    then rolls it back, so each step sees exactly ``context`` earlier tokens.
    """
    _check_fits(model, context + 1, "context + 1")
    dev = _model_device(model)
    ids = random_ids(batch, context, model.config.vocab_size, seed, dev)
    cache = StaticKVCache.for_model(model, batch, context + 1)
    with torch.inference_mode():
        logits = prefill(model, ids, cache)
        tokens = logits.argmax(-1)

        def run() -> None:
            decode_step(model, tokens, cache)
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
    """Everything ``python -m minifer.bench decode`` measures (seconds; medians)."""

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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="reference",
                        help="model preset, random weights (default: reference, 26.8M)")
    parser.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--prefill-tokens", type=int, default=512,
                        help="prompt length of the prefill timing (default: 512)")
    parser.add_argument("--context", type=int, default=64,
                        help="cached tokens per sequence for the decode timings (default: 64)")
    parser.add_argument("--full", action="store_true",
                        help="the whole grid (report: cache vs none at 32 and 128 new tokens; "
                        "table: batches 1 8 32 64, 16 new tokens); default: a quick scope "
                        "that answers the same questions in a few minutes")
    parser.add_argument("--batches", type=int, nargs="+", default=None,
                        help="decode batch sizes (default: 1 8 32 64 for the report; table: "
                        "1 64, --full 1 8 32 64)")
    parser.add_argument("--new-tokens", type=int, nargs="*", default=None,
                        help="generation lengths for cache vs no cache (default: 32; "
                        "--full: 32 128)")
    parser.add_argument("--prompt-tokens", type=int, default=64,
                        help="prompt length for cache vs no cache (default: 64)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="counted runs (default: 3; table: round-robin rounds, 5 at batch "
                        "<= 8 and 3 above, --full: 3)")
    table = parser.add_argument_group(
        "engine table (--table): minifer vs the textbook engine and transformers, the matmul "
        "floor, GB/s and MBU")
    table.add_argument("--table", action="store_true",
                       help="print the engine table instead of the prefill/decode report")
    table.add_argument("--presets", nargs="+", default=["reference", "gpt2"],
                       help="model shapes (default: reference gpt2)")
    table.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"],
                       help="precisions (default: fp32 bf16)")
    table.add_argument("--table-prompt-tokens", type=int, default=128,
                       help="prompt already in the cache (default: 128)")
    table.add_argument("--table-new-tokens", type=int, default=None,
                       help="decode steps per timed run (default: 8 at batch <= 8, 3 above; "
                       "--full: 16)")
    table.add_argument("--prefill", action="store_true",
                       help="each engine prefills the prompt itself (default: every engine "
                       "starts from the same random K/V, which costs no prefill)")
    table.add_argument("--compile", action="store_true",
                       help="compile minifer's decode step (torch.compile; slow to start)")
    table.add_argument("--no-baselines", action="store_true",
                       help="time minifer and the floor only")
    table.add_argument("--json", metavar="PATH", default=None,
                       help="also write the table as JSON to PATH")


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


def run_command(args: argparse.Namespace) -> int:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.device == "cpu" and (warning := busy_warning(torch.get_num_threads())):
        print(warning, file=sys.stderr, flush=True)
    if args.table:
        return _run_table(args)
    batches = [1, 8, 32, 64] if args.batches is None else args.batches
    new_tokens = ([32, 128] if args.full else [32]) if args.new_tokens is None else args.new_tokens
    result = run(args.preset, prefill_tokens=args.prefill_tokens, context=args.context,
                 batches=batches, new_tokens=new_tokens,
                 prompt_tokens=args.prompt_tokens,
                 repeats=3 if args.repeats is None else args.repeats, device=args.device)
    print(format_report(result))
    return 0


def _run_table(args: argparse.Namespace) -> int:
    import json

    from .engines import HEADER, format_table, quick_new_tokens, quick_repeats, run_table, to_json

    batches = ([1, 8, 32, 64] if args.full else [1, 64]) if args.batches is None else args.batches
    new_tokens = (16 if args.full else quick_new_tokens) if args.table_new_tokens is None \
        else args.table_new_tokens
    print(HEADER, file=sys.stderr, flush=True)
    result = run_table(args.presets, args.dtypes, batches,
                       prompt_tokens=args.table_prompt_tokens, new_tokens=new_tokens,
                       repeats=(3 if args.full else quick_repeats) if args.repeats is None
                       else args.repeats, compile=args.compile,
                       baselines=not args.no_baselines, prefill=args.prefill,
                       progress=lambda line: print(line, file=sys.stderr, flush=True))
    result["command"] = "python -m minifer.bench " + " ".join(sys.argv[1:])
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(to_json(result), f, indent=1)
        print(f"wrote {args.json}")
    return 0

