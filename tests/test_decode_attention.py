"""A decode step's attention (`hooks.decode_attention`): the C++ kernel over generate's dense
cache (float32 or bfloat16) equals the reference (SDPA, a padded batch row by row) within its
rounding, a row's result is bit for bit the same alone and in any batch at any thread count,
bad starts get a clear error, and a padded batch decodes the tokens each prompt decodes alone."""

from __future__ import annotations

import pytest
import torch

import minifer as mf
from minifer import hooks
from minifer.fast import paged_attention as PA
from minifer.fast.native import build_tools_problem

needs_kernel = pytest.mark.skipif(build_tools_problem() is not None or not PA.KERNEL.available(),
                                  reason=f"the paged kernel cannot run here: {PA.KERNEL.error}")


def _case(B=7, kv_heads=3, group=2, hd=64, S=45, seed=0):
    """Queries ``(B, kv_heads, group, hd)``; the filled slots of a bigger cache (a view, as the
    cache's `update` returns it); each row's first real slot, one at 0 and one at the last."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, kv_heads, group, hd, generator=g)
    kb, vb = (torch.randn(B, kv_heads, S + 11, hd, generator=g) for _ in range(2))
    starts = torch.randint(0, S, (B,), generator=g).tolist()
    starts[0], starts[-1] = 0, S - 1
    return q, kb[:, :, :S], vb[:, :, :S], starts


@needs_kernel
@pytest.mark.parametrize("shape", [dict(), dict(group=1, kv_heads=5), dict(hd=40, S=3),
                                   dict(hd=128, group=4), dict(B=1, S=1)])
def test_kernel_equals_the_reference(shape):
    q, k, v, starts = _case(**shape)
    ref = PA._REFERENCE(q, k, v, starts)
    got = PA.decode_attention(q, k, v, starts)
    assert got.shape == ref.shape and (got - ref).abs().max() <= 2e-6
    unpadded = PA.decode_attention(q, k, v, None)  # every slot of every row
    assert (unpadded - PA._REFERENCE(q, k, v, None)).abs().max() <= 2e-6


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_each_row_is_bit_for_bit_what_it_computes_alone(threads):
    q, k, v, starts = _case(B=9)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batched = PA.decode_attention(q, k, v, starts)
        alone = [PA.decode_attention(q[b:b + 1], k[b:b + 1, :, s:], v[b:b + 1, :, s:], None)
                 for b, s in enumerate(starts)]
    finally:
        torch.set_num_threads(before)
    assert torch.equal(batched, torch.cat(alone))


@needs_kernel
def test_a_start_outside_the_cache_is_a_clear_error():
    q, k, v, starts = _case()
    with pytest.raises(RuntimeError, match="row 2 starts at slot 45, outside"):
        PA.decode_attention(q, k, v, starts[:2] + [45] + starts[3:])


@needs_kernel
def test_a_bfloat16_cache_is_read_as_bfloat16_and_summed_in_float():
    q, k, v, starts = (x.bfloat16() if torch.is_tensor(x) else x for x in _case(B=9))
    got = PA.decode_attention(q, k, v, starts)
    assert got.dtype == torch.bfloat16
    exact = PA._REFERENCE(*(x.double() for x in (q, k, v)), starts)  # the same inputs, in fp64
    assert (got.double() - exact).abs().max() <= 2 ** -7 * exact.abs().max()  # bf16's rounding
    alone = [PA.decode_attention(q[b:b + 1], k[b:b + 1, :, s:], v[b:b + 1, :, s:], None)
             for b, s in enumerate(starts)]
    assert torch.equal(got, torch.cat(alone))


def test_other_dtypes_and_layouts_take_the_reference():
    q, k, v, starts = _case()
    q, k, v = (x.half() for x in (q, k, v))
    assert torch.equal(PA.decode_attention(q, k, v, starts), PA._REFERENCE(q, k, v, starts))
    q, k, v, starts = _case()
    kt = k.transpose(2, 3).contiguous().transpose(2, 3)  # hd not contiguous: not the kernel's
    assert torch.equal(PA.decode_attention(q, kt, v, starts), PA._REFERENCE(q, kt, v, starts))
    assert hooks.decode_attention is PA.decode_attention or not mf.fast.installed()


@pytest.mark.parametrize("precision", ["fp32", "int8", "int4"])  # bf16's products part them
def test_a_padded_batch_decodes_each_prompt_as_alone(precision):
    model, tok = mf.load_pretrained("shakespeare")
    if precision != "fp32":
        model = mf.quantize(model, precision)
    prompts = ["ROMEO:\n", "First Citizen:\nBefore we proceed any further, hear me speak.",
               "KING HENRY:\n", "To be, or not", "JULIET:\nO"]
    params = mf.SamplingParams(temperature=0, max_new_tokens=40)
    batched = [c.token_ids for c in mf.generate(model, prompts, params, tok)]
    assert batched == [mf.generate(model, [p], params, tok)[0].token_ids for p in prompts]
