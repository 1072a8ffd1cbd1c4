"""Attention over a paged KV cache gives the static cache's logits (fp32)."""

from __future__ import annotations

import pytest
import torch

import minifer as mf
from conftest import packed_batch
from minifer.engine.block_manager import BlockManager
from minifer.engine.kv_pool import PackedBatch, PagedKVPool


def _prompts(n_tokens, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in n_tokens]


def _static_logits(model, prompt, feed):
    """Prefill `prompt` alone, then feed `feed` one token at a time: logits after each pass."""
    cache = mf.StaticKVCache.for_model(model, 1, len(prompt) + len(feed))
    cache.reset()
    out = [model(torch.tensor([prompt]), cache=cache)[0, -1]]
    for t in feed:
        out.append(model(torch.tensor([[t]]), cache=cache)[0, -1])
    return torch.stack(out)


@pytest.mark.parametrize("read", ["blocks", "slots", "kernel"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@torch.inference_mode()
def test_chunked_prefill_and_batched_decode_match_the_static_cache(model, block_size, read):
    """Prompts fed in chunks, then decoded together in packed calls (rows of different
    lengths, blocks scattered over the pool): every row's logits equal its static-cache logits
    to float rounding (4e-6 of the logits' scale: the sums run in other orders; an AVX2-only
    AMD EPYC reached 1.0e-6), whichever way attention reads the pool."""
    prompts = _prompts([5, 17, 9, 30])
    feed = [3, 7, 11, 250]
    refs = [_static_logits(model, p, feed) for p in prompts]
    bm, pool = BlockManager(128, block_size), PagedKVPool.for_model(model, 128, block_size)
    outs = [[] for _ in prompts]
    for i, p in enumerate(prompts):  # interleaved: tables are not contiguous runs of the pool
        bm.allocate(i, p)
    for i, p in enumerate(prompts):
        cuts = [0, len(p) // 3, len(p)]
        for a, b in zip(cuts, cuts[1:]):
            if a < b:
                batch = packed_batch(pool, [bm.tables[i]], [a], [b - a], read=read)
                logits = model(torch.tensor([p[a:b]]), cache=batch)[0]
        outs[i].append(logits)
    context = [len(p) for p in prompts]
    for t in feed:
        for i in range(len(prompts)):
            bm.append_slots(i, context[i] + 1)
        batch = packed_batch(pool, [bm.tables[i] for i in range(len(prompts))], context,
                             [1] * len(prompts), read=read)
        logits = model(torch.full((1, len(prompts)), t), cache=batch)
        for i in range(len(prompts)):
            outs[i].append(logits[i])
        context = [c + 1 for c in context]
    for out, ref in zip(outs, refs):
        out = torch.stack(out)
        scale = ref.abs().max()
        assert (out - ref).abs().max() <= 4e-6 * scale, (out - ref).abs().max() / scale
        assert torch.equal(out.argmax(-1), ref.argmax(-1))


def test_pool_shapes_bytes_and_errors(tiny_gqa):
    pool = PagedKVPool.for_model(tiny_gqa, 8, 4)
    cfg = tiny_gqa.config
    assert pool.k[0].shape == (8, 4, cfg.kv_heads, cfg.head_dim) and len(pool.v) == cfg.n_layer
    assert pool.bytes_per_token == cfg.kv_bytes_per_token(4)
    assert pool.nbytes == 8 * 4 * pool.bytes_per_token
    assert pool.slots([3, 1], 2, 6) == [14, 15, 4, 5]
    with pytest.raises(ValueError, match="cannot hold"):
        PackedBatch(pool, [[0]], [4], [1])  # one block of 4 slots: no room for a 5th token
    with pytest.raises(ValueError, match="num_blocks"):
        PagedKVPool(1, 0, 4, 1, 8)
    with pytest.raises(ValueError, match="dtype"):
        PagedKVPool(1, 2, 4, 1, 8, dtype=torch.int8)
