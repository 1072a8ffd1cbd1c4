"""The speed-up package (`minifer.fast`): plugged in at one seam, off without changing results."""

from __future__ import annotations

import pytest
import torch

import minifer as mf
from conftest import engine_reading, packed_batch
from minifer import fast, hooks
from minifer.fast import layout
from minifer.fast.argmax import first_argmax
from minifer.fast.prepack import PackedLinear


def test_import_minifer_plugs_the_speed_ups_in_and_disabled_takes_them_out():
    assert fast.installed()
    assert hooks.argmax is first_argmax and hooks.lay_out_weights is layout.lay_out_weights
    with fast.disabled():
        assert not fast.installed()
        assert hooks.argmax is not first_argmax
    assert fast.installed()


def test_the_core_with_the_speed_ups_off_gives_the_same_greedy_tokens():
    """Greedy tokens of the shipped model, batched with mixed lengths, with every speed-up on
    and off (the model built inside each, so its weight layout differs too)."""
    params = mf.SamplingParams(temperature=0, max_new_tokens=24)
    prompts = ["ROMEO:\n", "JULIET: O Romeo, Romeo!", "KING"]

    def run():
        model, tok = mf.load_pretrained("shakespeare")
        return [c.token_ids for c in mf.generate(model, prompts, params, tok, threads=1)]

    on = run()
    with fast.disabled():
        off = run()
        model, _ = mf.load_pretrained("shakespeare")
        assert model.lm_head.weight.is_contiguous()  # torch's own layout
    assert on == off


def test_the_plain_seam_runs_everything_generate_takes():
    model = mf.GPT.from_config("tiny")
    with fast.disabled():
        for kwargs in ({"compile": True}, {"threads": "auto"}, {"threads": 1}, {"use_cache": False}):
            [c] = mf.generate(model, [[1, 2, 3]], mf.SamplingParams(temperature=0, max_new_tokens=4),
                              **kwargs)
            assert len(c.token_ids) == 4


def _plain_onednn_problem() -> str | None:
    """Why this torch's oneDNN linear cannot take a plain row-major weight (None: it can)."""
    try:
        torch.ops.mkldnn._linear_pointwise(torch.ones(2, 16), torch.ones(8, 16), None, "none", [], "")
    except (RuntimeError, AttributeError, NotImplementedError) as exc:
        return f"oneDNN's linear does not take a plain weight here: {exc}"[:200]
    return None


@pytest.fixture(params=["intel", "mkl_generic"])
def cpu_kind(request, monkeypatch):
    """`fast.layout`'s choice as on an Intel CPU and as where MKL runs its generic code."""
    if request.param == "mkl_generic" and (problem := _plain_onednn_problem()) is not None:
        pytest.skip(problem)
    monkeypatch.setattr(layout, "mkl_generic", lambda: request.param == "mkl_generic")
    return request.param


def test_the_layout_computes_the_same_function(cpu_kind):
    model = mf.GPT.from_config("tiny")
    with fast.disabled():
        plain = mf.GPT.from_config("tiny")
    fc = model.transformer.h[0].mlp.c_fc
    assert not plain.transformer.h[0].mlp.c_fc.weight.t().is_contiguous()
    if cpu_kind == "intel" or fast.prepack.prepack_problem() is not None:
        assert type(fc) is torch.nn.Linear and fc.weight.t().is_contiguous()
    else:  # packed at the first call; the weight stays in torch's own layout
        assert isinstance(fc, PackedLinear) and fc._packed is None
        assert model.lm_head.weight.is_contiguous()
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), plain(ids), rtol=1e-5, atol=1e-5)
    params = mf.SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    with fast.disabled():
        want = [c.token_ids for c in mf.generate(plain, [[1, 2, 3], [4, 5]], params)]
    assert [c.token_ids for c in mf.generate(model, [[1, 2, 3], [4, 5]], params)] == want


def test_a_packed_layout_loads_a_checkpoint_and_moves_dtype(monkeypatch, tmp_path):
    if (problem := fast.prepack.prepack_problem() or _plain_onednn_problem()) is not None:
        pytest.skip(problem)
    monkeypatch.setattr(layout, "mkl_generic", lambda: True)
    with fast.disabled():
        plain = mf.GPT.from_config("tiny", seed=3)
    model = mf.GPT.from_config("tiny")
    model.load_state_dict(plain.state_dict())  # a loaded state dict is packed again
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), plain(ids), rtol=1e-5, atol=1e-5)
        bf16 = mf.quantize(model, "bf16")  # packed in bf16 at its first call, or plain F.linear
        assert (bf16(ids).float() - plain(ids)).abs().max() <= 0.05 * plain(ids).abs().max()


def test_the_chunked_argmax_is_the_reference_argmax():
    logits = torch.randn(5, 50_257, generator=torch.Generator().manual_seed(1))
    logits[2, 7] = logits[2, 50_000] = 1e4  # a tie: the first index wins
    assert torch.equal(first_argmax(logits), logits.argmax(-1))
    with fast.disabled():
        assert torch.equal(hooks.argmax(logits), first_argmax(logits))


def _paged_step(model):
    """A pool holding five rows' cached K/V (blocks of 4, interleaved), and a packed step that
    feeds three decode rows of different lengths, a whole prompt and a prompt's second chunk."""
    from minifer.engine.block_manager import BlockManager
    from minifer.engine.kv_pool import PagedKVPool

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (7, 23, 2, 16, 30)]
    cached = [6, 22, 1, 0, 9]
    bm, pool = BlockManager(64, 4), PagedKVPool.for_model(model, 64, 4)
    for i, p in enumerate(prompts):
        bm.allocate(i, p)
    pool.k = [torch.randn(x.shape, generator=g) for x in pool.k]
    pool.v = [torch.randn(x.shape, generator=g) for x in pool.v]
    tables = [bm.tables[i] for i in range(len(prompts))]
    num_new = [len(p) - c for p, c in zip(prompts, cached)]
    return (lambda read: packed_batch(pool, tables, cached, num_new, read=read)), sum(num_new)


@pytest.mark.parametrize("read", ["blocks", "kernel"])
@torch.inference_mode()
def test_the_planned_paged_attention_equals_the_per_row_reference(model, read):
    """`fast.paged` (decode rows batched and grouped by length, whole-block reads, or the paged
    kernel) gives every token the attention of `PackedBatch.attend_rows`, to float rounding."""
    batch, n = _paged_step(model)
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, cfg.n_head, n, cfg.head_dim, generator=g)
    k = torch.randn(1, cfg.kv_heads, n, cfg.head_dim, generator=g)
    fast_batch = batch(read)
    assert fast_batch.attention is not None  # planned
    with fast.disabled():
        plain = batch(read)
    assert plain.attention is None  # the core's reference
    want = plain.attend(0, q, k, k)
    assert (fast_batch.attend(0, q, k, k) - want).abs().max() <= 1e-6
    assert batch("slots").attention is None  # "slots" asks for the reference


@pytest.mark.parametrize("kv_read", ["blocks", "kernel"])
def test_the_engine_with_the_speed_ups_off_gives_the_same_greedy_tokens(tiny, kv_read):
    """The serving engine, decode rows and prompt chunks sharing steps, with the planned paged
    attention on and off: the same greedy tokens."""
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 20, 9, 30, 3)]
    params = mf.SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)

    def run():
        engine = engine_reading(kv_read, tiny, max_num_seqs=4, block_size=4,
                                enable_chunked_prefill=True, max_num_batched_tokens=16)
        return [o.token_ids for o in engine.generate(prompts, params)]

    on = run()
    with fast.disabled():
        off = run()
    assert on == off
