"""The generation loop: tokenize → prefill → (sample → append → decode)* → stop.

`prefill` runs every prompt token through the model in one parallel pass and fills the KV cache;
`decode_step` feeds one token per sequence and reads everything else from the cache. `stream`
drives them for a batch of prompts and yields each token the moment it exists (claim REQ-1);
`generate` collects one `Completion` per prompt. Per-request state (tokens, text, stop strings,
finish reason, timings) lives in `sequence.Sequence`.

Prompts of different lengths share a batch by *left padding*: row b's real tokens start at slot
``start[b]`` and the attention mask hides the padding, so every row computes what it would
compute alone. In fp32 that holds exactly (greedy tokens are identical, tested); in bf16/fp16 the
padded batch runs matmuls of other shapes, whose rounding can differ, so outputs may diverge
after a near-tie.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from .cache import StaticKVCache
from .device import sync
from .sampling import SamplingParams, make_generators, mask_padded_vocab, sample
from .sequence import Completion, TokenEvent, encode_prompts, prepare
from .tokenizer import TokenizerLike

__all__ = ["prefill", "decode_step", "stream", "generate", "Completion", "TokenEvent",
           "encode_prompts"]


# ---- the two kinds of forward pass ---------------------------------------------------------
def prefill(model: torch.nn.Module, ids: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
    """Run all prompt tokens ``(B, T)`` in one pass, writing their K/V into `cache`.

    Call ``cache.reset(start)`` first for a new batch. Returns the next-token logits ``(B, V)``.
    """
    return model(ids, cache=cache, last_only=True)[:, -1]


def decode_step(model: torch.nn.Module, tokens: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
    """Feed one new token per row ``(B,)``; attention reads all earlier tokens from `cache`.

    Input and output have the same shapes at every step (B×1 in, B×V out), but attention reads
    the cache's filled prefix, which grows by one slot per step: the step is not (yet) a
    fixed-shape function that a GPU could capture once as a CUDA graph.
    """
    return model(tokens.view(-1, 1), cache=cache)[:, -1]


# ---- the loop ------------------------------------------------------------------------------
def stream(
    model: torch.nn.Module,
    prompts,
    params: SamplingParams | None = None,
    tokenizer: TokenizerLike | None = None,
    *,
    use_cache: bool = True,
    device: torch.device | str | None = None,
    completions: list[Completion] | None = None,
    kv_dtype: torch.dtype | str | None = None,
) -> Iterator[TokenEvent]:
    """Yield a `TokenEvent` for every generated token of every prompt, as soon as it exists.

    Pass a list as `completions` to have it filled with the final `Completion`s.
    `use_cache=False` recomputes the whole sequence at every step: the reference path.
    `kv_dtype`: the KV cache's dtype (default: the model's); ``"int8"`` quantizes the cache.
    """
    req = prepare(model, prompts, params, tokenizer, device=device)
    params = req.sequences[0].params
    seqs, device, vocab = req.sequences, req.device, req.vocab
    B, T = len(seqs), max(len(s.prompt_ids) for s in seqs)
    total = T + params.max_new_tokens
    start = torch.tensor([T - len(s.prompt_ids) for s in seqs], dtype=torch.long)
    buf = torch.zeros(B, total, dtype=torch.long)  # left-padded prompts, then generated tokens
    for b, s in enumerate(seqs):
        buf[b, T - len(s.prompt_ids):T] = torch.tensor(s.prompt_ids)
    buf = buf.to(device)
    padded = bool((start > 0).any())
    start = start.to(device)
    if completions is not None:  # the caller's list may already hold earlier results
        completions.extend(s.result for s in seqs)
    gens = make_generators(params, B, device)  # one per row: the same text alone or batched
    seen = None
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(B, model.config.vocab_size, dtype=torch.bool, device=device)
        for b, s in enumerate(seqs):  # the prompt's tokens count as already seen
            seen[b, torch.tensor(s.prompt_ids, device=device)] = True
    rows = torch.arange(B, device=device)

    with torch.inference_mode():
        t0 = time.perf_counter()
        if use_cache:
            cache = StaticKVCache.for_model(model, B, total - 1, dtype=kv_dtype, device=device)
            cache.reset(start)
            logits = prefill(model, buf[:, :T], cache)
        else:
            logits = model(buf[:, :T], start=start if padded else None, last_only=True)[:, -1]
        for step in range(params.max_new_tokens):
            tokens = sample(mask_padded_vocab(logits, vocab), params, seen, gens)
            host = tokens.tolist()  # waits for the device: the token now exists
            now = time.perf_counter() - t0
            buf[:, T + step] = tokens
            if seen is not None:
                seen[rows, tokens] = True
            for b, s in enumerate(seqs):
                if not s.finished:
                    yield s.append(host[b], now)
            if all(s.finished for s in seqs):
                break
            if use_cache:
                logits = decode_step(model, tokens, cache)
            else:
                seq = buf[:, : T + step + 1]
                logits = model(seq, start=start if padded else None, last_only=True)[:, -1]
        sync(device)


def generate(
    model: torch.nn.Module,
    prompts,
    params: SamplingParams | None = None,
    tokenizer: TokenizerLike | None = None,
    *,
    use_cache: bool = True,
    device: torch.device | str | None = None,
    kv_dtype: torch.dtype | str | None = None,
) -> list[Completion]:
    """Generate for one prompt or a batch; returns one `Completion` per prompt, in order.

    `kv_dtype`: the KV cache's dtype (default: the model's); ``"int8"`` quantizes the cache.
    """
    completions: list[Completion] = []
    for _ in stream(model, prompts, params, tokenizer, use_cache=use_cache, device=device,
                    completions=completions, kv_dtype=kv_dtype):
        pass
    return completions

