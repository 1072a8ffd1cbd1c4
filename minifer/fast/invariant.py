"""Batch-invariant kernels: each token computed as it is alone, cached or recomputed.

Reference: the model's own layers, called here only in shapes that never depend on the batch,
so a row's numbers are bit for bit the same alone, in any batch, cached or recomputed. Why: a
product of M rows sums each row in an order the kernel picks *by M* (a padded softmax too), and
bf16 and W8A8's per-token rounding turn such last-bit differences into other tokens.

- `in_rows`: every token-wise layer runs on blocks of exactly `ROWS` tokens (the last padded);
- `attend_per_query`: attention one query at a time over exactly the keys it sees, the call a
  decode step makes (`paged_per_query` over the serving engine's pool);
- rotary angles from one table of every position (`rotary_table`);
- the thread count fixed for the call (`generate` pins it).

`batch_invariant` (`hooks.batch_invariant`) puts these kernels into one model for one call and
takes them out after it. They cost speed: one row still makes `ROWS`-row products."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..cache import AttentionInputs

__all__ = ["ROWS", "in_rows", "attend_per_query", "paged_per_query", "rotary_table",
           "batch_invariant"]

ROWS = 8  # tokens per token-wise call: any fixed count gives the same numbers in every batch
# (tested); 8 keeps a batch of one's wasted rows few (BENCHMARKS.md, "Batched == alone")


def in_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
            rows: int = ROWS) -> torch.Tensor:
    """``fn(x)`` for a token-wise `fn` (``(..., K)`` -> ``(..., N)``), computed on blocks of
    exactly `rows` tokens: the last block is padded with zero tokens, whose results are
    dropped. Every call of `fn` then has the same shape, whatever the batch."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    M = x2.shape[0]
    if M == 0:  # nothing to compute (a serving step whose rows all continue their prompts)
        return fn(x)
    pad = -M % rows
    if pad:
        x2 = torch.cat([x2, x2.new_zeros(pad, shape[-1])])
    y = torch.cat([fn(x2[i:i + rows]) for i in range(0, M + pad, rows)])[:M]
    return y.reshape(*shape[:-1], y.shape[-1])


