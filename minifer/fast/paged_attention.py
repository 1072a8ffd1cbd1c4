"""Decode attention that reads the paged K/V pool where it lies.

A decode row has one new query per head and attends to its ``lengths[b]`` cached tokens, which
sit in the blocks ``block_table[b]`` of the pool. Reference: `paged_decode_attention`, the same
in tensor math: look the row's blocks up, score every cached key against the query, mask the
unused tail of the last block, softmax, and sum the values.

Run eagerly, ``k_pool[block_table]`` *copies* every row's K/V first: as many bytes written as
attention then reads. A paged-attention kernel (vLLM's, on GPUs) follows the block table in its
loops instead, reading each key and value once, in place. `PagedDecodeKernel` is one for the CPU
in float32 (``csrc/paged_decode.cpp``: the reference's math, rows over torch's threads, built by
`torch.utils.cpp_extension` when first needed). Where it cannot be built it warns once, and the
serving step reads whole blocks instead (`minifer.fast.paged`): slower, never wrong."""

from __future__ import annotations

from pathlib import Path

import torch

from .. import hooks
from .native import NativeKernel, vector_isa

__all__ = ["paged_decode_attention", "decode_attention", "PagedDecodeKernel", "KERNEL"]

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           block_table: torch.Tensor, lengths: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """One decode token's attention per row, over its K/V in the pool's blocks.

    - `q`: ``(B, n_head, head_dim)``, the new token's query of each row;
    - `k_pool`, `v_pool`: ``(num_blocks, block_size, n_kv_head, head_dim)``, one layer's pool;
    - `block_table`: ``(B, M)`` block ids, row ``b``'s tokens ``0..lengths[b]-1`` in order
      (entries past the row's last block may be any valid id: they are masked);
    - `lengths`: ``(B,)`` tokens row ``b`` attends to (its new token's K/V already written).

    Returns ``(B, n_head, head_dim)``. Query heads share K/V heads in groups of
    ``n_head // n_kv_head`` (grouped-query attention)."""
    k = k_pool[block_table].flatten(1, 2)  # (B, T, n_kv_head, head_dim), T = M * block_size
    v = v_pool[block_table].flatten(1, 2)
    qg = q.unflatten(1, (k.shape[2], -1))  # (B, n_kv_head, group, head_dim)
    scores = (qg[:, None] * k[:, :, :, None]).sum(-1) * scale  # (B, T, n_kv_head, group)
    t = torch.arange(k.shape[1], device=q.device)
    unused = (t[None, :] >= lengths[:, None])[:, :, None, None]
    weights = torch.softmax(scores.masked_fill(unused, float("-inf")), dim=1)
    return (weights[..., None] * v[:, :, :, None]).sum(1).flatten(1, 2)


class PagedDecodeKernel(NativeKernel):
    """The C++ kernel (`NativeKernel`: built once per process, `error` says why not). Call it
    like `paged_decode_attention`; where it cannot run (not built, another device or dtype)
    the call computes the reference."""

    kernel, source, flags = "paged_decode", SOURCE, frozenset()
    isa, cflags = vector_isa()
    namespace, op = "minifer_paged", "decode"
    instead = "decode attention reads whole blocks"

    @staticmethod
    def shape(q, *args):
        return q.new_empty(q.shape)

    def __call__(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 block_table: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
        if q.device.type == "cpu" and q.dtype == torch.float32 and self.available():
            _check(q, k_pool, v_pool, block_table, lengths)
            return torch.ops.minifer_paged.decode(q, k_pool, v_pool, block_table, lengths, scale)
        return paged_decode_attention(q, k_pool, v_pool, block_table, lengths, scale)


def _check(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
           block_table: torch.Tensor, lengths: torch.Tensor) -> None:
    """What the C++ kernel assumes of its tensors (it reads raw memory): a clear error instead
    of garbage."""
    B, H, D = q.shape
    if (k_pool.dim() != 4 or k_pool.shape != v_pool.shape or k_pool.shape[3] != D
            or H % k_pool.shape[2] or block_table.shape[0] != B or lengths.shape != (B,)):
        raise ValueError(f"paged decode: inconsistent shapes q {tuple(q.shape)}, pool "
                         f"{tuple(k_pool.shape)}/{tuple(v_pool.shape)}, block_table "
                         f"{tuple(block_table.shape)}, lengths {tuple(lengths.shape)}")
    if block_table.dtype != torch.long or lengths.dtype != torch.long:
        raise ValueError("paged decode: block_table and lengths must be int64")
    if not all(t.is_contiguous() for t in (q, k_pool, v_pool, block_table, lengths)):
        raise ValueError("paged decode: every tensor must be contiguous")
    if not (q.dtype == k_pool.dtype == v_pool.dtype == torch.float32):
        raise ValueError("paged decode: q and the pool must be float32")
    # lengths and block ids are checked by the kernel itself, before it reads the pool


KERNEL = PagedDecodeKernel()  # one per process: every engine shares its builds


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     starts: list[int] | None) -> torch.Tensor:
    """`hooks.decode_attention` in the C++ kernel (``rows``: each row and K/V head one task, so
    a row computes the same alone and in any batch; sums in float32), on the CPU for a float32
    or bfloat16 cache, outside torch.compile; elsewhere the reference."""
    if (q.device.type == k.device.type == "cpu" and q.dtype == k.dtype == v.dtype
            and q.dtype in (torch.float32, torch.bfloat16) and k.stride() == v.stride()
            and k.stride()[2:] == (k.shape[3], 1)
            and not torch.compiler.is_compiling() and KERNEL.available()):
        starts = [0] * q.shape[0] if starts is None else starts
        y = torch.ops.minifer_paged.rows(q.float().contiguous(), k, v, starts, q.shape[-1] ** -0.5)
        return y.to(q.dtype)
    return _REFERENCE(q, k, v, starts)


_REFERENCE = hooks.decode_attention  # the plain function, before `minifer.fast` installs this one
