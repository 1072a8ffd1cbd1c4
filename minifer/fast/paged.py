"""Paged attention for a packed serving step, planned for speed.

Reference: `PackedBatch.attend_rows` (equal to float rounding): one attention call per row,
every token's K/V gathered slot by slot. Here a step's plan is built once for every layer:

- decode rows (one new token each; the engine puts them first) share attention calls over
  right-padded batches, their padding masked. Rows are split by length into a few calls when
  that saves more than `GROUP_COST` padded tokens a call (`group_rows`);
- K/V are read a whole block per index (``"blocks"``), into scratch buffers reused by
  every layer and step instead of fresh allocations;
- or (``"kernel"``, the default where it runs: a CPU, fp32) decode rows go through
  `paged_attention.KERNEL`, minifer's C++ kernel, which reads the blocks in place.

How the pool is read is this package's choice (`read`; ``"slots"``: the reference)."""

from __future__ import annotations

import contextlib
import functools
import itertools
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch

from ..engine.kv_pool import PackedBatch, PagedKVPool, sdpa
from .paged_attention import KERNEL

__all__ = ["GROUP_COST", "READS", "PlannedAttention", "packed_attention", "group_rows", "read"]

GROUP_COST = 128  # padded tokens one more decode attention call is worth (see `group_rows`)

# per pool: reused (rows, width) buffers for one call's K and V reads, which only grow
_SCRATCH: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


READS = ("kernel", "blocks", "slots")  # how attention reads the pool; see the module doc
_READ = ["kernel"]  # the one in force


@contextlib.contextmanager
def read(how: str, *, restore: bool = True) -> Iterator[None]:
    """Read the pool `how` (`READS`) inside the block (``restore=False``: from now on)."""
    if how not in READS:
        raise ValueError(f"read must be one of {READS}, got {how!r}")
    before, _READ[0] = _READ[0], how
    try:
        yield
    finally:
        if restore:
            _READ[0] = before


def packed_attention(pool: PagedKVPool) -> Callable[[PackedBatch], PlannedAttention] | None:
    """`hooks.packed_attention`: each step over `pool` gets its planned attention, unless the
    slot reference is asked for (``"slots"``). ``"kernel"`` is built now, as the engine starts;
    where it cannot run (not a CPU in fp32, no build: `KERNEL` has warned, naming why) the
    steps read whole blocks."""
    how = _READ[0]
    if how == "slots":
        return None
    if how == "kernel" and not (pool.device.type == "cpu" and pool.dtype == torch.float32
                                and KERNEL.available()):
        how = "blocks"
    return functools.partial(PlannedAttention, how=how)