def attend_per_query(attn: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     inputs: AttentionInputs) -> torch.Tensor:
    """`CausalSelfAttention.scores_times_values`, one query at a time: each real query of row
    b at slot i attends over slots ``start[b]..i`` alone, in one SDPA call of one query (its
    grouped query heads as rows). Padding queries give zeros (nothing reads them).

    Takes the layer's three forms: ``q`` ``(B, nh, T, hd)`` with ``k, v`` ``(B, nkv, S, hd)``;
    grouped-query prefill with ``k, v`` repeated to ``nh`` heads; grouped decode with ``q``
    ``(B, nkv, nh // nkv, hd)``. Returns ``(B, nh, T, hd)``."""
    B, T = inputs.positions.shape
    nh, nkv, hd = attn.n_head, attn.n_kv_head, attn.head_dim
    if k.shape[1] != nkv:  # repeated for the query heads: one copy of each K/V head
        k, v = k[:, ::nh // nkv], v[:, ::nh // nkv]
    q = q.reshape(B, nkv, nh // nkv, T, hd)  # query head h belongs to K/V head h // (nh // nkv)
    offset = k.shape[2] - T  # slots cached before the new tokens
    starts = inputs.rows or [0] * B
    out = q.new_zeros(q.shape)
    for b, s in enumerate(starts):
        for t in range(max(s - offset, 0), T):
            end = offset + t + 1
            out[b, :, :, t] = F.scaled_dot_product_attention(
                q[b:b + 1, :, :, t], k[b:b + 1, :, s:end], v[b:b + 1, :, s:end])[0]
    return out.reshape(B, nh, T, hd)


def paged_per_query(batch) -> Callable[[int, torch.Tensor], torch.Tensor]:
    """A serving step's attention (a `PackedBatch`'s ``attention(layer, q)``, its new K/V
    already in the pool) one query at a time: each row's K/V gathered from its slots, and each
    new token attends over its row's first ``position + 1`` tokens in the call
    `attend_per_query` makes for it (so the engine and `generate` agree, batch for batch)."""
    pool, dev = batch.pool, batch.pool.device
    index = [torch.tensor(pool.slots(t, 0, c + n), device=dev)
             for t, c, n in zip(batch.tables, batch.context, batch.num_new)]

    def attend(layer: int, q: torch.Tensor) -> torch.Tensor:
        nkv, hd = pool.k[layer].shape[-2:]
        pk, pv = (x[layer].view(-1, nkv, hd) for x in (pool.k, pool.v))  # (slots, nkv, hd)
        out, offset, g = q.new_zeros(q.shape), 0, q.shape[1] // nkv
        for idx, c, n in zip(index, batch.context, batch.num_new):
            kr, vr = (x[idx].transpose(0, 1)[None] for x in (pk, pv))  # (1, nkv, c + n, hd)
            for t in range(n):
                qt = q[:, :, offset + t].reshape(1, nkv, g, hd)
                y = F.scaled_dot_product_attention(qt, kr[:, :, :c + t + 1], vr[:, :, :c + t + 1])
                out[:, :, offset + t] = y.reshape(1, -1, hd)
            offset += n
        return out
    return attend


def _packed(model: nn.Module) -> Callable:
    """A `GPT.forward_packed` whose step attends through `paged_per_query`."""
    def forward_packed(idx: torch.Tensor, cache) -> torch.Tensor:
        cache.attention = paged_per_query(cache)
        return type(model).forward_packed(model, idx, cache)
    return forward_packed


def rotary_table(rotary: nn.Module, length: int) -> Callable:
    """A `RotaryEmbedding.forward` that reads each position's cos and sin from one table of
    positions ``0..length-1`` (per dtype and device), computed once."""
    tables: dict = {}

    def forward(positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (dtype, positions.device)
        if key not in tables:
            every = torch.arange(length, device=positions.device)[None]  # (1, length)
            tables[key] = tuple(t[0, 0] for t in type(rotary).forward(rotary, every, dtype))
        cos, sin = tables[key]  # (length, hd/2)
        return cos[positions][:, None], sin[positions][:, None]  # (B, 1, T, hd/2)
    return forward


def _token_wise(model: nn.Module) -> list[nn.Module]:
    """The model's token-wise modules, each computed in blocks of `ROWS` tokens."""
    mods = [model.transformer.ln_f, model.lm_head]
    for block in model.transformer.h:
        attn = block.attn
        mods += [block.ln_1, block.ln_2, block.mlp, attn.c_attn, attn.c_proj]
        mods += [m for m in (attn.q_norm, attn.k_norm) if not isinstance(m, nn.Identity)]
    return mods


@contextlib.contextmanager
def batch_invariant(model: nn.Module, on: bool) -> Iterator[None]:
    """`hooks.batch_invariant`: inside the block `model` (a `GPT`) runs the kernels above (when
    `on`); after it, its own layers again. Instance attributes shadow the layers' methods for
    the call; nothing else changes, no weight is copied."""
    if not on:
        yield
        return
    patched: list[tuple[nn.Module, str]] = []

    def shadow(module: nn.Module, name: str, fn: Callable) -> None:
        setattr(module, name, fn)
        patched.append((module, name))
    for m in _token_wise(model):
        shadow(m, "forward", functools.partial(in_rows, type(m).forward.__get__(m)))
    for block in model.transformer.h:
        shadow(block.attn, "scores_times_values", functools.partial(attend_per_query, block.attn))
    shadow(model, "forward_packed", _packed(model))
    if getattr(model, "rotary", None) is not None:
        shadow(model.rotary, "forward", rotary_table(model.rotary, model.config.context_length))
    try:
        yield
    finally:
        for module, name in patched:
            delattr(module, name)
