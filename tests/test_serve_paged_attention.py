"""The paged decode attention: the readable reference equals SDPA over each row's gathered
K/V, the C++ kernel equals the reference (grouped-query heads, partly filled last blocks,
scattered blocks), bad inputs get clear errors, and a failed build falls back with a warning."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import engine_reading, pool_read
from minifer.fast import paged_attention as PA
from minifer.fast.native import build_tools_problem

# the C++ kernel needs a compiler and ninja; without them the engine falls back (tested below)
needs_build_tools = pytest.mark.skipif(build_tools_problem() is not None,
                                       reason=f"the paged kernel cannot be built here: "
                                              f"{build_tools_problem()}")


def _case(B=6, n_head=4, n_kv_head=2, hd=16, block_size=4, num_blocks=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, n_kv_head, hd)
    k_pool, v_pool = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    lengths = torch.randint(1, 6 * block_size + 1, (B,), generator=g)
    lengths[0] = 1  # one token only
    lengths[1] = 6 * block_size  # every block full
    M = 6
    table = torch.randperm(num_blocks, generator=g)[:B * M].view(B, M)  # scattered, no sharing
    q = torch.randn(B, n_head, hd, generator=g)
    return q, k_pool, v_pool, table, lengths


def _sdpa_rows(q, k_pool, v_pool, table, lengths, scale):
    """Each row alone: its tokens gathered slot by slot, then SDPA (the model's attention)."""
    bs, out = k_pool.shape[1], []
    for b in range(q.shape[0]):
        slots = [int(table[b, t // bs]) * bs + t % bs for t in range(int(lengths[b]))]
        k = k_pool.flatten(0, 1)[slots].transpose(0, 1)  # (nkv, L, hd)
        v = v_pool.flatten(0, 1)[slots].transpose(0, 1)
        rep = q.shape[1] // k.shape[0]
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        out.append(F.scaled_dot_product_attention(q[b][:, None], k, v, scale=scale)[:, 0])
    return torch.stack(out)


@needs_build_tools
@pytest.mark.parametrize("n_kv_head", [4, 2, 1])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_reference_and_kernel_equal_sdpa_over_each_rows_tokens(n_kv_head, block_size):
    case = _case(n_kv_head=n_kv_head, block_size=block_size, num_blocks=48)
    ref = _sdpa_rows(*case, 0.25)
    got_ref = PA.paged_decode_attention(*case, 0.25)
    assert (got_ref - ref).abs().max() <= 1e-5
    assert PA.KERNEL.available(), PA.KERNEL.error
    got = PA.KERNEL(*case, 0.25)
    assert got.shape == ref.shape
    assert (got - ref).abs().max() <= 1e-5


@needs_build_tools
@pytest.mark.parametrize("hd", [16, 32, 40, 64, 128])
@pytest.mark.parametrize("scale", [0.125, 4.0])
def test_the_kernel_equals_sdpa_at_every_head_width(hd, scale):
    """Widths that are a multiple of 16 run the vector path (16, 32, 64, 128), others the
    plain loops (40); scale 4 spreads the scores past -87, where the kernel's exponential
    clamps, and rows of 1 to 47 tokens cover the softmax's 16-wide steps and their tails."""
    case = _case(B=8, n_head=4, n_kv_head=2, hd=hd, block_size=8, num_blocks=64, seed=hd)
    case[4][2:] = torch.arange(2, 8) * 7 - 1  # 13, 20, ..., 48 tokens
    ref = _sdpa_rows(*case, scale)
    got = PA.KERNEL(*case, scale)
    assert (got - ref).abs().max() <= 1e-5 * max(1.0, ref.abs().max().item())


@needs_build_tools
def test_the_kernel_follows_torchs_thread_count():
    case = _case(B=9, num_blocks=64)
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(PA.KERNEL(*case, 0.25))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])  # rows are independent: the split changes nothing


@needs_build_tools
def test_bad_inputs_get_clear_errors():
    q, k, v, table, lengths = _case()
    with pytest.raises(ValueError, match="inconsistent shapes"):
        PA.KERNEL(q[:, :3], k, v, table, lengths, 1.0)  # 3 query heads over 2 K/V heads
    with pytest.raises(ValueError, match="int64"):
        PA.KERNEL(q, k, v, table.int(), lengths, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        PA.KERNEL(q, k, v, table.t().contiguous().t(), lengths, 1.0)
    too_long = lengths.clone()
    too_long[2] = table.shape[1] * k.shape[1] + 1
    with pytest.raises(RuntimeError, match="row 2 length"):
        PA.KERNEL(q, k, v, table, too_long, 1.0)
    bad_block = table.clone()
    bad_block[1, 0] = k.shape[0]
    with pytest.raises(RuntimeError, match="block id"):
        PA.KERNEL(q, k, v, bad_block, lengths, 1.0)


def test_a_failed_build_warns_once_and_stays_correct(monkeypatch):
    import torch.utils.cpp_extension as ext

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(ext, "load", no_compiler)
    kernel = PA.PagedDecodeKernel()
    case = _case()
    with pytest.warns(RuntimeWarning, match="Ninja is required"):
        assert not kernel.available()
    assert "Ninja" in kernel.error
    got = kernel(*case, 0.25)  # no second warning: the reason was given once
    assert torch.equal(got, PA.paged_decode_attention(*case, 0.25))


def test_other_dtypes_run_the_reference():
    """Float64 (like CUDA) is not the C++ kernel's: the call computes the reference itself."""
    q, k, v, table, lengths = (t.double() if t.is_floating_point() else t for t in _case())
    got = PA.PagedDecodeKernel()(q, k, v, table, lengths, 0.25)
    assert torch.equal(got, PA.paged_decode_attention(q, k, v, table, lengths, 0.25))


def test_an_engine_without_the_kernel_reads_whole_blocks(monkeypatch, tiny):

    monkeypatch.setattr(PA.KERNEL, "available", lambda: False)
    assert pool_read(engine_reading("kernel", tiny).pool) == "blocks"
    with pytest.raises(ValueError, match="read must be one of"):
        engine_reading("pages", tiny)