class PlannedAttention:
    """``plan(layer, q)``: `batch`'s attention output ``(1, nh, N, hd)`` at `layer`, whose new
    K/V `PackedBatch.attend` has already written."""

    def __init__(self, batch: PackedBatch, how: str = "blocks",
                 group_cost: int = GROUP_COST) -> None:
        pool, tables, context, num_new = batch.pool, batch.tables, batch.context, batch.num_new
        self.pool, self.read = pool, how
        starts = [0, *itertools.accumulate(num_new)][:-1]  # each row's first packed token
        single = [b for b, n in enumerate(num_new) if n == 1]  # the decode rows
        many = [b for b, n in enumerate(num_new) if n != 1]  # the prompt chunks
        self.num_single = len(single)
        # where the decode rows' tokens lie, unless they are the first ones (as usually)
        self.single_index = None if single == list(range(len(single))) else torch.tensor(
            [starts[b] for b in single], dtype=torch.long, device=pool.device)
        lengths = [context[b] + 1 for b in single]  # their tokens, the new one too
        self.kernel_args = None
        self.groups = []  # decode attention calls: (rows or None: all, count, gather, S, mask)
        if single and how == "kernel":
            self.kernel_args = _kernel_args(pool, [tables[b] for b in single], lengths)
        elif single:
            self.groups = self._plan_decode([tables[b] for b in single], lengths, group_cost)
        self.chunks = self._plan_chunks([(tables[b], context[b], num_new[b], starts[b])
                                         for b in many])

    def _plan_decode(self, tables, lengths: list[int], group_cost: int) -> list[tuple]:
        """The decode rows' attention calls: each reads its rows' whole blocks, padded to its
        longest row, and masks the padding."""
        pool, dev = self.pool, self.pool.device
        groups = group_rows(lengths, pool.block_size, group_cost)
        calls = []
        for rows in groups:
            lens = [lengths[i] for i in rows]
            S = -(-max(lens) // pool.block_size) * pool.block_size
            idx = [_padded(tables[i], S // pool.block_size) for i in rows]
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

    def _plan_chunks(self, rows: list[tuple]) -> list[tuple]:
        """One causal attention call per prompt chunk (its table, cached and new token counts,
        first packed token), over its cached and new tokens."""
        dev, bs = self.pool.device, self.pool.block_size
        chunks = []
        for table, c, n, offset in rows:
            L = -(-(c + n) // bs) * bs  # tokens read: c + n, rounded up to whole blocks
            gather = torch.tensor(_padded(table, L // bs), dtype=torch.long, device=dev)
            mask = None  # no cached tokens: SDPA's is_causal (a block's unused tail unseen)
            if c:  # new token i (at position c + i) sees keys 0 .. c + i
                q = torch.arange(c, c + n, device=dev)
                mask = torch.arange(L, device=dev)[None, :] <= q[:, None]  # (n, L)
            chunks.append((offset, n, L, gather, mask))
        return chunks

    def __call__(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        pk, pv = self.pool.k[layer], self.pool.v[layer]  # (num_blocks, block_size, nkv, hd)
        nkv, hd = pk.shape[2], pk.shape[3]
        kf, vf = pk.view(pk.shape[0], -1), pv.view(pv.shape[0], -1)  # one row per block
        qd = q[:, :, :self.num_single] if self.single_index is None else \
            q.index_select(2, self.single_index)  # (1, nh, D, hd): the decode rows' queries
        outs = []
        if self.kernel_args is not None:
            outs.append(self._attend_kernel(qd, pk, pv))
        elif self.num_single:
            outs.append(self._attend_decode(qd, kf, vf, nkv, hd))
        for offset, n, L, gather, mask in self.chunks:
            kc, vc = self._read(kf, vf, gather)
            kc, vc = (x.view(1, L, nkv, hd).transpose(1, 2) for x in (kc, vc))  # (1, nkv, L, hd)
            outs.append(sdpa(q[:, :, offset:offset + n], kc, vc, mask, mask is None))
        if self.single_index is None:  # the rows' outputs lie in packed order already
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        y = q.new_empty(q.shape)  # (1, nh, N, hd): each output at its token's place
        y.index_copy_(2, self.single_index, outs[0])
        for (offset, n, *_), out in zip(self.chunks, outs[1:]):
            y[:, :, offset:offset + n] = out
        return y

    def _attend_decode(self, q, kf, vf, nkv: int, hd: int) -> torch.Tensor:
        """The decode rows' attention ``(1, nh, D, hd)`` for their queries `q` ``(1, nh, D,
        hd)``, one SDPA call per group of rows."""
        qd = q[0].transpose(0, 1).unsqueeze(2)  # (D, nh, 1, hd)
        y = None if len(self.groups) == 1 else qd.new_empty(qd.shape)
        for which, G, gather, S, mask in self.groups:
            kd, vd = self._read(kf, vf, gather)
            kd, vd = (x.view(G, S, nkv, hd).transpose(1, 2) for x in (kd, vd))  # (G,nkv,S,hd)
            qg = qd if which is None else qd.index_select(0, which)
            yg = sdpa(qg, kd, vd, mask)  # (G, nh, 1, hd)
            y = yg if which is None else y.index_copy_(0, which, yg)
        return y.transpose(0, 2)  # (1, nh, D, hd)

    def _attend_kernel(self, q, pk, pv) -> torch.Tensor:
        """The decode rows' attention ``(1, nh, D, hd)`` for their queries `q` ``(1, nh, D,
        hd)``, through the paged kernel."""
        qd = q[0].transpose(0, 1).contiguous()  # (D, nh, hd)
        y = KERNEL(qd, pk, pv, *self.kernel_args, q.shape[-1] ** -0.5)  # (D, nh, hd)
        return y.transpose(0, 1).unsqueeze(0)

    def _read(self, kf: torch.Tensor, vf: torch.Tensor, index: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows `index` of the 2-D pool views `kf`, `vf`, read into the pool's scratch buffers."""
        n, w = index.numel(), kf.shape[1]
        k = torch.index_select(kf, 0, index, out=_scratch(self.pool, "k", n, w))
        v = torch.index_select(vf, 0, index, out=_scratch(self.pool, "v", n, w))
        return k, v


def _scratch(pool: PagedKVPool, name: str, rows: int, width: int) -> torch.Tensor:
    """A reused ``(rows, width)`` buffer of `pool`'s dtype for one call's K or V reads.

    Layers run one after another and each consumes its reads before the next, so one buffer
    per name serves every layer and step: no fresh megabytes per layer. Nothing in it outlives
    the call; it is no second copy of the K/V."""
    buffers = _SCRATCH.setdefault(pool, {})
    buf = buffers.get(name)
    if buf is None or buf.numel() < rows * width:
        buf = buffers[name] = torch.empty(rows * width, dtype=pool.dtype, device=pool.device)
    return buf[:rows * width].view(rows, width)


def _kernel_args(pool: PagedKVPool, tables, lengths: list[int]) -> tuple[torch.Tensor, ...]:
    """The decode rows' block table (each padded to the longest row's blocks, masked by its
    length) and lengths for `PagedDecodeKernel`."""
    M = -(-max(lengths) // pool.block_size)
    rows = [_padded(t, M) for t in tables]
    return (torch.tensor(rows, dtype=torch.long, device=pool.device),
            torch.tensor(lengths, dtype=torch.long, device=pool.device))


def group_rows(lengths: Sequence[int], unit: int, cost: int) -> list[list[int]]:
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


def _padded(table: Sequence[int], count: int) -> list[int]:
    """The first `count` block ids of `table`, padded with its first (the padding is masked)."""
    idx = list(table[:count])
    return idx + [idx[0]] * (count - len(idx))
