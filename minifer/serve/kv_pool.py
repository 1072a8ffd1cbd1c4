"""The paged KV cache's storage, and attention over it through the unchanged `GPT.forward`.

`PagedKVPool` holds, per layer, one K and one V tensor of shape
``(num_blocks, block_size, kv_heads, head_dim)``; a token's slot is chosen by the
`BlockManager`. Attention needs each sequence's keys as one contiguous run, so for every forward
call a `PagedBatch` *gathers* each row's cached K/V from its blocks into exactly the layout
`StaticKVCache` uses — rows right-aligned (left padded), every row writing its new tokens at the
same slot ``pos``, ``start[b]`` padding slots in front of row ``b`` — hands that to the model
as its cache, and *scatters* the new tokens' K/V back into their blocks.

Gathering copies the cached K/V once per layer per call, about as many bytes as attention then
reads: a fused paged-attention kernel (vLLM's) reads the blocks in place instead. The copy keeps
the model code unchanged and the result identical to the static cache (tested).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["PagedKVPool", "PagedBatch", "DecodeWorkspace"]


class PagedKVPool:
    """K/V tensors ``(num_blocks, block_size, kv_heads, head_dim)`` for every layer."""

    def __init__(self, n_layer: int, num_blocks: int, block_size: int, n_kv_head: int,
                 head_dim: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        for name, value in (("n_layer", n_layer), ("num_blocks", num_blocks),
                            ("block_size", block_size), ("n_kv_head", n_kv_head),
                            ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PagedKVPool {name} must be a positive integer, got {value!r}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"PagedKVPool dtype must be a float torch dtype, got {dtype!r}")
        shape = (num_blocks, block_size, n_kv_head, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.n_layer, self.num_blocks, self.block_size = n_layer, num_blocks, block_size
        self.n_kv_head, self.head_dim = n_kv_head, head_dim
        self.dtype, self.device = dtype, torch.device(device)

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
        """K and V of one token in all layers: 2 × layers × kv_heads × head_dim × element size."""
        return 2 * self.n_layer * self.n_kv_head * self.head_dim * self.k[0].element_size()

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_size * self.bytes_per_token

    def slots(self, table: Sequence[int], start: int, stop: int) -> list[int]:
        """Flat slot indices (block id × block_size + offset) of tokens ``start..stop-1``."""
        bs = self.block_size
        return [table[i // bs] * bs + i % bs for i in range(start, stop)]

    def batch(self, tables: Sequence[Sequence[int]], context: Sequence[int],
              num_new: int) -> PagedBatch:
        """A cache view for one forward call: row b has `context[b]` cached tokens in the
        blocks `tables[b]` and feeds `num_new` new ones (the same count for every row)."""
        return PagedBatch(self, tables, context, num_new)

    def __repr__(self) -> str:
        return (f"PagedKVPool(layers={self.n_layer}, blocks={self.num_blocks}, "
                f"block_size={self.block_size}, kv_heads={self.n_kv_head}, "
                f"head_dim={self.head_dim}, dtype={self.dtype}, nbytes={self.nbytes:,})")


class PagedBatch:
    """The cache interface `GPT.forward` expects (`StaticKVCache`'s), backed by a paged pool.

    Row ``b`` holds ``context[b]`` cached tokens; with ``S = max(context)`` they are placed at
    slots ``S - context[b] .. S - 1`` (``start[b] = S - context[b]``, the padding), and the new
    tokens at slots ``S .. S + T - 1`` for every row, so positions and masks come out exactly as
    for a left-padded `StaticKVCache` batch.
    """

    def __init__(self, pool: PagedKVPool, tables: Sequence[Sequence[int]],
                 context: Sequence[int], num_new: int) -> None:
        if len(tables) != len(context) or not tables:
            raise ValueError("tables and context must be non-empty and of equal length")
        if num_new < 1:
            raise ValueError(f"num_new must be >= 1, got {num_new}")
        self.pool = pool
        B, S, T = len(tables), max(context), num_new
        for b, (table, c) in enumerate(zip(tables, context)):
            if len(table) * pool.block_size < c + T:
                raise ValueError(f"row {b}: {len(table)} blocks cannot hold {c + T} tokens")
        dev = pool.device
        self.batch_size, self.pos, self.max_len = B, S, S + T
        self.start = torch.tensor([S - c for c in context], dtype=torch.long, device=dev)
        self.padded = any(c != S for c in context)
        # Where row b's slots S+T come from: padding (reads slot 0, masked anyway), its cached
        # tokens, then its new ones (written to the pool first, so one gather fetches all).
        rows = [[0] * (S - c) + pool.slots(t, 0, c + T) for t, c in zip(tables, context)]
        self._gather = torch.tensor(rows, dtype=torch.long, device=dev).view(-1)  # (B*(S+T),)
        self._scatter = torch.tensor([r[S:] for r in rows], dtype=torch.long,
                                     device=dev).view(-1)  # (B*T,): the new tokens' slots
        self._buffers: list[torch.Tensor] | None = None  # reused by every layer

    def check_room(self, n: int) -> None:
        if self.pos + n > self.max_len:
            raise ValueError(f"paged batch holds {self.max_len - self.pos} new tokens per row, "
                             f"got {n}")

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new ``k, v`` ``(B, kv_heads, T, head_dim)`` in their blocks; return every row's
        cached plus new K/V ``(B, kv_heads, S + T, head_dim)``, right-aligned."""
        B, nkv, T, hd = k.shape
        S = self.pos
        if self._buffers is None:
            self._buffers = [torch.empty(B * (S + T), nkv, hd, dtype=k.dtype, device=k.device)
                             for _ in range(2)]
        out = []
        for store, new, buf in zip((self.pool.k[layer], self.pool.v[layer]), (k, v), self._buffers):
            flat = store.view(-1, nkv, hd)  # (num_blocks * block_size, nkv, hd)
            flat.index_copy_(0, self._scatter, new.transpose(1, 2).reshape(B * T, nkv, hd))
            torch.index_select(flat, 0, self._gather, out=buf)
            out.append(buf.view(B, S + T, nkv, hd).transpose(1, 2))  # (B, nkv, S + T, hd)
        return out[0], out[1]

    def advance(self, n: int) -> None:
        self.pos += n


class DecodeWorkspace:
    """The decode batch's K/V kept contiguous between steps, so they are gathered only when
    the batch changes.

    While the same requests decode step after step, each step adds one token per row: the
    workspace appends it in place (and writes it to the pool too, which stays the one source
    of truth), exactly like `StaticKVCache`. A request joining, leaving or being preempted
    changes the batch, and the workspace is rebuilt from the pool with one gather. The price is
    a second, dense copy of the running requests' K/V (``room`` slots of headroom per row): a
    fused paged-attention kernel would need neither the copy nor the gather. A rebuild may
    reuse the previous workspace's `storage` (its contents are gathered afresh from the pool).
    """

    def __init__(self, pool: PagedKVPool, keys: Sequence, tables: Sequence[Sequence[int]],
                 context: Sequence[int], room: int = 64,
                 storage: list[torch.Tensor] | None = None) -> None:
        B, S = len(tables), max(context)
        nkv, hd, dev = pool.n_kv_head, pool.head_dim, pool.device
        self.pool, self.keys = pool, tuple(keys)
        self.batch_size, self.pos, self.max_len = B, S, S + room
        self.lengths = list(context)
        self.start = torch.tensor([S - c for c in context], dtype=torch.long, device=dev)
        self.padded = any(c != S for c in context)
        shape = (B, nkv, self.max_len, hd)  # slots past pos are written before being read
        need = B * nkv * self.max_len * hd
        if storage is None or storage[0].numel() < need:  # else reuse: no fresh pages to fault in
            storage = [torch.empty(need + need // 4, dtype=pool.dtype, device=dev)
                       for _ in range(2 * pool.n_layer)]
        self.storage = storage  # flat buffers; pass them to the next workspace
        views = [t[:need].view(shape) for t in storage]
        self.k, self.v = views[:pool.n_layer], views[pool.n_layer:]
        # padding slots copy slot 0 of the pool: finite values, masked out by attention
        rows = [[0] * (S - c) + pool.slots(t, 0, c) for t, c in zip(tables, context)]
        if S:
            idx = torch.tensor(rows, dtype=torch.long, device=dev).view(-1)
            for store, buf in ((pool.k, self.k), (pool.v, self.v)):
                for layer in range(pool.n_layer):
                    got = store[layer].view(-1, nkv, hd).index_select(0, idx)
                    buf[layer][:, :, :S] = got.view(B, S, nkv, hd).transpose(1, 2)
        self._scatter: torch.Tensor | None = None

    def matches(self, keys: Sequence, context: Sequence[int]) -> bool:
        """Whether this workspace holds exactly these rows at these lengths, with room for one
        more token each."""
        return (tuple(keys) == self.keys and list(context) == self.lengths
                and self.pos < self.max_len)

    def prepare(self, tables: Sequence[Sequence[int]]) -> DecodeWorkspace:
        """Set the pool slots where this step's new tokens go; returns self (the cache)."""
        bs = self.pool.block_size
        slots = [t[c // bs] * bs + c % bs for t, c in zip(tables, self.lengths)]
        self._scatter = torch.tensor(slots, dtype=torch.long, device=self.pool.device)
        return self

    def check_room(self, n: int) -> None:
        if n != 1 or self.pos + n > self.max_len:
            raise ValueError(f"the decode workspace takes one token per row per step with "
                             f"{self.max_len - self.pos} slots left, got {n}")

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, nkv, T, hd = k.shape
        end = self.pos + T
        for store, buf, new in ((self.pool.k, self.k, k), (self.pool.v, self.v, v)):
            buf[layer][:, :, self.pos:end] = new
            store[layer].view(-1, nkv, hd).index_copy_(0, self._scatter, new[:, :, 0])
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def advance(self, n: int) -> None:
        self.pos += n
        self.lengths = [c + n for c in self.lengths]
        self._scatter = None
