"""The KV cache: keys and values of every token seen so far, kept so decode never recomputes them.

A token's keys and values depend only on the tokens before it (the causal mask), so once computed
they never change (claim KV-1). `StaticKVCache` preallocates them and writes each new token into
the next free slot in place: the decode loop never concatenates or reallocates. Prompts of
different lengths share a batch *left padded* (`KVCache`'s ``start``); attention runs row by row
over each row's real slots (`AttentionInputs.rows`) and never reads the padding.

`KVCache` writes down what the model asks of any cache (the serving engine's paged pool keeps
its packed variant, `PackedKVCache`), and `AttentionInputs` bundles what every layer needs for
one forward call. How exact: as `GPT` says; the int8 cache approximates (tests/test_exactness.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from .checks import check_int
from .config import kv_token_bytes
from .device import as_device

SCALE_DTYPE = torch.float16  # the int8 cache's per-head-per-token scales


@runtime_checkable
class KVCache(Protocol):
    """What `GPT.forward` needs of a KV cache (`StaticKVCache` keeps it; the model never asks
    which cache it has):

    - `batch_size` rows, all writing their new tokens at the same slot `pos` (a Python int);
      row b's real tokens start at slot ``start[b]`` (a ``[batch]`` long tensor: left padding);
      `padded` says whether any row is padded (kept on the host: no device sync to ask);
    - `check_room(n)`: raise a clear ValueError unless `n` more slots fit (`max_len` in all);
    - ``update(layer, k, v)``: store the new tokens' ``k, v`` ``[B, kv_heads, T, head_dim]`` at
      slots ``pos..pos+T-1`` of `layer`; return the layer's K/V of slots ``0..pos+T-1``;
    - `advance(n)`: after every layer has written, move `pos` on by `n`."""

    batch_size: int
    max_len: int
    pos: int
    start: torch.Tensor
    padded: bool

    def check_room(self, n: int) -> None: ...

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def advance(self, n: int) -> None: ...


@runtime_checkable
class PackedKVCache(Protocol):
    """A cache for one forward call over rows of any lengths (decode rows, prompt chunks)
    packed into one sequence, not padded: `GPT.forward_packed` runs all ``num_tokens`` new
    tokens as one ``(1, N)`` sequence and leaves attention to the cache:

    - `packed` is True (how `GPT.forward` tells this cache from a `KVCache`);
    - `positions` ``(1, N)``: each new token's position in its own row;
    - ``attend(layer, q, k, v)``: store the new tokens' ``k, v`` ``(1, kv_heads, N, head_dim)``
      and return the attention output ``(1, heads, N, head_dim)`` of queries `q`, each row's
      tokens attending only to that row's cached and new tokens, causally;
    - `logits_index`: the packed indices whose next-token logits the caller wants
      (`minifer.engine.kv_pool.PackedBatch` implements it over the paged pool)."""

    packed: bool
    num_tokens: int
    positions: torch.Tensor
    logits_index: torch.Tensor

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> torch.Tensor: ...


@dataclass
class AttentionInputs:
    """Everything an attention layer needs besides its input, built once per forward call and
    passed unchanged through every layer.

    - `positions` ``(B, T)``: each new token's position (for the position embedding);
    - `mask`: boolean or additive, broadcastable to ``(B, heads, T, S)``; None when `is_causal`
      (a fresh unpadded prefill) or when every cached slot may be seen (an unpadded decode);
    - `cache`: the `KVCache` the layers write to and read from (None: recompute, no cache);
    - `packed`, `rotation`: see their comments below;
    - `rows`: attention runs row by row over each row's own slots, exactly the arithmetic of the
      row alone (a padded row's softmax adds the same numbers in another order, which W8A8 can
      turn into another token)."""

    positions: torch.Tensor
    mask: torch.Tensor | None = None
    is_causal: bool = False
    cache: KVCache | None = None
    packed: bool = False  # rows packed in one sequence: attention is `cache.attend` (PackedKVCache)
    rotation: tuple[torch.Tensor, torch.Tensor] | None = None  # rotary cos, sin: `GPT.blocks`
    rows: list[int] | None = None  # a left-padded batch: each row's first real slot (host ints)


def _is_int8(dtype) -> bool:
    return dtype in ("int8", torch.int8)


def check_kv_dtype(kv_dtype, model_dtype: torch.dtype) -> None:
    """A ValueError unless a model of `model_dtype` can attend over a cache of `kv_dtype`: None
    or the model's own float dtype (attention reads K/V in it), or 'int8' (dequantized to it)."""
    if kv_dtype is not None and not _is_int8(kv_dtype) and kv_dtype != model_dtype:
        raise ValueError(f"kv_dtype (the KV cache's dtype) must be None or {model_dtype} (the "
                         f"model's) or 'int8', got {kv_dtype!r}")


