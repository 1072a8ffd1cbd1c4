"""The paged KV cache's storage, and attention over it for one packed forward call.

`PagedKVPool` holds, per layer, one K and one V tensor of shape
``(num_blocks, block_size, kv_heads, head_dim)``; which slot a token uses is the
`BlockManager`'s decision. A serving step feeds every scheduled token — one per decode row,
many per prompt chunk — through the model as one sequence: `PackedBatch` is that call's cache
(a `minifer.cache.PackedKVCache`). It writes each new token's K/V once, into its slot, and
lets each row attend only to its own tokens, reading them where they lie in the pool: by slot
(the readable reference), by whole block, or, for decode rows, through a paged-attention
kernel that reads the blocks in place (`paged_attention`). Every way gives each row the
attention it would get alone (tested against the static cache).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..checks import check_int
from ..config import kv_token_bytes
from .paged_attention import KERNEL

__all__ = ["PagedKVPool", "PackedBatch", "READS", "check_read"]

READS = ("blocks", "slots", "kernel")  # how PackedBatch reads K/V (see its docstring)
GROUP_COST = 128  # padded tokens one more decode attention call is worth (see `_group_rows`)


def check_read(read: str) -> None:
    """A ValueError unless `read` is one of `READS`."""
    if read not in READS:
        raise ValueError(f"read must be one of {READS}, got {read!r}")


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
        shape = (num_blocks, block_size, n_kv_head, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.n_layer, self.num_blocks, self.block_size = n_layer, num_blocks, block_size
        self.n_kv_head, self.head_dim = n_kv_head, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self._scratch: dict[str, torch.Tensor] = {}

    def scratch(self, name: str, rows: int, width: int) -> torch.Tensor:
        """A reused ``(rows, width)`` buffer for one attention call's K or V reads (`name`).

        Layers run one after another and each consumes its reads before the next, so one buffer
        per name serves every layer and step; it only grows. Reading into it, not into a fresh
        tensor, saves an allocation of megabytes per layer (on CPU a fresh large tensor costs
        page faults, which took as long as the copy itself). It holds one layer's reads for
        one call: not a second copy of the running K/V, nothing in it outlives the call.
        """
        n = rows * width
        buf = self._scratch.get(name)
        if buf is None or buf.numel() < n:
            buf = self._scratch[name] = torch.empty(n, dtype=self.dtype, device=self.device)
        return buf[:n].view(rows, width)

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
        return kv_token_bytes(self.n_layer, self.n_kv_head, self.head_dim, self.k[0].element_size())

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
        the prefill worker to the decode worker (`minifer.serve.disagg`). Only the tokens'
        slots are copied, not the unfilled tail of the last block.
        """
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
    ``num_new[b]`` new ones: a decode row feeds one, a prompt chunk many. All rows' new tokens
    go through the model as one sequence of ``N = sum(num_new)`` tokens (``idx`` of shape
    ``(1, N)``), so the token-wise layers (embeddings, projections, MLP) run once for the whole
    step, whatever mix of prefill and decode it holds: vLLM v1's and nano-vllm's packing.
    Attention is the only layer that must keep rows apart: `attend` writes the new K/V into
    the pool at their slots (`slot_mapping`, each token written once) and lets each row attend
    only to its own tokens, at its own positions (`positions`).

    Attention reads each row's K/V where they lie in the pool, in one of two ways (`read`):

    - ``"slots"``, the readable reference: one index per cached token (`PagedKVPool.slots`),
      gathered into a dense buffer per layer for `torch.nn.functional.scaled_dot_product_attention`;
    - ``"blocks"`` (the default), block-table indexed: one index per *block* of the row's table,
      so the read moves whole blocks (``block_size`` tokens at a time) and the index tensors are
      ``block_size`` times smaller; the unused tail of a row's last block is masked out;
    - ``"kernel"``: the decode rows attend through `paged_attention.PagedDecodeKernel`, a
      compiled kernel that reads each cached key and value in place (no copy); prompt chunks
      read whole blocks as above.

    All three build the index tensors once per step (not per layer) and give the same attention up
    to float rounding (tested). The block path also splits the decode rows into a few attention
    calls by length, so that a short row is not padded to the longest one in the step: each
    call beyond the first must save more than `group_cost` padded tokens (`_group_rows`). Neither keeps a second copy of the running K/V between steps:
    each token's K/V is written once, into the pool. Rows feeding one token each (the decode
    rows) must come first; they share one attention call over a right-padded batch, and every
    longer row (a prompt chunk) gets its own call, causal over its new tokens on top of its
    cached ones.

    `logits_index` holds, for each row in `logits_rows` (default: all), the packed index of its
    last token: the only positions whose next-token logits are needed.
    """

    packed = True  # GPT.forward: run the packed path (see `minifer.cache.PackedKVCache`)

    def __init__(self, pool: PagedKVPool, tables: Sequence[Sequence[int]],
                 context: Sequence[int], num_new: Sequence[int],
                 logits_rows: Sequence[int] | None = None, read: str = "blocks",
                 group_cost: int = GROUP_COST) -> None:
        check_read(read)
        if not (len(tables) == len(context) == len(num_new)) or not tables:
            raise ValueError("tables, context and num_new must be non-empty and of equal length")
        if any(n < 1 for n in num_new):
            raise ValueError(f"every row must feed at least one token, got num_new={list(num_new)}")
        singles = sum(1 for n in num_new if n == 1)
        if any(n != 1 for n in num_new[:singles]):
            raise ValueError("rows feeding one token (decode rows) must come first")
        bs, dev = pool.block_size, pool.device
        for b, (table, c, n) in enumerate(zip(tables, context, num_new)):
            if len(table) * bs < c + n:
                raise ValueError(f"row {b}: {len(table)} blocks cannot hold {c + n} tokens")
        self.pool = pool
        self.num_rows, self.num_tokens = len(tables), sum(num_new)
        self.context, self.num_new = list(context), list(num_new)
        pos: list[int] = []
        slots: list[int] = []
        for table, c, n in zip(tables, context, num_new):
            pos.extend(range(c, c + n))
            slots.extend(pool.slots(table, c, c + n))
        self.positions = torch.tensor([pos], dtype=torch.long, device=dev)  # (1, N)
        self.slot_mapping = torch.tensor(slots, dtype=torch.long, device=dev)  # (N,)
        ends = list(itertools.accumulate(num_new))
        rows = range(len(tables)) if logits_rows is None else logits_rows
        self.logits_index = torch.tensor([ends[b] - 1 for b in rows], dtype=torch.long, device=dev)
        # decode rows: attention calls over right-padded batches (padding masked out); rows of
        # very different lengths go to different calls, so short rows are not padded to the
        # longest (`_group_rows`)
        self.read, self.num_single = read, singles
        self._groups = []  # (its rows, None: all; how many; gather; padded length; mask)
        self._kernel_args: tuple[torch.Tensor, torch.Tensor] | None = None
        unit = 1 if read == "slots" else bs  # tokens per index
        lengths = [c + 1 for c in context[:singles]]  # each decode row's tokens, its new one too
        if singles and read == "kernel":
            # the block table and lengths of the decode rows, padded to >= 2 rows and blocks
            # (`PagedDecodeKernel`): a padding row attends to one token, a padding block is masked
            M = max(2, -(-max(lengths) // bs))
            rows_t = [_read_index(pool, t, L, M, "blocks") for t, L in zip(tables, lengths)]
            if singles == 1:
                rows_t, lengths = rows_t + [rows_t[0]], lengths + [1]
            self._kernel_args = (torch.tensor(rows_t, dtype=torch.long, device=dev),
                                 torch.tensor(lengths, dtype=torch.long, device=dev))
        elif singles:
            groups = _group_rows(lengths, unit, group_cost) if read == "blocks" else [
                list(range(singles))]
            for rows_g in groups:
                lens = [lengths[i] for i in rows_g]
                S = -(-max(lens) // unit) * unit
                idx = [_read_index(pool, tables[i], L, S // unit, read)
                       for i, L in zip(rows_g, lens)]
                gather = torch.tensor(idx, dtype=torch.long, device=dev).view(-1)
                mask = None
                if any(L != S for L in lens):
                    allowed = (torch.arange(S, device=dev)[None, :]
                               < torch.tensor(lens, device=dev)[:, None])  # (G, S)
                    mask = torch.zeros(allowed.shape, dtype=pool.dtype, device=dev)
                    mask = mask.masked_fill(~allowed, float("-inf"))[:, None, None, :]
                which = None if len(groups) == 1 else torch.tensor(rows_g, device=dev)
                self._groups.append((which, len(rows_g), gather, S, mask))
        # prompt chunks: one causal attention call each, over cached + new tokens
        self._chunks = []
        offset = singles
        for table, c, n in list(zip(tables, context, num_new))[singles:]:
            L = -(-(c + n) // unit) * unit  # tokens read: c + n, rounded up to whole blocks
            gather = torch.tensor(_read_index(pool, table, c + n, L // unit,
                                              "slots" if read == "slots" else "blocks"),
                                  dtype=torch.long, device=dev)
            mask = None
            # new token i (at position c + i) sees keys 0..c + i; without cached tokens that is
            # SDPA's is_causal (top-left aligned: a block's unused tail is never seen)
            if c:
                q = torch.arange(c, c + n, device=dev)
                mask = torch.arange(L, device=dev)[None, :] <= q[:, None]  # (n, L)
            self._chunks.append((offset, n, L, gather, mask))
            offset += n

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """Store the new ``k, v`` ``(1, nkv, N, hd)`` at their slots of `layer`; return every
        new token's attention output ``(1, nh, N, hd)`` for queries `q` ``(1, nh, N, hd)``."""
        nkv, hd = k.shape[1], k.shape[3]
        pk, pv = self.pool.k[layer], self.pool.v[layer]  # (num_blocks, block_size, nkv, hd)
        pk.view(-1, nkv, hd).index_copy_(0, self.slot_mapping, k[0].transpose(0, 1))
        pv.view(-1, nkv, hd).index_copy_(0, self.slot_mapping, v[0].transpose(0, 1))
        # rows of the index: a block (nkv * hd * block_size numbers) or a slot (nkv * hd)
        width = nkv * hd * (1 if self.read == "slots" else pk.shape[1])
        kf, vf = pk.view(-1, width), pv.view(-1, width)  # 2-D: index_select copies whole rows
        outs = []
        if self._kernel_args is not None:
            D = self.num_single
            qd = q[0, :, :D].transpose(0, 1)  # (D, nh, hd)
            if D == 1:
                qd = torch.cat([qd, qd])
            y = KERNEL(qd.contiguous(), pk, pv, *self._kernel_args, hd ** -0.5)  # (D', nh, hd)
            outs.append(y[:D].transpose(0, 1).unsqueeze(0))  # (1, nh, D, hd)
        elif self.num_single:
            D = self.num_single
            qd = q[0, :, :D].transpose(0, 1).unsqueeze(2)  # (D, nh, 1, hd)
            y = None if len(self._groups) == 1 else qd.new_empty(qd.shape)
            for which, G, gather, S, mask in self._groups:
                kd, vd = self._read(kf, vf, gather)
                kd, vd = (x.view(G, S, nkv, hd).transpose(1, 2) for x in (kd, vd))  # (G,nkv,S,hd)
                qg = qd if which is None else qd.index_select(0, which)
                yg = _sdpa(qg, kd, vd, mask, False)  # (G, nh, 1, hd)
                y = yg if which is None else y.index_copy_(0, which, yg)
            outs.append(y.transpose(0, 2))  # (1, nh, D, hd)
        for offset, n, L, gather, mask in self._chunks:
            kc, vc = self._read(kf, vf, gather)
            kc, vc = (x.view(1, L, nkv, hd).transpose(1, 2) for x in (kc, vc))  # (1, nkv, L, hd)
            outs.append(_sdpa(q[:, :, offset:offset + n], kc, vc, mask, mask is None))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def _read(self, kf: torch.Tensor, vf: torch.Tensor, index: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows `index` of the 2-D pool views `kf`, `vf`, read into the pool's scratch buffers."""
        n, w = index.numel(), kf.shape[1]
        k = torch.index_select(kf, 0, index, out=self.pool.scratch("k", n, w))
        v = torch.index_select(vf, 0, index, out=self.pool.scratch("v", n, w))
        return k, v


def _group_rows(lengths: Sequence[int], unit: int, cost: int) -> list[list[int]]:
    """Split decode rows into attention calls: each call pads its rows to its longest (in
    `unit`s), and each call beyond the first costs `cost` tokens (its fixed overhead). Rows
    sorted by length, the split that reads the fewest tokens plus `cost` per call (dynamic
    programming over the sorted rows; a step's few dozen rows make it cheap)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    padded = [-(-lengths[i] // unit) * unit for i in order]  # descending
    n = len(order)
    best, cut = [0.0] * (n + 1), [0] * (n + 1)  # best[j]: rows order[:j] split optimally
    for j in range(1, n + 1):
        best[j], cut[j] = min((best[i] + (j - i) * padded[i] + cost, i) for i in range(j))
    groups, j = [], n
    while j:
        groups.append(sorted(order[cut[j]:j]))
        j = cut[j]
    return groups[::-1]


def _read_index(pool: PagedKVPool, table: Sequence[int], length: int, count: int,
                read: str) -> list[int]:
    """`count` indices that read a row's first `length` tokens: its blocks (``"blocks"``) or its
    slots (``"slots"``), padded with the first one (the padding is masked out)."""
    idx = list(table[:count]) if read == "blocks" else pool.slots(table, 0, length)
    return idx + [idx[0]] * (count - len(idx))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          is_causal: bool) -> torch.Tensor:
    """Scaled dot-product attention, K/V heads repeated for grouped-query models (as the
    model's own attention does)."""
    nh, nkv = q.shape[1], k.shape[1]
    if nkv != nh:
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
