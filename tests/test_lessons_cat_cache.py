"""The source's torch.cat KV cache (minifer_course.lessons.cat_cache): the same logits as minifer's
in-place cache through the same forward call, and its timing helper runs."""

from __future__ import annotations

import pytest
import torch

import minifer as mf
from minifer_course.lessons.cat_cache import CatKVCache, time_cat_vs_static


@pytest.mark.parametrize("name", ["tiny", "tiny_gqa"])
@torch.inference_mode()
def test_cat_cache_decodes_like_the_static_cache(name, request):
    model = request.getfixturevalue(name)
    prompt = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    cat = CatKVCache.for_model(model, 2, 12)
    static = mf.StaticKVCache.for_model(model, batch_size=2, max_len=12)
    a, b = model(prompt, cache=cat)[:, -1], model(prompt, cache=static)[:, -1]
    for _ in range(4):
        assert torch.allclose(a, b, atol=1e-5)
        tok = a.argmax(-1, keepdim=True)
        a, b = model(tok, cache=cat)[:, -1], model(tok, cache=static)[:, -1]
    assert cat.pos == static.pos == 11 and cat.k[0].shape[2] == 11
    with pytest.raises(ValueError, match="do not fit"):
        cat.check_room(2)


def test_timing_helper(tiny):
    t = time_cat_vs_static(tiny, batch=2, context=8, steps=2, rounds=1)
    assert t.cat_ms > 0 and t.static_ms > 0 and t.static_forward_ms > 0 and t.cat_vs_static > 0
    cfg = tiny.config
    assert t.copy_bytes == 2 * cfg.n_layer * 2 * 8 * cfg.kv_heads * cfg.head_dim * 4
