"""The generation loop: tokenize → prefill → (sample → append → decode)* → stop.

`prefill` runs every prompt token through the model in one parallel pass and fills the KV cache;
`decode_step` feeds one token per sequence and reads everything else from the cache.
`generate` drives them for a batch of prompts (`run_batch`) and returns one `Completion` per
prompt; `stream` yields each token the moment it exists (claim REQ-1). Per-request state
(tokens, text, stop strings, finish reason, timings) lives in `sequence.Sequence`; `advance` is
the loop every generation shares (plain, tensor-parallel, speculative: only its *step* differs).

Prompts of different lengths share a batch by left padding (`minifer.cache`): a row computes
what it computes alone but for the matrix products, whose sums a batch adds in another order
(W8A8 sums exactly; bf16 and int4 can flip a near-tie; ``batch_invariant=True`` fixes them).
Speed-ups plug in at `minifer.hooks` (the thread count, the decode step): see `minifer.fast`."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from . import hooks
from .cache import KVCache, StaticKVCache, check_kv_dtype
from .sampling import BatchSampler, SamplingParams
from .sequence import Completion, Prepared, Sequence, TokenEvent, encode_prompts, prepare
from .tokenizer import TokenizerLike

__all__ = ["prefill", "decode_step", "advance", "stream", "run_batch", "generate",
           "Completion", "TokenEvent", "encode_prompts"]


# ---- the two kinds of forward pass ---------------------------------------------------------
def prefill(model: torch.nn.Module, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Run all prompt tokens ``(B, T)`` in one pass, writing their K/V into `cache` (reset for
    a new batch: ``cache.reset(start)``); returns the next-token logits ``(B, V)``."""
    return model(ids, cache=cache, last_only=True)[:, -1]


def decode_step(model: torch.nn.Module, tokens: torch.Tensor, cache: KVCache, *,
                step: Callable | None = None) -> torch.Tensor:
    """Feed one new token per row ``(B,)``; returns the next-token logits ``(B, V)``. `step`
    (``step(model, tokens, cache)``, from `hooks.decode_function`) computes the same faster."""
    tokens = tokens.view(-1, 1)  # (B, 1)
    if step is not None:
        return step(model, tokens, cache)
    return model(tokens, cache=cache)[:, -1]  # (B, V)


# ---- the loop ------------------------------------------------------------------------------
Sampler = Callable[[torch.Tensor], torch.Tensor]
"""Next-token logits ``(B, V)`` → one token id per row ``(B,)``."""

Step = Callable[[], list[list[int]]]
"""One step of the loop: the tokens each row gets next (host ints, usually one per row)."""


def advance(seqs: list[Sequence], step: Step, t0: float) -> Iterator[TokenEvent]:
    """Append each step's tokens to their rows until every row has finished: the one loop of
    `generate`, tensor parallelism and speculative decoding (only their `step` differs). A row
    stops at the first token that finishes it; later tokens are dropped. Each token is stamped
    with the seconds since `t0` at which its step returned."""
    while not all(s.finished for s in seqs):
        new = step()
        now = time.perf_counter() - t0
        for s, tokens in zip(seqs, new):
            for token in tokens:
                if s.finished:
                    break
                yield s.append(token, now)


@dataclass
class Batch:
    """The token ids of a batch of prompts, left-padded to the longest, with room after them
    for the tokens to come: ``ids[b, start[b]:T]`` is prompt b, ``ids[:, T + n]`` step n's."""

    ids: torch.Tensor  # (B, T + max_new_tokens)
    start: torch.Tensor  # (B,) where each row's real tokens begin
    T: int  # the longest prompt
    padded: bool  # whether any row is padded

    @classmethod
    def of(cls, seqs: list[Sequence], device: torch.device) -> Batch:
        T = max(len(s.prompt_ids) for s in seqs)
        ids = torch.zeros(len(seqs), T + seqs[0].params.max_new_tokens, dtype=torch.long)
        for b, s in enumerate(seqs):
            ids[b, T - len(s.prompt_ids):T] = torch.tensor(s.prompt_ids)
        start = torch.tensor([T - len(s.prompt_ids) for s in seqs])
        return cls(ids.to(device), start.to(device), T, bool((start > 0).any()))


