"""The AVX2 kernels (`minifer.fast.avx2`): W8A8 equal to `w8a8_reference` bit for bit, bf16
equal to `bf16_reference` and fp32 to `F.linear` to float32 rounding, at any number of rows and
with tails of K and N; bad input gets a clear error; int8, bf16 and few-row fp32 layers run them
where minifer's other kernels do not, and the model's tokens stay those of the reference path."""

from __future__ import annotations

import copy

import pytest
import torch

import minifer as mf
from minifer.fast import avx2 as A
from minifer.fast import bf16_gemv, int8_gemv, native
from minifer.quantization import w8a8_reference

needs_kernel = pytest.mark.skipif(A.Avx2Gemm.problem() is not None,
                                  reason=f"no AVX2 kernel here: {A.Avx2Gemm.problem()}")
pytestmark = needs_kernel

SHAPES = [(1, 2304, 768), (2, 768, 768), (3, 5, 37), (16, 768, 3072), (5, 13, 100),
          (1, 4, 16), (7, 3, 1), (17, 130, 64)]  # (M, N, K): odd M, N and K past the tiles


def _case(M: int, N: int, K: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    x[M // 2] *= 100  # one row of another scale: each row has its own
    w = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    return x, w, torch.rand(N, generator=g) * 0.01, torch.randn(N, generator=g)


@pytest.mark.parametrize("M,N,K", SHAPES)
def test_w8a8_equals_the_reference_bit_for_bit(M, N, K):
    assert A.AVX2.available(), A.AVX2.error
    x, w, scales, bias = _case(M, N, K)
    for b in (None, bias):
        assert torch.equal(A.AVX2.w8a8(x, w, scales, b), w8a8_reference(x, w, scales, b))
    x[0] = 0  # a row of zeros: scale 1, the bias alone
    assert torch.equal(A.AVX2.w8a8(x, w, scales, bias)[0], bias)


@pytest.mark.parametrize("M,N,K", SHAPES)
def test_bf16_equals_the_reference_to_rounding(M, N, K):
    assert A.AVX2.available(), A.AVX2.error
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(M, K, generator=g).bfloat16(), (torch.randn(N, K, generator=g) * 0.05)
    w, bias = w.bfloat16(), torch.randn(N, generator=g).bfloat16()
    for b in (None, bias):
        got, ref = A.AVX2.bf16(x, w, b), bf16_gemv.bf16_reference(x, w, b)
        assert got.dtype == torch.bfloat16 and got.shape == (M, N)
        # both round a float32 sum once: at most one bf16 step apart, and rarely
        assert (got.float() - ref.float()).abs().max() <= ref.float().abs().max() * 2.0**-7
        assert (got == ref).float().mean() >= 0.9


WIDTHS = [False] + (["avx512f" in native.cpu_flags()] and [True])  # AVX-512 tiles where they run


def _f32(x, w, b=None, wide=False):
    return torch.ops.minifer_avx2.f32(x, w, b, wide)


@pytest.mark.parametrize("wide", WIDTHS)
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_f32_equals_f_linear_to_rounding(M, N, K, wide):
    assert A.AVX2.available(), A.AVX2.error
    g = torch.Generator().manual_seed(3)
    x, w, bias = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g), torch.randn(N)
    for b in (None, bias):
        got, ref = _f32(x, w, b, wide), torch.nn.functional.linear(x, w, b)
        assert got.dtype == torch.float32 and got.shape == (M, N)
        # the same products summed in another order: apart by float32 rounding of |x| @ |w|
        scale = (x.abs() @ w.abs().T).max() + (0 if b is None else b.abs().max())
        assert (got - ref).abs().max() <= scale * 2.0**-20


@pytest.mark.parametrize("kind", ["bf16", "f32"] + ["f32-wide"] * WIDTHS[-1])
def test_a_row_gets_the_same_bits_alone_as_in_any_batch(kind):
    """Each row of x runs the same sums in the same order whatever rows share the call (a tile
    holds one to four rows, each with its own sums; threads split the weight rows)."""
    A.AVX2.available()
    g = torch.Generator().manual_seed(2)
    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    x, w = torch.randn(9, 100, generator=g).to(dtype), torch.randn(37, 100, generator=g).to(dtype)
    run = {"bf16": A.AVX2.bf16, "f32": _f32, "f32-wide": lambda x, w: _f32(x, w, None, True)}[kind]
    batched = run(x, w)
    for i in range(9):
        for rows in (1, 2, 3, 5):
            assert torch.equal(run(x[i:i + rows], w)[:1], batched[i:i + 1])


def test_bad_input_gets_a_clear_error():
    A.AVX2.available()
    x, w, scales, bias = _case(2, 8, 32)
    with pytest.raises(RuntimeError, match="x \\[M, K\\] and w \\[N, K\\]"):
        A.AVX2.w8a8(x[:, :16], w, scales)
    with pytest.raises(RuntimeError, match="w int8 and scales float32 \\[8\\]"):
        A.AVX2.w8a8(x, w, scales[:4])
    with pytest.raises(RuntimeError, match="bias Float \\[8\\]"):
        A.AVX2.w8a8(x, w, scales, bias[:3])
    with pytest.raises(RuntimeError, match="x and w bfloat16 expected"):
        A.AVX2.bf16(x.bfloat16(), w.float())
    with pytest.raises(RuntimeError, match="x and w float32 expected"):
        A.AVX2.f32(x, w.bfloat16())
    with pytest.raises(RuntimeError, match="bias Float \\[8\\]"):
        A.AVX2.f32(x, w.float(), bias[:3])


def test_int8_layers_run_it_where_the_vnni_kernel_does_not(monkeypatch):
    """Without VNNI (forced here on any CPU) a W8A8 layer runs the AVX2 kernel: the same logits
    as the reference path, bit for bit, at one row and at several."""
    monkeypatch.setattr(int8_gemv.GEMV, "available", lambda: False)
    calls = []
    real = A.Avx2Gemm.w8a8
    monkeypatch.setattr(A.Avx2Gemm, "w8a8", lambda self, *a: calls.append(a[0].shape) or real(self, *a))
    model = mf.quantize(mf.GPT.from_config("tiny", seed=0).eval(), "int8", impl="integer")
    for rows in (1, 3):
        ids = torch.arange(4 * rows).reshape(rows, 4)
        with torch.inference_mode():
            fast = model(ids)
            with mf.fast.disabled():
                plain = model(ids)
        assert torch.equal(fast, plain)
    assert calls


@pytest.mark.skipif(mf.fast.prepack.prepack_problem(torch.bfloat16) is None,
                    reason="oneDNN packs bf16 here: bf16 layers run it (tests/test_bf16_gemv.py)")
def test_bf16_layers_run_it_where_onednn_packs_no_bf16():
    """On an AVX2 CPU ``quantize(model, "bf16")`` gives layers on the kernel, with the plain bf16
    model's greedy tokens (logits to bf16 rounding)."""
    model = mf.GPT.from_config("tiny", seed=0).eval()
    fast = mf.quantize(model, "bf16")
    assert all(isinstance(m, mf.fast.prepack.PackedLinear) for m in fast.modules()
               if isinstance(m, torch.nn.Linear))
    with mf.fast.disabled():
        plain = mf.quantize(model, "bf16")
    params = mf.SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    got = [c.token_ids for c in mf.generate(fast, prompts, params)]
    with mf.fast.disabled():
        want = [c.token_ids for c in mf.generate(plain, prompts, params)]
    assert got == want


@pytest.mark.skipif(mf.fast.prepack.prepack_problem() is not None, reason="no oneDNN linear here")
def test_fp32_layers_on_their_row_major_weight_run_it_up_to_f32_rows(monkeypatch):
    """`fast.layout`'s fp32 layers (a `PackedLinear` on the weight itself, where MKL runs generic
    code: built here on any CPU) run the kernel for up to `f32_rows` rows and oneDNN past them;
    the model's greedy tokens are the plain model's."""
    calls = []
    real = A.Avx2Gemm.f32
    monkeypatch.setattr(A.Avx2Gemm, "f32", lambda self, *a: calls.append(a[0].shape[0]) or real(self, *a))
    with mf.fast.disabled():
        model = mf.GPT.from_config("tiny", seed=0).eval()  # plain nn.Linear layers on any CPU
    fast = copy.deepcopy(model)
    for parent in list(fast.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, mf.fast.prepack.PackedLinear.from_linear(child, 0, pack=False))
    params = mf.SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    for prompts in ([[1, 2, 3]], [[1, 2, 3], [4, 5, 6, 7, 8]] * 3):
        got = [c.token_ids for c in mf.generate(fast, prompts, params)]
        with mf.fast.disabled():
            want = [c.token_ids for c in mf.generate(model, prompts, params)]
        assert got == want
    assert calls and max(calls) <= A.AVX2.f32_rows
