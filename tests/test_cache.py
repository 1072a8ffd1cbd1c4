"""StaticKVCache: in-place writes, per-row lengths, rollback, byte accounting, errors."""

from __future__ import annotations

import pytest
import torch

from minifer import GPTConfig, StaticKVCache, decode_step, prefill


def _equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.equal(a, b), f"max |diff| = {(a - b).abs().max().item():.3g}"


def test_decode_writes_in_place_without_concatenating(model, monkeypatch):
    cache = StaticKVCache.for_model(model, batch_size=2, max_len=32)
    ks, vs = list(cache.k), list(cache.v)
    ptrs = [t.data_ptr() for t in ks + vs]
    prefill(model, torch.randint(0, 257, (2, 5)), cache)

    def no_cat(*args, **kwargs):
        raise AssertionError("torch.cat called inside a decode step")

    monkeypatch.setattr(torch, "cat", no_cat)
    tok = torch.tensor([1, 2])
    for step in range(10):
        before = cache.k[0][:, :, 5 + step].clone()
        decode_step(model, tok, cache)
        assert not torch.equal(cache.k[0][:, :, 5 + step], before)  # the slot was written
    monkeypatch.undo()
    assert cache.pos == 15
    assert all(a is b for a, b in zip(cache.k + cache.v, ks + vs))  # same tensor objects
    assert [t.data_ptr() for t in cache.k + cache.v] == ptrs  # same storage
    assert all(t.shape == (2, model.config.kv_heads, 32, model.config.head_dim)
               for t in cache.k + cache.v)
    assert not cache.k[0][:, :, 15:].any()  # nothing written beyond pos


