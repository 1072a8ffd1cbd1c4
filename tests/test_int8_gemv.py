"""The W8A8 kernels: the readable reference is a W8A8 product (close to the float one),
the C++ kernels (one row; several over packed blocks) equal it exactly (tails of K and N, bias or
none, rows of zeros), the int8 layer runs them, bad input gets a clear error, and where it cannot run (another CPU, a failed
build) everything stays correct."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch

from minifer.fast import int8_gemv as G
from minifer.quantization import QuantizedLinear, integer_problem, quantize_int8

needs_kernel = pytest.mark.skipif(G.Int8Gemv.problem() is not None,
                                  reason=f"no batch-1 int8 kernel here: {G.Int8Gemv.problem()}")


def _case(M: int, N: int, K: int, bias: bool = True, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, s = quantize_int8(torch.randn(N, K, generator=g) * 0.05)
    x = torch.randn(M, K, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    return x, q, s, q.sum(1, dtype=torch.int32), b


def test_reference_is_a_w8a8_product_close_to_the_float_one():
    x, q, s, _, b = _case(3, 40, 200)
    want = x @ (q.float() * s[:, None]).t() + b
    got = G.w8a8_reference(x, q, s, b)
    # each activation off by at most half its row's step max|x|/127: well under 2% of the output
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
    xq, sx = G.quantize_rows(x)
    assert xq.abs().max() <= 127 and torch.allclose(xq.float() * sx[:, None], x, atol=sx.max())
    zeros, scale = G.quantize_rows(torch.zeros(2, 8))  # a row of zeros: scale 1, no NaN
    assert torch.equal(zeros, torch.zeros(2, 8, dtype=torch.int8)) and torch.equal(scale,
                                                                                 torch.ones(2))


@pytest.mark.parametrize("M,N,K,bias", [(1, 64, 256, True), (1, 7, 100, False),
                                        (1, 130, 64, True), (1, 5, 1, False), (3, 50, 3072, True),
                                        (1, 50257 // 100, 768, True)])
def test_int_mm_form_equals_reference(M, N, K, bias):
    x, q, s, _, b = _case(M, N, K, bias)
    assert torch.equal(G.w8a8_int_mm(x, q, s, b), G.w8a8_reference(x, q, s, b))


@needs_kernel
@pytest.mark.parametrize("M,N,K,bias", [(1, 64, 256, True), (1, 7, 100, False),
                                        (1, 130, 64, True), (1, 5, 1, False), (3, 50, 3072, True),
                                        (2, 1001, 320, True)])
def test_kernel_equals_reference_exactly(M, N, K, bias):
    """Integer sums are exact and the kernel scales in the reference's order (built without
    fused multiply-adds), so the two agree bit for bit."""
    x, q, s, rowsum, b = _case(M, N, K, bias)
    x[0, : K // 2] = 0  # a half-empty row
    assert G.GEMV.available(), G.GEMV.error
    assert torch.equal(G.GEMV(x, q, s, rowsum, b), G.w8a8_reference(x, q, s, b))
    x[0] = 0
    assert torch.equal(G.GEMV(x, q, s, rowsum, b)[0], torch.zeros(N) if b is None else b)


@needs_kernel
@pytest.mark.parametrize("M,N,K,bias", [(2, 64, 256, True), (3, 7, 100, False), (4, 130, 64, True),
                                        (5, 5, 1, False), (16, 50, 3072, True),
                                        (17, 1001, 320, True), (64, 2304, 768, False)])
def test_many_rows_kernel_equals_reference_exactly(M, N, K, bias):
    """Several rows: the same sums over the weight packed in 16-column blocks (tails of K, N and
    of the 4-row tiles), so the same numbers bit for bit, and each row's as it gets alone."""
    x, q, s, rowsum, b = _case(M, N, K, bias)
    x[0, : K // 2] = 0
    assert G.GEMV.available(), G.GEMV.error
    got = G.GEMV(x, q, s, rowsum, b)
    assert torch.equal(got, G.w8a8_reference(x, q, s, b))
    assert torch.equal(got[-1:], G.GEMV(x[-1:], q, s, rowsum, b))
    assert torch.equal(G.int8_matmul(x, q, s, rowsum, b), got)  # the seam's choice at M > 1


@needs_kernel
def test_many_rows_kernel_packs_again_when_the_weight_changes():
    x, q, s, rowsum, b = _case(4, 40, 96)
    G.GEMV(x, q, s, rowsum, b)
    packed = q._vnni_blocks[1]
    assert G.GEMV(x, q, s, rowsum, b) is not None and q._vnni_blocks[1] is packed  # kept
    q[3] = -q[3]  # in place, as a loaded state dict does
    rowsum = q.sum(1, dtype=torch.int32)
    assert torch.equal(G.GEMV(x, q, s, rowsum, b), G.w8a8_reference(x, q, s, b))
    with pytest.raises(RuntimeError, match=r"int8 gemm: packed .* is not pack\(w\)"):
        torch.ops.minifer_int8.gemm(x[:, :48].contiguous(), packed, s, rowsum, None)


@needs_kernel
def test_kernel_rejects_what_it_cannot_read():
    x, q, s, rowsum, b = _case(1, 16, 64)
    with pytest.raises(RuntimeError, match="x \\[M, K\\] and w \\[N, K\\]"):
        G.GEMV(x[:, :32], q, s, rowsum, b)
    with pytest.raises(RuntimeError, match="int8 gemv: 16 scales and row sums"):
        G.GEMV(x, q, s[:8], rowsum, b)
    with pytest.raises(RuntimeError, match="rowsum int32"):
        G.GEMV(x, q, s, rowsum.long(), b)
    with pytest.raises(RuntimeError, match="bias float32 \\[16\\]"):
        G.GEMV(x, q, s, rowsum, b[:4])


@needs_kernel
@pytest.mark.skipif(integer_problem() is not None, reason=f"no W8A8 path: {integer_problem()}")
def test_the_int8_layer_gives_the_references_numbers_at_one_row_and_at_more():
    lin = torch.nn.Linear(256, 96)
    layer = QuantizedLinear.from_linear(lin, 8, impl="integer")
    x = torch.randn(4, 256)
    ref = G.w8a8_reference(x[:1], layer.qweight, layer.scales, layer.bias)
    assert torch.equal(layer(x[:1]), ref)
    assert torch.equal(layer(x[:1].view(1, 1, 256))[0], ref)  # a decode step's [B, 1, C]
    batched = layer(x)  # torch._int_mm (or the reference): the same numbers, row by row
    assert torch.equal(batched, G.w8a8_reference(x, layer.qweight, layer.scales, layer.bias))
    import copy

    moved = copy.deepcopy(layer)
    moved.load_state_dict(QuantizedLinear.from_linear(torch.nn.Linear(256, 96), 8,
                                                      impl="integer").state_dict())
    # the new weights and their row sums, not the old ones
    assert torch.equal(moved(x[:1]), G.w8a8_reference(x[:1], moved.qweight, moved.scales,
                                                      moved.bias))


_COMPILED_INT8 = """
import json
import torch
import minifer as mf
from minifer.cache import StaticKVCache
from minifer.fast.compiled import compiled_decode
from minifer.fast.decode import LeanStep
from minifer.generation import decode_step, prefill
from conftest import lively_model
model = mf.quantize(lively_model("tiny"), "int8", impl="integer")
greedy = mf.SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
out = {"tokens": [[c.token_ids for c in mf.generate(model, [[5, 6, 7, 8, 9]], greedy, compile=c)]
                  for c in (False, True)]}
ids = torch.tensor([[5, 6, 7, 8, 9], [3, 1, 4, 1, 5]])
logits = []
for step in (LeanStep(fixed_shape=True), compiled_decode(model)):  # 2 rows, eager and compiled
    cache = StaticKVCache.for_model(model, 2, 8)
    cache.reset(torch.zeros(2, dtype=torch.long))
    first = prefill(model, ids, cache).argmax(-1)
    logits.append(decode_step(model, first, cache, step=step))
out["max_diff"] = (logits[0] - logits[1]).abs().max().item()
out["scale"] = logits[0].abs().max().item()
print(json.dumps(out))
"""


@pytest.mark.skipif(integer_problem() is not None, reason=f"no W8A8 path: {integer_problem()}")
def test_compiled_int8_step_matches_eager():
    """``compile=True`` on a W8A8 model: at batch 1 the compiled step calls the same kernel
    (torch.compile traces through it) and gives eager's greedy tokens (where the CPU has the
    kernel); at 2 rows both run `w8a8_int_mm`, and inductor may fuse its float epilogue into
    other operations: the logits stay close. A child process: inductor's code may change the
    process's floating-point mode."""
    from test_fast_decode import _inductor_can_run

    if (why := _inductor_can_run()) is not None:
        pytest.skip(why)
    run = subprocess.run([sys.executable, "-c", _COMPILED_INT8], capture_output=True, text=True,
                         timeout=900, cwd=pathlib.Path(__file__).parent)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    eager, compiled = got["tokens"]
    if G.GEMV.available():  # the same kernel, eager and compiled
        assert compiled == eager
    # at 2 rows the same integer sums; the compiled float epilogue may round in another order
    assert got["max_diff"] <= 0.05 * got["scale"], got
