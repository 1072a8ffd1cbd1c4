"""The paged KV cache's storage, and attention over it for one packed forward call.

`PagedKVPool` holds the keys and values (which slot a token uses is the `BlockManager`'s
decision); `PackedBatch`, the cache of a serving step's one packed forward call, writes each new
token's K/V into its slot and keeps each row to its own tokens: the readable reference, which
`minifer.fast.paged` replaces (`hooks.packed_attention`) with faster reads."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .. import hooks
from ..checks import check_int
from ..config import kv_token_bytes

__all__ = ["PagedKVPool", "PackedBatch", "sdpa"]



class PagedKVPool:
    """K/V tensors ``(num_blocks, block_size, kv_heads, head_dim)`` for every layer."""

    def __init__(self, n_layer: int, num_blocks: int, block_size: int, n_kv_head: int,
                 head_dim: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        for name, value in (("n_layer", n_layer), ("num_blocks", num_blocks),
                            ("block_size", block_size), ("n_kv_head", n_kv_head),
                            ("head_dim", head_dim)):
            check_int(f"PagedKVPool {name}", value, 1)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"PagedKVPool dtype must be a float torch dtype, got {dtype!r}")
        self.shape = (num_blocks, block_size, n_kv_head, head_dim)
        self.n_layer, self.num_blocks, self.block_size = n_layer, num_blocks, block_size
        self.n_kv_head, self.head_dim = n_kv_head, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.planner = hooks.packed_attention(self)  # None: each step's `attend_rows`

    @functools.cached_property
    def k(self) -> list[torch.Tensor]:
        """Each layer's keys, allocated at first use: a server whose engine steps in a process
        of its own never allocates its own engine's (`engine_process.engine_main` does, first)."""
        return [torch.zeros(self.shape, dtype=self.dtype, device=self.device)
                for _ in range(self.n_layer)]

    v = functools.cached_property(k.func)  # each layer's values, the same way

    @classmethod
    def for_model(cls, model: torch.nn.Module, num_blocks: int, block_size: int, *,
                  device: torch.device | str | None = None) -> PagedKVPool:
        """A pool shaped for `model` (layers, KV heads, head dim; its float dtype and device)."""
        cfg = model.config
        p = next(t for t in model.parameters() if t.is_floating_point())
        return cls(cfg.n_layer, num_blocks, block_size, cfg.kv_heads, cfg.head_dim,
                   dtype=p.dtype, device=device or p.device)

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in all layers (`minifer.config.kv_token_bytes`)."""
        return kv_token_bytes(self.n_layer, self.n_kv_head, self.head_dim, self.dtype.itemsize)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_size * self.bytes_per_token

    def slots(self, table: Sequence[int], start: int, stop: int) -> list[int]:
        """Flat slot indices (block id × block_size + offset) of tokens ``start..stop-1``."""
        bs = self.block_size
        return [table[i // bs] * bs + i % bs for i in range(start, stop)]

    def read_tokens(self, table: Sequence[int], num_tokens: int) -> torch.Tensor:
        """A copy of the K/V of tokens ``0 .. num_tokens - 1`` held in the blocks `table`.

        Shape ``(n_layer, 2, num_tokens, kv_heads, head_dim)`` (K at index 0, V at 1), contiguous:
        exactly ``bytes_per_token × num_tokens`` bytes, what disaggregated serving sends from
        the prefill worker to the decode worker."""
        check_int("num_tokens", num_tokens, 1)
        if len(table) * self.block_size < num_tokens:
            raise ValueError(f"table of {len(table)} blocks cannot hold {num_tokens} tokens")
        idx = torch.tensor(self.slots(table, 0, num_tokens), dtype=torch.long, device=self.device)
        flat = (-1, self.n_kv_head, self.head_dim)
        return torch.stack([torch.stack([k.view(flat)[idx], v.view(flat)[idx]])
                            for k, v in zip(self.k, self.v)])

    def write_tokens(self, table: Sequence[int], kv: torch.Tensor, start: int = 0) -> None:
        """Store `kv` (shaped as :meth:`read_tokens` returns it) as tokens ``start ..`` of the
        blocks `table`."""
        check_int("start", start, 0)
        shape = (self.n_layer, 2, kv.shape[2] if kv.dim() == 5 else -1, self.n_kv_head,
                 self.head_dim)
        if kv.dim() != 5 or tuple(kv.shape) != shape or kv.shape[2] < 1:
            raise ValueError(f"kv must have shape (n_layer, 2, tokens, kv_heads, head_dim) = "
                             f"{shape}, got {tuple(kv.shape)}")
        n = kv.shape[2]
        if len(table) * self.block_size < start + n:
            raise ValueError(f"table of {len(table)} blocks cannot hold {start + n} tokens")
        idx = torch.tensor(self.slots(table, start, start + n), dtype=torch.long,
                           device=self.device)
        flat = (-1, self.n_kv_head, self.head_dim)
        kv = kv.to(device=self.device, dtype=self.dtype)
        for layer, (k, v) in enumerate(zip(self.k, self.v)):
            k.view(flat)[idx] = kv[layer, 0]
            v.view(flat)[idx] = kv[layer, 1]

    def __repr__(self) -> str:
        return (f"PagedKVPool(layers={self.n_layer}, blocks={self.num_blocks}, "
                f"block_size={self.block_size}, kv_heads={self.n_kv_head}, "
                f"head_dim={self.head_dim}, dtype={self.dtype}, nbytes={self.nbytes:,})")


class PackedBatch:
    """One forward call over rows of any lengths, packed end to end (a `minifer.cache.PackedKVCache`).

    Row ``b`` has ``context[b]`` tokens cached in the blocks ``tables[b]`` and feeds
    ``num_new[b]`` new ones (a decode row one, a prompt chunk many), all as one ``(1, N)``
    sequence: the token-wise layers run once for the step (vLLM's packing), and `attend` keeps
    rows apart: new K/V at their slots (`slot_mapping`), each row attending to its own tokens at
    its own `positions`. `logits_index`: the last token of each row in `logits_rows` (default:
    all), the only positions whose logits are needed.

    The rows are checked (ValueErrors): each feeds a token and fits its blocks."""

    packed = True  # GPT.forward: run the packed path (see `minifer.cache.PackedKVCache`)

    def __init__(self, pool: PagedKVPool, tables: Sequence[Sequence[int]],
                 context: Sequence[int], num_new: Sequence[int],
                 logits_rows: Sequence[int] | None = None) -> None:
        _check_rows(pool, tables, context, num_new)
        dev = pool.device
        self.pool = pool
        self.tables, self.context, self.num_new = tables, context, num_new
        self.num_tokens = sum(num_new)
        pos = [p for c, n in zip(context, num_new) for p in range(c, c + n)]  # rows in turn
        slots = [s for table, c, n in zip(tables, context, num_new) for s in pool.slots(table, c, c + n)]
        self.positions = torch.tensor([pos], dtype=torch.long, device=dev)  # (1, N)
        self.slot_mapping = torch.tensor(slots, dtype=torch.long, device=dev)  # (N,)
        ends = list(itertools.accumulate(num_new))
        rows = range(len(tables)) if logits_rows is None else logits_rows
        self.logits_index = torch.tensor([ends[b] - 1 for b in rows], dtype=torch.long, device=dev)
        self.attention = None if pool.planner is None else pool.planner(self)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store the new ``k, v`` ``(1, nkv, N, hd)`` at their slots of `layer`; return every
        new token's attention output ``(1, nh, N, hd)`` for queries `q` ``(1, nh, N, hd)``."""
        nkv, hd = k.shape[1], k.shape[3]
        pk = self.pool.k[layer].view(-1, nkv, hd)  # (slots, nkv, hd)
        pv = self.pool.v[layer].view(-1, nkv, hd)
        pk.index_copy_(0, self.slot_mapping, k[0].transpose(0, 1))
        pv.index_copy_(0, self.slot_mapping, v[0].transpose(0, 1))
        if self.attention is not None:
            return self.attention(layer, q)
        return self.attend_rows(q, pk, pv)

    def attend_rows(self, q: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor) -> torch.Tensor:
        """The reference: each row alone gathers its tokens' K/V from their slots of `pk`,
        `pv` ``(slots, nkv, hd)`` and attends to them causally, as if it ran by itself."""
        outs, offset, dev = [], 0, self.pool.device
        for table, c, n in zip(self.tables, self.context, self.num_new):
            index = torch.tensor(self.pool.slots(table, 0, c + n), device=dev)
            kr, vr = (x[index].transpose(0, 1)[None] for x in (pk, pv))  # (1, nkv, c + n, hd)
            new = torch.arange(c, c + n, device=dev)  # positions of the row's new tokens
            mask = torch.arange(c + n, device=dev)[None, :] <= new[:, None]  # (n, c + n)
            outs.append(sdpa(q[:, :, offset:offset + n], kr, vr, mask))
            offset += n
        return torch.cat(outs, dim=2)


def _check_rows(pool: PagedKVPool, tables, context, num_new) -> None:
    if not (len(tables) == len(context) == len(num_new)) or not tables:
        raise ValueError("tables, context and num_new must be non-empty and of equal length")
    if any(n < 1 for n in num_new):
        raise ValueError(f"every row must feed at least one token, got num_new={list(num_new)}")
    for b, (table, c, n) in enumerate(zip(tables, context, num_new)):
        if len(table) * pool.block_size < c + n:
            raise ValueError(f"row {b}: {len(table)} blocks cannot hold {c + n} tokens")


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
         is_causal: bool = False) -> torch.Tensor:
    """Scaled dot-product attention, K/V heads repeated for grouped-query models (as the
    model's own attention does)."""
    nh, nkv = q.shape[1], k.shape[1]
    if nkv != nh:
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
