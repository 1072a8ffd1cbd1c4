"""Lessons 02, 03 and 07: the forward pass over a KV cache, attention in plain torch ops.

The weights and layers are the model's (`mf.load_pretrained`, `mf.load_hf_checkpoint`): its
embeddings, norms and linear layers are called as they are, so a layer swapped for your
`Int8Linear` (lesson 09) is simply used. Everything between them is here: positions, the K/V
written into the cache (03), every sequence attending to its own keys (07's padded batch and
mask), the MLP and the output head.

The cache is a pool of blocks (lesson 08); lesson 03's cache of one sequence is its simplest
case, one block as long as the sequence (`Cache`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


class KVPool:
    """Every layer's keys and values, in `num_blocks` blocks of `block_size` slots (lesson 08).
    Token p of a sequence whose block table is `table` lives in slot
    ``table[p // block_size] * block_size + p % block_size``."""

    def __init__(self, model, num_blocks: int, block_size: int) -> None:
        cfg, w = model.config, model.transformer.wte.weight
        shape = (cfg.n_layer, num_blocks * block_size, cfg.kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=w.dtype, device=w.device)  # (layers, slots, kv heads, hd)
        self.v = torch.zeros_like(self.k)
        self.num_blocks, self.block_size = num_blocks, block_size

    def slots(self, table: list[int], start: int, end: int) -> torch.Tensor:
        """The slots of positions start … end - 1 of the sequence whose blocks are `table`."""
        pos = torch.arange(start, end)
        return torch.tensor(table, dtype=torch.long)[pos // self.block_size] * self.block_size \
            + pos % self.block_size


@dataclass
class Row:
    """One sequence in a forward call: it feeds `tokens`, after `start` tokens already cached."""

    tokens: list[int]
    start: int
    table: list[int]
    all_logits: bool = False  # a logits row for every token fed (lesson 10's verify), not the last


@torch.inference_mode()
def forward(model, pool: KVPool, rows: list[Row]) -> list[torch.Tensor]:
    """One pass for many sequences at once: their new tokens packed end to end through the
    token-wise layers, each attending to its own cached keys. The K/V of every new token go into
    `pool`. Returns, per row, its logits: ``(len(tokens), V)`` with `all_logits`, else ``(1, V)``."""
    tf, dev = model.transformer, pool.k.device
    ids = torch.tensor([t for r in rows for t in r.tokens], device=dev)  # (N,) all new tokens
    pos = torch.cat([torch.arange(r.start, r.start + len(r.tokens)) for r in rows]).to(dev)
    slots = torch.cat([pool.slots(r.table, r.start, r.start + len(r.tokens)) for r in rows]).to(dev)
    x = tf.wte(ids)  # (N, C)
    if tf.wpe is not None:  # GPT-2: a learned vector per position, added once
        x = x + tf.wpe(pos)
    rope = rope_angles(model, pos, x.dtype)  # Llama, Qwen: every layer turns q and k instead
    for layer, block in enumerate(tf.h):
        x = x + attention(block.attn, block.ln_1(x), layer, pool, rows, slots, rope, model.config)
        x = x + mlp(block.mlp, block.ln_2(x), model.config)
    ends = torch.tensor([len(r.tokens) for r in rows]).cumsum(0).tolist()
    keep = [i for r, end in zip(rows, ends)
            for i in (range(end - len(r.tokens), end) if r.all_logits else [end - 1])]
    logits = model.lm_head(tf.ln_f(x[keep])).float()  # only the rows someone samples from
    return list(logits.split([len(r.tokens) if r.all_logits else 1 for r in rows]))


def attention(attn, x, layer: int, pool: KVPool, rows: list[Row], slots, rope, cfg) -> torch.Tensor:
    """One layer's attention for the packed tokens `x` ``(N, C)``: q, k, v; k and v written into
    the pool (lesson 03); every row's queries over its own keys (lesson 07); the output projection."""
    nh, nkv, hd = cfg.n_head, cfg.kv_heads, cfg.head_dim
    q, k, v = attn.c_attn(x).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
    q, k, v = q.view(-1, nh, hd), k.view(-1, nkv, hd), v.view(-1, nkv, hd)  # (N, heads, hd)
    if rope is not None:  # Qwen3 normalises each head first (q_norm, k_norm: identity elsewhere)
        q, k = rotate(attn.q_norm(q), *rope), rotate(attn.k_norm(k), *rope)
    pool.k[layer, slots], pool.v[layer, slots] = k, v  # cached: keys already turned (lesson 03)
    out = attend(q, pool.k[layer], pool.v[layer], rows, pool)  # (N, nh, hd)
    return attn.c_proj(out.reshape(-1, nh * hd))


def attend(q, K, V, rows: list[Row], pool: KVPool) -> torch.Tensor:
    """softmax(q kᵀ / √hd) v, each row over its own tokens: the rows' keys gathered from their
    blocks into one padded batch, and lesson 07's mask hiding the padding and the future."""
    lens = [r.start + len(r.tokens) for r in rows]
    B, T, S, nh, hd = len(rows), max(len(r.tokens) for r in rows), max(lens), *q.shape[1:]
    gather = torch.zeros(B, S, dtype=torch.long)  # row b's slots, padded with slot 0
    qb = q.new_zeros(B, T, nh, hd)  # row b's queries, padded with zeros
    n = 0
    for b, r in enumerate(rows):
        gather[b, : lens[b]] = pool.slots(r.table, 0, lens[b])
        qb[b, : len(r.tokens)], n = q[n : n + len(r.tokens)], n + len(r.tokens)
    k, v = K[gather.to(K.device)], V[gather.to(K.device)]  # (B, S, kv heads, hd)
    k, v = (t.repeat_interleave(nh // t.shape[2], dim=2) for t in (k, v))  # GQA: share kv heads
    scores = qb.transpose(1, 2) @ k.permute(0, 2, 3, 1) / math.sqrt(hd)  # (B, nh, T, S)
    q_pos = torch.tensor([r.start for r in rows])[:, None] + torch.arange(T)  # (B, T)
    key = torch.arange(S)
    visible = (key <= q_pos[:, :, None]) & (key < torch.tensor(lens)[:, None, None])  # (B, T, S)
    w = scores.masked_fill(~visible[:, None].to(K.device), float("-inf")).softmax(-1)
    out = (w @ v.transpose(1, 2)).transpose(1, 2)  # (B, T, nh, hd)
    return torch.cat([out[b, : len(r.tokens)] for b, r in enumerate(rows)])  # (N, nh, hd)


def rope_angles(model, pos, dtype):
    """Rotary positions (lesson 03): cos and sin ``(N, 1, hd/2)`` of each token's angles, or
    None for a model with learned positions. The frequencies are the model's (Llama 3 scales them)."""
    if model.rotary is None:
        return None
    angles = pos.float()[:, None] * model.rotary.inv_freq.to(pos.device)  # (N, hd/2)
    return angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]


def rotate(x, cos, sin):
    """Turn each pair (x[i], x[i + hd/2]) by its angle (lesson 03)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def mlp(m, x, cfg):
    """GPT-2's GELU MLP, or Llama's SwiGLU (gate and up rows fused in ``c_fc``)."""
    if cfg.mlp == "swiglu":
        gate, up = m.c_fc(x).chunk(2, dim=-1)
        return m.c_proj(F.silu(gate) * up)
    return m.c_proj(F.gelu(m.c_fc(x), approximate="tanh"))


# ---- lessons 02 and 03: one sequence, a prefill then decode steps ---------------------------
class Cache:
    """One sequence's cache (lesson 03): a pool of one block, as long as the sequence may grow."""

    def __init__(self, model, max_len: int) -> None:
        self.pool, self.pos = KVPool(model, 1, max_len), 0  # pos: tokens cached so far

    def rollback(self, n: int) -> None:
        """Forget the last `n` tokens (lesson 10); later tokens overwrite their slots."""
        self.pos -= n


def feed(model, tokens: list[int], cache: Cache, all_logits: bool = True) -> torch.Tensor:
    """Feed `tokens` on top of what `cache` holds: logits ``(len(tokens), V)`` (or the last)."""
    [logits] = forward(model, cache.pool, [Row(list(tokens), cache.pos, [0], all_logits)])
    cache.pos += len(tokens)
    return logits


def prefill(model, ids: list[int], cache: Cache) -> torch.Tensor:
    """All prompt tokens in one pass; the next token's logits ``(V,)``."""
    return feed(model, ids, cache, all_logits=False)[-1]


def decode_step(model, token: int, cache: Cache) -> torch.Tensor:
    """One new token in, everything earlier from the cache; the next token's logits ``(V,)``."""
    return feed(model, [token], cache, all_logits=False)[-1]


def greedy_cached(model, ids: list[int], max_new_tokens: int, vocab_size: int) -> list[int]:
    """Lesson 02's run: one prefill, then a decode step per token; greedy."""
    cache = Cache(model, len(ids) + max_new_tokens)
    logits, out = prefill(model, ids, cache), []
    while True:
        out.append(int(logits[:vocab_size].argmax()))
        if len(out) == max_new_tokens:
            return out
        logits = decode_step(model, out[-1], cache)
