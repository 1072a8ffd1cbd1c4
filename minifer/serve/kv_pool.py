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
        per name serves every layer and step (it only grows): no fresh allocation of megabytes
        per layer. Nothing in it outlives the call; it is no second copy of the K/V.
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
    ``num_new[b]`` new ones: a decode row one, a prompt chunk many. All new tokens go through
    the model as one ``(1, N)`` sequence, so the token-wise layers run once for the whole step
    (vLLM's and nano-vllm's packing). Attention alone keeps rows apart: `attend` writes the new
    K/V at their slots (`slot_mapping`) and lets each row attend to its own tokens only, at its
    own positions (`positions`). Decode rows come first and share attention calls over
    right-padded batches; each prompt chunk gets its own causal call.

    `read` says how attention reads a row's K/V from the pool (`READS`): ``"slots"``, one
    index per token (the readable reference); ``"blocks"``, one per block (block-sized copies;
    decode rows split by length into a few calls when that saves more than `group_cost`
    padded tokens a call, `_group_rows`); ``"kernel"``, decode rows through
    `paged_attention.KERNEL`, which reads the blocks in place. The same attention every way,
    to float rounding (tested). `logits_index`: the packed index of the last token of each
    row in `logits_rows` (default: all), the only positions whose logits are needed.
    """

    packed = True  # GPT.forward: run the packed path (see `minifer.cache.PackedKVCache`)

    def __init__(self, pool: PagedKVPool, tables: Sequence[Sequence[int]],
                 context: Sequence[int], num_new: Sequence[int],
                 logits_rows: Sequence[int] | None = None, read: str = "blocks",
                 group_cost: int = GROUP_COST) -> None:
        check_read(read)
        _check_rows(pool, tables, context, num_new)
        dev = pool.device
        self.pool, self.read = pool, read
        self.num_rows, self.num_tokens = len(tables), sum(num_new)
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
        self.num_single = sum(1 for n in num_new if n == 1)  # the decode rows, first
        lengths = [c + 1 for c in context[:self.num_single]]  # their tokens, the new one too
        self._kernel_args = None
        self._groups = []  # decode attention calls: (rows or None: all, count, gather, S, mask)
        if self.num_single and read == "kernel":
            self._kernel_args = _kernel_args(pool, tables, lengths)
        elif self.num_single:
            self._groups = self._plan_decode(tables, lengths, group_cost)
        self._chunks = self._plan_chunks(tables[self.num_single:], context[self.num_single:],
                                         num_new[self.num_single:])

    def _plan_decode(self, tables, lengths: list[int], group_cost: int) -> list[tuple]:
        """The decode rows' attention calls: each reads its rows' K/V padded to its longest
        row (in whole blocks, or tokens for ``"slots"``) and masks the padding."""
        pool, dev = self.pool, self.pool.device
        unit = 1 if self.read == "slots" else pool.block_size  # tokens per index
        groups = (_group_rows(lengths, unit, group_cost) if self.read == "blocks"
                  else [list(range(len(lengths)))])
        calls = []
        for rows in groups:
            lens = [lengths[i] for i in rows]
            S = -(-max(lens) // unit) * unit
            idx = [_read_index(pool, tables[i], L, S // unit, self.read)
                   for i, L in zip(rows, lens)]
            gather = torch.tensor(idx, dtype=torch.long, device=dev).view(-1)
            mask = None
            if any(L != S for L in lens):
                allowed = (torch.arange(S, device=dev)[None, :]
                           < torch.tensor(lens, device=dev)[:, None])  # (G, S)
                mask = torch.zeros(allowed.shape, dtype=pool.dtype, device=dev)
                mask = mask.masked_fill(~allowed, float("-inf"))[:, None, None, :]
            which = None if len(groups) == 1 else torch.tensor(rows, device=dev)
            calls.append((which, len(rows), gather, S, mask))
        return calls

    def _plan_chunks(self, tables, context, num_new) -> list[tuple]:
        """One causal attention call per prompt chunk, over its cached and new tokens."""
        dev, unit = self.pool.device, 1 if self.read == "slots" else self.pool.block_size
        chunks, offset = [], self.num_single
        for table, c, n in zip(tables, context, num_new):
            L = -(-(c + n) // unit) * unit  # tokens read: c + n, rounded up to whole blocks
            how = "slots" if self.read == "slots" else "blocks"
            gather = torch.tensor(_read_index(self.pool, table, c + n, L // unit, how),
                                  dtype=torch.long, device=dev)
            mask = None  # no cached tokens: SDPA's is_causal (a block's unused tail unseen)
            if c:  # new token i (at position c + i) sees keys 0 .. c + i
                q = torch.arange(c, c + n, device=dev)
                mask = torch.arange(L, device=dev)[None, :] <= q[:, None]  # (n, L)
            chunks.append((offset, n, L, gather, mask))
            offset += n
        return chunks

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
            outs.append(self._attend_kernel(q, pk, pv))
        elif self.num_single:
            outs.append(self._attend_decode(q, kf, vf, nkv, hd))
        for offset, n, L, gather, mask in self._chunks:
            kc, vc = self._read(kf, vf, gather)
            kc, vc = (x.view(1, L, nkv, hd).transpose(1, 2) for x in (kc, vc))  # (1, nkv, L, hd)
            outs.append(_sdpa(q[:, :, offset:offset + n], kc, vc, mask, mask is None))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def _attend_decode(self, q, kf, vf, nkv: int, hd: int) -> torch.Tensor:
        """The decode rows' attention ``(1, nh, D, hd)``, one SDPA call per group of rows."""
        qd = q[0, :, :self.num_single].transpose(0, 1).unsqueeze(2)  # (D, nh, 1, hd)
        y = None if len(self._groups) == 1 else qd.new_empty(qd.shape)
        for which, G, gather, S, mask in self._groups:
            kd, vd = self._read(kf, vf, gather)
            kd, vd = (x.view(G, S, nkv, hd).transpose(1, 2) for x in (kd, vd))  # (G,nkv,S,hd)
            qg = qd if which is None else qd.index_select(0, which)
            yg = _sdpa(qg, kd, vd, mask, False)  # (G, nh, 1, hd)
            y = yg if which is None else y.index_copy_(0, which, yg)
        return y.transpose(0, 2)  # (1, nh, D, hd)

    def _attend_kernel(self, q, pk, pv) -> torch.Tensor:
        """The decode rows' attention ``(1, nh, D, hd)`` through the paged kernel."""
        D, hd = self.num_single, q.shape[-1]
        qd = q[0, :, :D].transpose(0, 1)  # (D, nh, hd)
        if D == 1:
            qd = torch.cat([qd, qd])
        y = KERNEL(qd.contiguous(), pk, pv, *self._kernel_args, hd ** -0.5)  # (D', nh, hd)
        return y[:D].transpose(0, 1).unsqueeze(0)

    def _read(self, kf: torch.Tensor, vf: torch.Tensor, index: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows `index` of the 2-D pool views `kf`, `vf`, read into the pool's scratch buffers."""
        n, w = index.numel(), kf.shape[1]
        k = torch.index_select(kf, 0, index, out=self.pool.scratch("k", n, w))
        v = torch.index_select(vf, 0, index, out=self.pool.scratch("v", n, w))
        return k, v


def _check_rows(pool: PagedKVPool, tables, context, num_new) -> None:
    if not (len(tables) == len(context) == len(num_new)) or not tables:
        raise ValueError("tables, context and num_new must be non-empty and of equal length")
    if any(n < 1 for n in num_new):
        raise ValueError(f"every row must feed at least one token, got num_new={list(num_new)}")
    singles = sum(1 for n in num_new if n == 1)
    if any(n != 1 for n in num_new[:singles]):
        raise ValueError("rows feeding one token (decode rows) must come first")
    for b, (table, c, n) in enumerate(zip(tables, context, num_new)):
        if len(table) * pool.block_size < c + n:
            raise ValueError(f"row {b}: {len(table)} blocks cannot hold {c + n} tokens")


def _kernel_args(pool: PagedKVPool, tables, lengths: list[int]) -> tuple[torch.Tensor, ...]:
    """The decode rows' block table and lengths for `PagedDecodeKernel`, padded to >= 2 rows
    and blocks: a padding row attends to one token, a padding block is masked."""
    M = max(2, -(-max(lengths) // pool.block_size))
    rows = [_read_index(pool, t, L, M, "blocks") for t, L in zip(tables, lengths)]
    if len(lengths) == 1:
        rows, lengths = rows + [rows[0]], lengths + [1]
    return (torch.tensor(rows, dtype=torch.long, device=pool.device),
            torch.tensor(lengths, dtype=torch.long, device=pool.device))


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