class StaticKVCache:
    """Preallocated per-layer K/V tensors ``[batch, kv_heads, max_len, head_dim]`` written in place:
    a `KVCache` (`pos`, `start`, as it says), whose `lengths` are each row's real tokens and whose
    `rollback` forgets the drafted tokens speculative decoding rejects."""

    def __init__(self, n_layer: int, batch_size: int, n_kv_head: int, head_dim: int,
                 max_len: int, *, dtype: torch.dtype | str = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        for name, value in (("n_layer", n_layer), ("batch_size", batch_size),
                            ("n_kv_head", n_kv_head), ("head_dim", head_dim), ("max_len", max_len)):
            check_int(f"StaticKVCache {name}", value, 1)
        device = device if isinstance(device, torch.device) else as_device(device)
        self.quantized = _is_int8(dtype)
        if self.quantized:  # int8 values + one scale per (row, head, token): K ≈ k_q * k_scale
            dtype = torch.int8
            self._allocate_scales(n_layer, (batch_size, n_kv_head, max_len, 1), device)
        elif not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"StaticKVCache dtype must be a float torch dtype or 'int8', "
                             f"got {dtype!r}")
        shape = (batch_size, n_kv_head, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.batch_size, self.max_len, self.dtype, self.device = batch_size, max_len, dtype, device
        self.n_layer, self.n_kv_head, self.head_dim = n_layer, n_kv_head, head_dim
        self.start = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.pos, self.padded = 0, False  # padded: any row left padded? (on the host: no sync)

    def _allocate_scales(self, n_layer: int, shape: tuple[int, ...], device) -> None:
        self.k_scale = [torch.zeros(shape, dtype=SCALE_DTYPE, device=device) for _ in range(n_layer)]
        self.v_scale = [torch.zeros(shape, dtype=SCALE_DTYPE, device=device) for _ in range(n_layer)]

    @classmethod
    def for_model(cls, model: torch.nn.Module, batch_size: int, max_len: int | None = None, *,
                  dtype: torch.dtype | str | None = None,
                  device: torch.device | str | None = None) -> StaticKVCache:
        """A cache shaped for `model` (its layers, KV heads, head dim; dtype/device of its
        weights). ``dtype="int8"`` stores K/V as int8 with one scale per head per token."""
        cfg = model.config
        max_len = cfg.context_length if max_len is None else max_len
        check_int("max_len", max_len, 1, cfg.context_length, why=" (the model's context)")
        p = next(t for t in model.parameters() if t.is_floating_point())  # not an int8 weight
        return cls(cfg.n_layer, batch_size, cfg.kv_heads, cfg.head_dim, max_len,
                   dtype=dtype or p.dtype, device=p.device if device is None else device)

    def reset(self, start: torch.Tensor | list[int] | None = None) -> None:
        """Empty the cache for a new batch; `start[b]` = number of left-padding slots of row b."""
        self.pos = 0
        start = torch.as_tensor([0] * self.batch_size if start is None else start, dtype=torch.long)
        if start.shape != (self.batch_size,):
            raise ValueError(f"start must have shape ({self.batch_size},), got {tuple(start.shape)}")
        self.padded = bool((start > 0).any())
        self.start.copy_(start)

    def check_room(self, n: int) -> None:
        """Raise a clear error if `n` more slots do not fit."""
        if self.pos + n > self.max_len:
            raise ValueError(f"KV cache full: {self.pos} slots used + {n} new "
                             f"> max_len={self.max_len}")

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new ``k, v`` ``[B, kv_heads, T, head_dim]`` at slots ``pos..pos+T-1`` of `layer`;
        return views of all its cached slots ``0..pos+T-1``. `pos` moves only in `advance`."""
        end = self.pos + k.shape[2]
        if self.quantized:
            return self.write_int8(layer, torch.arange(self.pos, end, device=k.device), k, v, end)
        self.k[layer][:, :, self.pos:end] = k
        self.v[layer][:, :, self.pos:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def write_int8(self, layer: int, slot: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   end: int):
        """Quantize the new tokens (symmetric, per head per token) into the slots in the long
        tensor `slot` ``(T,)``, then dequantize slots ``0..end-1``.

        Attention needs float K/V, so every call rebuilds the cached tokens in float: the int8
        cache saves memory (and, with a fused kernel, bandwidth), not arithmetic."""
        out = []
        for store, scales, new in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            scale = (new.detach().abs().amax(dim=-1, keepdim=True).float() / 127).clamp(min=1e-6)
            scale = scale.to(SCALE_DTYPE)  # round first, so q and the stored scale agree
            q = torch.round(new.float() / scale.float()).clamp(-127, 127)
            store[layer].index_copy_(2, slot, q.to(torch.int8))
            scales[layer].index_copy_(2, slot, scale)
            dtype = new.dtype
            out.append(store[layer][:, :, :end].to(dtype) * scales[layer][:, :, :end].to(dtype))
        return out[0], out[1]

    def advance(self, n: int) -> None:
        self.pos += n

    def rollback(self, n: int) -> None:
        """Forget the last `n` cached slots (their contents are simply overwritten later)."""
        if not 0 <= n <= self.pos:
            raise ValueError(f"rollback n must lie in [0, {self.pos}], got {n}")
        self.pos -= n

    @property
    def lengths(self) -> torch.Tensor:
        """Real (non-padding) tokens cached per row."""
        return (self.pos - self.start).clamp(min=0)

    @property
    def nbytes(self) -> int:
        """Bytes allocated for K and V in all layers (the whole preallocation, used or not)."""
        tensors = self.k + self.v + (self.k_scale + self.v_scale if self.quantized else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one cached token costs across all layers (`minifer.config.kv_token_bytes`; int8:
        plus one 2-byte scale per head for K and for V, a head of one value)."""
        size = kv_token_bytes(self.n_layer, self.n_kv_head, self.head_dim, self.k[0].element_size())
        if self.quantized:
            size += kv_token_bytes(self.n_layer, self.n_kv_head, 1, self.k_scale[0].element_size())
        return int(size)

    def __repr__(self) -> str:
        return (f"StaticKVCache(layers={self.n_layer}, batch={self.batch_size}, "
                f"kv_heads={self.n_kv_head}, max_len={self.max_len}, head_dim={self.head_dim}, "
                f"dtype={self.dtype}, pos={self.pos}, nbytes={self.nbytes:,})")
