"""GPT forward: cached == recomputed, left padding, attention implementations, dtype, errors."""

from __future__ import annotations

import copy

import pytest
import torch

import minifer as mf
from conftest import logits_atol, on_device
from minifer import GPT, StaticKVCache, decode_step, prefill
from minifer.fast import layout

ATOL = 1e-5


def _close(a: torch.Tensor, b: torch.Tensor, atol: float = ATOL) -> None:
    """|a - b| <= atol everywhere (cheaper than torch.testing.assert_close in a loop)."""
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a.float() - b.float()).abs().max().item()
    assert err <= atol, f"max |diff| = {err:.3g} > {atol}"


def _ids(model, B, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (B, T), generator=g)


def test_cached_prefill_then_decode_equals_full_recompute(model, device):
    """Claim KV-1: a token's K/V never change, so the cache gives the same logits."""
    model, atol = on_device(model, device), logits_atol(device)
    ids = _ids(model, 2, 40).to(device)
    full = model(ids)  # (B, T, V): every position recomputed from scratch
    cache = StaticKVCache.for_model(model, batch_size=2, max_len=64)
    logits = model(ids[:, :16], cache=cache)
    _close(logits, full[:, :16], atol)
    for t in range(16, 40):
        step = model(ids[:, t:t + 1], cache=cache)
        _close(step[:, 0], full[:, t], atol)
    assert cache.pos == 40


def test_cached_chunks_equal_full_recompute(model):
    """Several new tokens at once on top of a cache (chunked prefill / speculative verify)."""
    ids = _ids(model, 3, 30, seed=1)
    full = model(ids)
    cache = StaticKVCache.for_model(model, 3, 30)
    outs = [model(ids[:, a:b], cache=cache) for a, b in [(0, 7), (7, 8), (8, 20), (20, 30)]]
    _close(torch.cat(outs, dim=1), full, ATOL)


def test_prefill_and_decode_step_helpers(model):
    ids = _ids(model, 2, 12, seed=2)
    full = model(ids)
    cache = StaticKVCache.for_model(model, 2, 16)
    last = prefill(model, ids[:, :8], cache)
    assert last.shape == (2, model.config.vocab_size)
    _close(last, full[:, 7], ATOL)
    for t in range(8, 12):
        _close(decode_step(model, ids[:, t], cache), full[:, t], ATOL)


def test_last_only_returns_the_last_position(model):
    ids = _ids(model, 2, 9)
    out = model(ids, last_only=True)
    assert out.shape == (2, 1, model.config.vocab_size)
    _close(out[:, 0], model(ids)[:, -1], ATOL)


def _left_pad(prompts, pad=0):
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - len(p):] = torch.tensor(p)
    return ids, torch.tensor([T - len(p) for p in prompts])


@pytest.mark.parametrize("pad", [0, 97])
def test_left_padded_rows_equal_the_prompts_alone(model, pad, device):
    model, atol = on_device(model, device), logits_atol(device)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 257, (n,), generator=g).tolist() for n in (11, 3, 7, 1)]
    ids, start = _left_pad(prompts, pad)
    ids, start = ids.to(device), start.to(device)
    T = ids.shape[1]
    alone = [model(torch.tensor([p], device=device))[0] for p in prompts]  # (len, V) each

    no_cache = model(ids, start=start)
    cache = StaticKVCache.for_model(model, len(prompts), T + 5)
    cache.reset(start)
    cached = model(ids, cache=cache)
    for out in (no_cache, cached):
        assert not out.isnan().any()
        for b, p in enumerate(prompts):
            _close(out[b, T - len(p):], alone[b], atol)

    # and decoding on: each row still matches its own sequence continued alone
    nxt = torch.tensor([[5], [6], [7], [8]], device=device)
    step = model(nxt, cache=cache)
    for b, p in enumerate(prompts):
        ref = model(torch.tensor([p + [5 + b]], device=device))[0, -1]
        _close(step[b, 0], ref, atol)


def test_math_attention_equals_sdpa(make_lively):
    m = make_lively("tiny-gqa", seed=4)  # own copy: set_attention changes the model
    ids = _ids(m, 2, 20, seed=4)
    padded, start = _left_pad([ids[0, :20].tolist(), ids[1, :6].tolist()])

    def run():
        cache = StaticKVCache.for_model(m, 2, 24)
        cache.reset(start)
        return m(ids), m(padded, start=start), m(padded, cache=cache), m(ids[:, :1], cache=cache)

    sdpa = run()
    m.set_attention("math")
    assert all(b.attn.impl == "math" for b in m.transformer.h)
    maths = run()
    for a, b in zip(sdpa, maths):
        _close(a, b, ATOL)
    m.set_attention("sdpa")
    _close(m(ids), sdpa[0], 0)
    with pytest.raises(ValueError, match="impl"):
        m.set_attention("flash")


