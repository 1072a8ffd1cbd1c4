"""Attention over a paged KV cache gives the static cache's logits (fp32)."""

from __future__ import annotations

import pytest
import torch

import minifer as mf
from minifer.serve.block_manager import BlockManager
from minifer.serve.kv_pool import PagedKVPool


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


@torch.inference_mode()
def test_single_sequence_is_bit_identical(model):
    """Batch 1, whole prompt: the same operations on the same values as the static cache."""
    prompt, feed = _prompts([13])[0], [5, 9, 200, 31, 7]
    ref = _static_logits(model, prompt, feed)
    bm, pool = BlockManager(16, 4), PagedKVPool.for_model(model, 16, 4)
    bm.allocate("a", prompt)
    out = [model(torch.tensor([prompt]), cache=pool.batch([bm.tables["a"]], [0], len(prompt)))[0, -1]]
    n = len(prompt)
    for t in feed:
        bm.append_slots("a", n + 1)
        out.append(model(torch.tensor([[t]]), cache=pool.batch([bm.tables["a"]], [n], 1))[0, -1])
        n += 1
    assert torch.equal(torch.stack(out), ref)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@torch.inference_mode()
def test_chunked_prefill_and_batched_decode_match_the_static_cache(model, block_size):
    """Prompts fed in chunks, then decoded together (rows of different lengths, blocks
    scattered over the pool): every row's logits equal its static-cache logits to 1e-6
    (relative to the logits' scale)."""
    prompts = _prompts([5, 17, 9, 30])
    feed = [3, 7, 11, 250]
    refs = [_static_logits(model, p, feed) for p in prompts]
    bm, pool = BlockManager(128, block_size), PagedKVPool.for_model(model, 128, block_size)
    # interleave allocations so tables are not contiguous runs of the pool
    outs = [[] for _ in prompts]
    for i, p in enumerate(prompts):
        bm.allocate(i, p)
    for i, p in enumerate(prompts):
        cuts = [0, len(p) // 3, len(p)]
        for a, b in zip(cuts, cuts[1:]):
            if a == b:
                continue
            logits = model(torch.tensor([p[a:b]]), cache=pool.batch([bm.tables[i]], [a], b - a),
                           last_only=True)[0, -1]
        outs[i].append(logits)
    context = [len(p) for p in prompts]
    for t in feed:
        for i in range(len(prompts)):
            bm.append_slots(i, context[i] + 1)
        cache = pool.batch([bm.tables[i] for i in range(len(prompts))], context, 1)
        assert cache.padded
        logits = model(torch.full((len(prompts), 1), t), cache=cache)[:, -1]
        for i in range(len(prompts)):
            outs[i].append(logits[i])
        context = [c + 1 for c in context]
    for out, ref in zip(outs, refs):
        out = torch.stack(out)
        scale = ref.abs().max()
        assert (out - ref).abs().max() <= 1e-6 * scale, (out - ref).abs().max() / scale
        assert torch.equal(out.argmax(-1), ref.argmax(-1))


def test_pool_shapes_bytes_and_errors(tiny_gqa):
    pool = PagedKVPool.for_model(tiny_gqa, 8, 4)
    cfg = tiny_gqa.config
    assert pool.k[0].shape == (8, 4, cfg.kv_heads, cfg.head_dim) and len(pool.v) == cfg.n_layer
    assert pool.bytes_per_token == cfg.kv_bytes_per_token(4)
    assert pool.nbytes == 8 * 4 * pool.bytes_per_token
    assert pool.slots([3, 1], 2, 6) == [14, 15, 4, 5]
    with pytest.raises(ValueError, match="cannot hold"):
        pool.batch([[0]], [4], 1)  # one block of 4 slots: no room for a 5th token
    with pytest.raises(ValueError, match="num_blocks"):
        PagedKVPool(1, 0, 4, 1, 8)
    with pytest.raises(ValueError, match="dtype"):
        PagedKVPool(1, 2, 4, 1, 8, dtype=torch.int8)


@torch.inference_mode()
def test_decode_workspace_equals_gathering_every_step(model):
    """Steps through the contiguous decode workspace give the logits of a fresh gather each
    step (bit for bit), and leave the same K/V in the pool."""
    from minifer.serve.kv_pool import DecodeWorkspace

    prompts = _prompts([5, 17, 9], seed=2)
    feed = [3, 7, 11, 250, 1, 2]
    results = []
    for use_workspace in (False, True):
        bm, pool = BlockManager(40, 4), PagedKVPool.for_model(model, 40, 4)
        for i, p in enumerate(prompts):
            bm.allocate(i, p)
            model(torch.tensor([p]), cache=pool.batch([bm.tables[i]], [0], len(p)))
        context, logits = [len(p) for p in prompts], []
        ws = None
        for t in feed:
            for i in range(len(prompts)):
                bm.append_slots(i, context[i] + 1)
            tables = [bm.tables[i] for i in range(len(prompts))]
            if use_workspace:
                if ws is None or not ws.matches([0, 1, 2], context):
                    ws = DecodeWorkspace(pool, [0, 1, 2], tables, context, room=4)
                cache = ws.prepare(tables)
            else:
                cache = pool.batch(tables, context, 1)
            logits.append(model(torch.full((3, 1), t), cache=cache)[:, -1])
            context = [c + 1 for c in context]
        results.append((torch.stack(logits), [k.clone() for k in pool.k + pool.v]))
    (a, pool_a), (b, pool_b) = results
    assert torch.equal(a, b)
    assert all(torch.equal(x, y) for x, y in zip(pool_a, pool_b))
    assert not ws.matches([0, 1], context[:2]) and not ws.matches([0, 1, 2], [1, 2, 3])
