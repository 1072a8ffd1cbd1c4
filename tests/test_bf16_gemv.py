"""The batch-1 bf16 kernel: the reference is a float32 product rounded once to bf16, the C++
kernel agrees with it to float32 rounding (tails of K and N, bias or none, several rows), a
prepacked bf16 layer runs it at one row and keeps to oneDNN at more, bad input gets a clear
error, and where it cannot run (another CPU, a failed build) everything stays correct."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import minifer as mf
from minifer.fast import bf16_gemv as G
from minifer.fast.prepack import PackedLinear, prepack_problem

needs_kernel = pytest.mark.skipif(G.Bf16Gemv.problem() is not None,
                                  reason=f"no batch-1 bf16 kernel here: {G.Bf16Gemv.problem()}")


def _case(M: int, N: int, K: int, bias: bool = True, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(N, K, generator=g) * 0.05).bfloat16()
    x = torch.randn(M, K, generator=g).bfloat16()
    b = torch.randn(N, generator=g).bfloat16() if bias else None
    return x, w, b


def _exact(x, w, b):
    y = x.double() @ w.double().t()
    return y if b is None else y + b.double()


def _within_rounding(got, x, w, b):
    """`got` is the exact product up to one bf16 rounding (half a unit in the 8th bit) and the
    float32 sums' own error (a few units of 2^-24 of the absolute products)."""
    exact = _exact(x, w, b)
    scale = x.double().abs() @ w.double().abs().t()
    if b is not None:
        scale = scale + b.double().abs()
    err = (got.double() - exact).abs()
    return bool((err <= exact.abs() * 2.0**-8 + scale * 2.0**-20).all())


@pytest.mark.parametrize("M,N,K,bias", [(1, 64, 256, True), (1, 7, 100, False), (1, 5, 1, True),
                                        (3, 50, 3072, True), (1, 1001, 768, False)])
def test_reference_is_the_float32_product_rounded_once(M, N, K, bias):
    x, w, b = _case(M, N, K, bias)
    got = G.bf16_reference(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (M, N)
    assert _within_rounding(got, x, w, b)


@needs_kernel
@pytest.mark.parametrize("M,N,K,bias", [(1, 64, 256, True), (1, 7, 100, False), (1, 130, 64, True),
                                        (1, 5, 1, False), (3, 50, 3072, True),
                                        (2, 1001, 320, True), (1, 2304, 768, True)])
def test_kernel_agrees_with_the_reference(M, N, K, bias):
    x, w, b = _case(M, N, K, bias)
    assert G.GEMV.available(), G.GEMV.error
    got = G.GEMV(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (M, N)
    assert _within_rounding(got, x, w, b)
    # both round a float32 sum once: they differ by at most one bf16 step, and rarely
    ref = G.bf16_reference(x, w, b)
    assert (got.float() - ref.float()).abs().max() <= ref.float().abs().max() * 2.0**-7
    assert (got == ref).float().mean() >= 0.9
    x[0] = 0  # a row of zeros gives the bias exactly
    assert torch.equal(G.GEMV(x, w, b)[0], torch.zeros(N, dtype=torch.bfloat16)
                       if b is None else b)


@needs_kernel
def test_kernel_rejects_what_it_cannot_read():
    x, w, b = _case(1, 16, 64)
    with pytest.raises(RuntimeError, match="x \\[M, K\\] and w \\[N, K\\]"):
        G.GEMV(x[:, :32], w, b)
    with pytest.raises(RuntimeError, match="x and w bfloat16 expected"):
        G.GEMV(x, w.float(), b)
    with pytest.raises(RuntimeError, match="bias bfloat16 \\[16\\]"):
        G.GEMV(x, w, b[:4])
    with pytest.raises(RuntimeError, match="contiguous"):
        G.GEMV(x, w.t().contiguous().t(), b)


@pytest.mark.skipif(prepack_problem(torch.bfloat16) is not None,
                    reason=str(prepack_problem(torch.bfloat16)))
def test_a_prepacked_bf16_layer_runs_the_kernel_at_one_row(monkeypatch):
    torch.manual_seed(0)
    lin = nn.Linear(96, 200).bfloat16()
    lin.weight.data = lin.weight.data.t().contiguous().t()  # column-major, as minifer stores it
    packed = PackedLinear.from_linear(lin)
    calls = []
    real = G.GEMV.__call__
    monkeypatch.setattr(G.Bf16Gemv, "__call__",
                        lambda self, *a: calls.append(a[0].shape) or real(*a))
    with torch.inference_mode():
        for shape in [(1, 96), (1, 1, 96), (96,), (4, 96), (2, 3, 96)]:
            x = torch.randn(shape).bfloat16()
            got = packed(x)
            assert got.shape == (*shape[:-1], 200) and got.dtype == torch.bfloat16
            assert _within_rounding(got.reshape(-1, 200), x.reshape(-1, 96), lin.weight, lin.bias)
    one_row = 3 if G.GEMV.available() else 0
    assert calls == [(1, 96)] * one_row  # more rows: oneDNN's packed product
    assert (packed._rows is not None) == G.GEMV.available()
    packed.float()
    assert packed._rows is None and packed._packed is None  # rebuilt from the moved weight


@pytest.mark.skipif(prepack_problem(torch.bfloat16) is not None,
                    reason=str(prepack_problem(torch.bfloat16)))
def test_prepacked_bf16_decode_matches_the_plain_model(tiny):
    """A decode step at batch 1 (the kernel where there is one) and at 3 rows (oneDNN) give the
    plain bf16 model's logits up to bf16 rounding."""
    from minifer.cache import StaticKVCache
    from minifer.fast.decode import LeanStep
    from minifer.generation import decode_step, prefill

    packed = mf.quantize(tiny, "bf16")  # prepacked by default where oneDNN packs bf16
    assert isinstance(packed.lm_head, PackedLinear)
    with mf.fast.disabled():
        model = mf.quantize(tiny, "bf16")
    for rows in (1, 3):
        ids = torch.arange(5 * rows).reshape(rows, 5) % model.config.vocab_size
        logits = []
        for m in (model, packed):
            cache = StaticKVCache.for_model(m, rows, 8)
            cache.reset(torch.zeros(rows, dtype=torch.long))
            with torch.inference_mode():
                first = prefill(m, ids, cache).argmax(-1)
                step = LeanStep(fixed_shape=True)
                logits.append(decode_step(m, first, cache, step=step).float())
        assert (logits[0] - logits[1]).abs().max() <= 0.03 * logits[0].abs().max()