def test_bf16_forward_runs_and_stays_close():
    m32 = GPT.from_config("tiny", seed=5)
    m16 = GPT.from_config("tiny", seed=5, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in m16.parameters())
    ids = torch.randint(0, 257, (2, 10))
    cache = StaticKVCache.for_model(m16, 2, 12)
    assert cache.dtype == torch.bfloat16 and cache.k[0].dtype == torch.bfloat16
    out = m16(ids, cache=cache)
    assert out.dtype == torch.bfloat16 and out.isfinite().all()
    step = m16(ids[:, :1], cache=cache)
    assert step.shape == (2, 1, 257) and step.isfinite().all()
    _close(out.float(), m32(ids), 0.05)  # bf16 keeps ~3 significant digits


def test_device_argument_is_respected():
    m = GPT.from_config("tiny", device="meta")
    assert {p.device.type for p in m.parameters()} == {"meta"}
    out = m(torch.zeros(2, 5, dtype=torch.long, device="meta"))
    assert out.device.type == "meta" and out.shape == (2, 5, 257)
    cache = StaticKVCache.for_model(m, 2)
    assert cache.k[0].device.type == "meta" and cache.max_len == 128
    cache.reset([0, 3])  # left padding: masks and positions must follow the ids' device too
    out = m(torch.zeros(2, 5, dtype=torch.long, device="meta"), cache=cache)
    out = m(torch.zeros(2, 1, dtype=torch.long, device="meta"), cache=cache)
    assert out.device.type == "meta" and cache.pos == 6
    cpu = GPT.from_config("tiny", device="cpu")
    assert {p.device.type for p in cpu.parameters()} == {"cpu"}


def test_same_seed_same_weights_and_eval_mode():
    a, b = GPT.from_config("tiny", seed=7), GPT.from_config("tiny", seed=7)
    c = GPT.from_config("tiny", seed=8)
    assert not a.training
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["lm_head.weight"], sc["lm_head.weight"])


@pytest.mark.parametrize("bad", [
    torch.zeros(2, 3),  # float
    torch.zeros(2, 3, dtype=torch.bool),
    torch.zeros(2, 3, dtype=torch.int16),
])
def test_bad_idx_dtype_raises(tiny, bad):
    with pytest.raises(ValueError, match="idx"):
        tiny(bad)


@pytest.mark.parametrize("shape", [(5,), (1, 2, 3), ()])
def test_bad_idx_shape_raises(tiny, shape):
    with pytest.raises(ValueError, match="shape"):
        tiny(torch.zeros(shape, dtype=torch.long))


def test_int32_ids_are_accepted(tiny):
    ids = torch.randint(0, 257, (1, 6))
    _close(tiny(ids.int()), tiny(ids), 0)