def test_update_returns_views_of_the_valid_prefix():
    cache = StaticKVCache(n_layer=1, batch_size=1, n_kv_head=2, head_dim=4, max_len=8)
    k = torch.ones(1, 2, 3, 4)
    kk, vv = cache.update(0, k, 2 * k)
    assert kk.shape == (1, 2, 3, 4) and kk.data_ptr() == cache.k[0].data_ptr()
    assert torch.equal(vv, 2 * k)
    assert cache.pos == 0  # moves only on advance, after every layer wrote
    cache.advance(3)
    kk, _ = cache.update(0, 3 * torch.ones(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    assert kk.shape == (1, 2, 4, 4) and kk[0, 0, 3, 0] == 3 and kk[0, 0, 2, 0] == 1


def test_lengths_per_row_with_left_padding(tiny):
    cache = StaticKVCache.for_model(tiny, batch_size=3, max_len=20)
    assert cache.lengths.tolist() == [0, 0, 0] and not cache.padded
    cache.reset([0, 4, 6])  # prompts of 7, 3 and 1 tokens padded to 7
    assert cache.padded and cache.start.tolist() == [0, 4, 6]
    prefill(tiny, torch.randint(0, 257, (3, 7)), cache)
    assert cache.pos == 7 and cache.lengths.tolist() == [7, 3, 1]
    decode_step(tiny, torch.tensor([1, 2, 3]), cache)
    assert cache.lengths.tolist() == [8, 4, 2]
    cache.rollback(3)
    assert cache.lengths.tolist() == [5, 1, 0]  # never negative
    cache.reset()
    assert cache.pos == 0 and cache.start.tolist() == [0, 0, 0] and not cache.padded
    with pytest.raises(ValueError, match="start"):
        cache.reset([1, 2])


def test_rollback_then_redecode_equals_never_rolling_back(model):
    prompt = torch.randint(0, 257, (2, 6), generator=torch.Generator().manual_seed(0))
    toks = [torch.tensor([3, 4]), torch.tensor([5, 6]), torch.tensor([7, 8])]
    cache = StaticKVCache.for_model(model, 2, 16)
    prefill(model, prompt, cache)
    first = [decode_step(model, t, cache) for t in toks]
    cache.rollback(2)
    assert cache.pos == 7
    again = [decode_step(model, t, cache) for t in toks[1:]]
    for a, b in zip(first[1:], again):
        _equal(a, b)

    # rejected tokens leave no trace: rollback + other tokens == a cache that never saw them
    cache.rollback(2)
    after = decode_step(model, torch.tensor([9, 10]), cache)
    fresh = StaticKVCache.for_model(model, 2, 16)
    prefill(model, prompt, fresh)
    decode_step(model, toks[0], fresh)
    _equal(after, decode_step(model, torch.tensor([9, 10]), fresh))


@pytest.mark.parametrize("n", [-1, 4, 100])
def test_rollback_out_of_range_raises(n):
    cache = StaticKVCache(1, 1, 1, 4, 8)
    cache.advance(3)
    with pytest.raises(ValueError, match="rollback"):
        cache.rollback(n)
    assert cache.pos == 3
    cache.rollback(3)
    assert cache.pos == 0


def test_nbytes_and_bytes_per_token_formulas():
    cache = StaticKVCache(n_layer=3, batch_size=2, n_kv_head=4, head_dim=8, max_len=10)
    assert cache.bytes_per_token == 2 * 3 * 4 * 8 * 4
    assert cache.nbytes == 2 * 3 * 2 * 4 * 10 * 8 * 4 == cache.bytes_per_token * 2 * 10
    half = StaticKVCache(3, 2, 4, 8, 10, dtype=torch.bfloat16)
    assert half.nbytes * 2 == cache.nbytes and half.bytes_per_token * 2 == cache.bytes_per_token
    assert "nbytes=" in repr(cache)


def test_reference_cache_costs_32_768_bytes_per_token():
    """Claim KV-4's number, from the cache itself: reference model, fp32."""
    cfg = GPTConfig.preset("reference")
    cache = StaticKVCache(cfg.n_layer, 1, cfg.kv_heads, cfg.head_dim, max_len=4)
    assert cache.bytes_per_token == 32_768 == cfg.kv_bytes_per_token()
    assert cache.nbytes == 4 * 32_768


def test_gqa_cache_is_smaller(tiny, tiny_gqa):
    mha = StaticKVCache.for_model(tiny, 1, 16)
    gqa = StaticKVCache.for_model(tiny_gqa, 1, 16)
    assert mha.n_kv_head == 4 and gqa.n_kv_head == 2
    assert mha.nbytes == 2 * gqa.nbytes
    assert gqa.bytes_per_token == tiny_gqa.config.kv_bytes_per_token()


def test_check_room_when_full(tiny):
    cache = StaticKVCache.for_model(tiny, 1, max_len=6)
    prefill(tiny, torch.zeros(1, 5, dtype=torch.long), cache)
    decode_step(tiny, torch.zeros(1, dtype=torch.long), cache)  # slot 6 of 6
    with pytest.raises(ValueError, match="full"):
        decode_step(tiny, torch.zeros(1, dtype=torch.long), cache)
    assert cache.pos == 6
    with pytest.raises(ValueError, match="full"):
        cache.check_room(1)
    cache.check_room(0)


@pytest.mark.parametrize("max_len", [0, -1, 129, 2.5, "8"])
def test_for_model_max_len_validation(tiny, max_len):
    with pytest.raises(ValueError, match="max_len"):
        StaticKVCache.for_model(tiny, 1, max_len)


def test_for_model_follows_the_model():
    from minifer import GPT

    m = GPT.from_config("tiny-gqa", dtype=torch.bfloat16)
    cache = StaticKVCache.for_model(m, 3)
    assert (cache.n_layer, cache.batch_size, cache.n_kv_head, cache.head_dim, cache.max_len) == (
        2, 3, 2, 8, 128)
    assert cache.dtype == torch.bfloat16 and cache.device.type == "cpu"
    assert StaticKVCache.for_model(m, 1, dtype=torch.float32).k[0].dtype == torch.float32


@pytest.mark.parametrize("field", ["n_layer", "batch_size", "n_kv_head", "head_dim", "max_len"])
def test_constructor_validation(field):
    kwargs = dict(n_layer=1, batch_size=1, n_kv_head=1, head_dim=4, max_len=4)
    kwargs[field] = 0
    with pytest.raises(ValueError, match=field):
        StaticKVCache(**kwargs)


def test_every_cache_keeps_the_written_contract(tiny):
    """`StaticKVCache` is a `KVCache`, the serving engine's packed view of its paged pool a
    `PackedKVCache`, and the model's type hints say so."""
    import typing

    from minifer.cache import KVCache, PackedKVCache
    from minifer.engine.kv_pool import PackedBatch, PagedKVPool
    from minifer.model import GPT

    pool = PagedKVPool.for_model(tiny, num_blocks=4, block_size=4)
    assert isinstance(StaticKVCache.for_model(tiny, 2, 8), KVCache)
    assert isinstance(PackedBatch(pool, [[0], [1]], [2, 3], [1, 1]), PackedKVCache)
    assert not isinstance(object(), KVCache)
    hints = typing.get_type_hints(GPT.forward)
    assert KVCache in typing.get_args(hints["cache"])


def test_a_float_kv_dtype_other_than_the_models_is_a_clear_error():
    """kv_dtype=torch.float16 on an fp32 model used to fail inside SDPA (q and k dtypes)."""
    import minifer as mf

    model = mf.GPT.from_config("tiny")
    params = mf.SamplingParams(temperature=0, max_new_tokens=3)
    with pytest.raises(ValueError, match=r"kv_dtype .* must be None or torch.float32"):
        mf.generate(model, [[1, 2, 3]], params, kv_dtype=torch.float16)
    for ok in (None, torch.float32, "int8"):
        assert len(mf.generate(model, [[1, 2, 3]], params, kv_dtype=ok)[0].token_ids) == 3