def new_cache(model: torch.nn.Module, batch: Batch, cache: StaticKVCache | None,
              kv_dtype, compile: bool | str) -> StaticKVCache:
    """The KV cache for `batch`, reset to its padding: `cache` if given (checked), else one sized
    for it (compiling: rounded up to 64 slots, so that similar requests share one graph)."""
    B, slots = batch.ids.shape[0], batch.ids.shape[1] - 1  # the last token is never fed back
    if cache is None:
        check_kv_dtype(kv_dtype, next(p for p in model.parameters() if p.is_floating_point()).dtype)
        if compile:
            slots = min(-(-slots // 64) * 64, model.config.context_length)
        cache = StaticKVCache.for_model(model, B, slots, dtype=kv_dtype, device=batch.ids.device)
    elif cache.batch_size != B or cache.max_len < slots:
        raise ValueError(f"cache must have batch_size {B} and max_len >= {slots}, got "
                         f"{cache.batch_size} and {cache.max_len}")
    cache.reset(batch.start)
    return cache


def run_batch(model: torch.nn.Module, req: Prepared, *, use_cache: bool = True,
              kv_dtype: torch.dtype | str | None = None, compile: bool | str = False,
              cache: StaticKVCache | None = None, threads: int | str | None = None,
              sampler: Callable[[Sampler], Sampler] | None = None,
              batch_invariant: bool = False) -> Iterator[TokenEvent]:
    """Generate for checked request input (`sequence.prepare`): prefill → (sample → append →
    decode step)* → stop, one `TokenEvent` per token. Tensor parallelism passes a `cache` of
    its rank's heads and a `sampler` that wraps the plain one (logits → tokens)."""
    if compile and (not use_cache or batch_invariant):
        raise ValueError("compile=True needs use_cache=True and batch_invariant=False")
    threads = torch.get_num_threads() if batch_invariant and threads in (None, "auto") else threads
    seqs, device = req.sequences, req.device
    batch = Batch.of(seqs, device)
    plain = BatchSampler(seqs[0].params, [s.prompt_ids for s in seqs], req.vocab,
                         model.config.vocab_size, device)
    pick = plain if sampler is None else sampler(plain)
    if use_cache:
        cache = new_cache(model, batch, cache, kv_dtype, compile)
        forward = cached_forward(model, batch, cache, hooks.decode_function(model, cache, compile))
    else:
        forward = recomputed_forward(model, batch)
    n = 0  # tokens made per row so far

    def step() -> list[list[int]]:
        """One forward pass (the first: the prefill) and one sampled token per row."""
        nonlocal n
        between_steps()
        tokens = pick(forward(n))  # (B,)
        batch.ids[:, batch.T + n] = tokens
        n += 1
        return [[t] for t in tokens.tolist()]  # waits for the device: the token now exists

    with hooks.batch_invariant(model, batch_invariant), torch.inference_mode(), \
            hooks.generation_threads(threads, device) as between_steps:
        yield from advance(seqs, step, time.perf_counter())


def cached_forward(model: torch.nn.Module, batch: Batch, cache: StaticKVCache,
                   step: Callable | None) -> Callable[[int], torch.Tensor]:
    """Next-token logits ``(B, V)`` after `n` new tokens: the prefill, then decode steps."""
    def forward(n: int) -> torch.Tensor:
        if n == 0:
            return prefill(model, batch.ids[:, :batch.T], cache)
        return decode_step(model, batch.ids[:, batch.T + n - 1], cache, step=step)
    return forward


def recomputed_forward(model: torch.nn.Module, batch: Batch) -> Callable[[int], torch.Tensor]:
    """Next-token logits ``(B, V)`` after `n` new tokens, recomputing every token each time:
    the reference the KV cache must equal."""
    def forward(n: int) -> torch.Tensor:
        start = batch.start if batch.padded else None
        return model(batch.ids[:, :batch.T + n], start=start, last_only=True)[:, -1]
    return forward


def stream(model: torch.nn.Module, prompts, params: SamplingParams | None = None,
           tokenizer: TokenizerLike | None = None, *, use_cache: bool = True,
           device: torch.device | str | None = None, completions: list[Completion] | None = None,
           kv_dtype: torch.dtype | str | None = None, compile: bool | str = False,
           threads: int | str | None = None, batch_invariant: bool = False) -> Iterator[TokenEvent]:
    """Yield a `TokenEvent` for every generated token of every prompt, as soon as it exists.
    `completions`: a list to fill with the final `Completion`s; the other arguments are
    `generate`'s."""
    req = prepare(model, prompts, params, tokenizer, device=device)
    if completions is not None:  # the caller's list may already hold earlier results
        completions.extend(s.result for s in req.sequences)
    yield from run_batch(model, req, use_cache=use_cache, kv_dtype=kv_dtype, compile=compile,
                         threads=threads, batch_invariant=batch_invariant)


def generate(model: torch.nn.Module, prompts, params: SamplingParams | None = None,
             tokenizer: TokenizerLike | None = None, *, use_cache: bool = True,
             device: torch.device | str | None = None, kv_dtype: torch.dtype | str | None = None,
             compile: bool | str = False, threads: int | str | None = None,
             batch_invariant: bool = False) -> list[Completion]:
    """Generate for one prompt or a batch; returns one `Completion` per prompt, in order.

    - `use_cache=False` recomputes the whole sequence at every step: the reference path.
    - `kv_dtype`: the KV cache's dtype (default: the model's); ``"int8"`` quantizes the cache.
    - `compile`: a compiled decode step (True, or a `torch.compile` mode; `minifer.fast`).
    - `threads` (CPU): an integer fixes torch's count for this call; None leaves it as it is;
      ``"auto"`` uses every idle core, lowered while other programs hold cores (only when asked).
    - `batch_invariant`: each row's tokens exactly as alone and recomputed (`fast.invariant`)."""
    req = prepare(model, prompts, params, tokenizer, device=device)
    for _ in run_batch(model, req, use_cache=use_cache, kv_dtype=kv_dtype, compile=compile,
                       threads=threads, batch_invariant=batch_invariant):
        pass
    return [s.result for s in req.sequences]