def test_exceeding_the_context_raises(tiny):
    ctx = tiny.config.context_length
    tiny(torch.zeros(1, ctx, dtype=torch.long))  # exactly the context is fine
    with pytest.raises(ValueError, match="context"):
        tiny(torch.zeros(1, ctx + 1, dtype=torch.long))
    cache = StaticKVCache.for_model(tiny, 1)
    tiny(torch.zeros(1, ctx - 1, dtype=torch.long), cache=cache)
    tiny(torch.zeros(1, 1, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="context"):
        tiny(torch.zeros(1, 1, dtype=torch.long), cache=cache)


def test_batch_size_mismatch_with_cache_raises(tiny):
    cache = StaticKVCache.for_model(tiny, batch_size=2, max_len=8)
    with pytest.raises(ValueError, match="batch"):
        tiny(torch.zeros(3, 2, dtype=torch.long), cache=cache)
    assert cache.pos == 0  # nothing was written


def test_gqa_has_fewer_kv_weights_than_mha(tiny, tiny_gqa):
    assert tiny_gqa.transformer.h[0].attn.c_attn.weight.shape == (32 + 2 * 2 * 8, 32)
    assert tiny.transformer.h[0].attn.c_attn.weight.shape == (3 * 32, 32)


@pytest.mark.parametrize("bad", [-1, 257, 10**6])
def test_out_of_range_ids_raise_value_error(tiny, bad):
    ids = torch.tensor([[1, 2, bad, 3]])
    with pytest.raises(ValueError, match=r"idx.*\[0, 257\).*" + str(bad)):
        tiny(ids)
    cache = StaticKVCache.for_model(tiny, 1, 16)
    with pytest.raises(ValueError, match=r"\[0, 257\)"):
        tiny(ids, cache=cache)
    assert cache.pos == 0  # nothing written
    tiny(torch.tensor([[1, 2]]), cache=cache)
    with pytest.raises(ValueError, match=r"\[0, 257\)"):  # a CPU decode step is checked too
        tiny(torch.tensor([[bad]]), cache=cache)
    assert cache.pos == 2


def test_range_check_skips_accelerator_decode_steps():
    """Decode steps and verification chunks feed tokens the engine produced itself; on a GPU
    checking them would cost a host sync per step, so there only fresh sequences are checked."""
    from minifer.model import _checks_ids
    assert _checks_ids("cpu", fresh=True) and _checks_ids("cpu", fresh=False)
    assert _checks_ids("cuda", fresh=True) and _checks_ids("mps", fresh=True)
    assert not _checks_ids("cuda", fresh=False) and not _checks_ids("mps", fresh=False)
    assert not _checks_ids("meta", fresh=True)  # no values to check


@pytest.mark.parametrize("shape", [(1, 0), (0, 3)])
def test_empty_idx_raises(tiny, shape):
    with pytest.raises(ValueError, match="idx.*empty"):
        tiny(torch.zeros(shape, dtype=torch.long))


def _linears(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


@pytest.fixture
def column_major(monkeypatch):
    """`fast.layout` as on an Intel CPU: column-major weights (it packs them for oneDNN where
    MKL runs its generic code, `tests/test_fast.py`)."""
    monkeypatch.setattr(layout, "mkl_generic", lambda: False)


@pytest.mark.parametrize("tie", [False, True])
def test_linear_weights_are_column_major_and_compute_what_row_major_does(tie, column_major):
    """GPT keeps each linear weight (out, in) column-major, the layout CPU GEMMs are fastest
    at: the same function as the row-major weights, to float rounding, the same greedy tokens,
    and the same int8 weights when quantized."""
    model = GPT.from_config(mf.GPTConfig.preset("tiny").replace(tie_embeddings=tie), seed=2)
    assert all(m.weight.t().is_contiguous() and not m.weight.is_contiguous()
               for m in _linears(model))
    assert (model.lm_head.weight is model.transformer.wte.weight) == tie
    rows = copy.deepcopy(model)
    with torch.no_grad():
        for m in _linears(rows):
            m.weight.data = m.weight.data.contiguous()
    assert all(m.weight.is_contiguous() for m in _linears(rows))
    assert (rows.lm_head.weight is rows.transformer.wte.weight) == tie
    ids = _ids(model, 3, 20)
    _close(model(ids), rows(ids))
    params = mf.SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    prompts = ids[:, :8].tolist()
    assert [c.token_ids for c in mf.generate(model, prompts, params)] == \
        [c.token_ids for c in mf.generate(rows, prompts, params)]
    q_cols = mf.quantize(model, "int8", impl="reference")
    q_rows = mf.quantize(rows, "int8", impl="reference")
    for a, b in zip(q_cols.buffers(), q_rows.buffers()):
        assert torch.equal(a, b)


def test_the_layout_survives_to_and_deepcopy(column_major):
    model = GPT.from_config("tiny").to(dtype=torch.bfloat16)
    assert all(m.weight.t().is_contiguous() for m in _linears(copy.deepcopy(model)))


def test_a_meta_model_has_shapes_and_no_weights():
    """A 70B-shaped model on the meta device: parameters counted, cache sized, nothing allocated
    (built directly there: random weights for 69B parameters would not fit in this machine)."""
    from minifer.config import LLAMA

    shape = mf.GPTConfig(vocab_size=32000, context_length=4096, n_layer=80, n_head=64,
                         n_embd=8192, n_kv_head=8, intermediate_size=28672,
                         **LLAMA)  # Llama-2-70B, GQA 64 → 8
    big = GPT.from_config(shape, device="meta", dtype=torch.bfloat16)
    assert big.num_params() == 68_976_648_192
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in big.parameters())
    cache = StaticKVCache.for_model(big, batch_size=1, max_len=16)
    assert cache.bytes_per_token == 2 * 80 * 8 * 128 * 2 == big.config.kv_bytes_per_token(2)
