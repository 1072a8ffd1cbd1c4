"""The lean decode step: one new token per row, with less work per step than the forward pass,
and in a form that `torch.compile` and CUDA graphs can take.

Reference: the checked forward pass ``model(tokens, cache=cache)`` (`minifer.decode_step` with
the speed-ups off), which checks its input and writes at the Python int ``cache.pos``. The lean
step checks nothing (the request was checked once) and writes at a slot held in a one-element
tensor (`SlotWriter`): inputs whose values change while their shapes do not. Two forms:

- eager (`LeanStep()`, ``generate``'s default): attention reads the filled slots ``0..pos``,
  with no mask unless some row is left padded;
- fixed-shape (``LeanStep(fixed_shape=True)``): attention reads every slot through a mask built
  from the slot tensor, so every shape holds at every step and the step can be compiled
  (`minifer.fast.compiled`) or captured as a CUDA graph."""

from __future__ import annotations

import torch

from ..cache import AttentionInputs, StaticKVCache
from ..model import GPT

__all__ = ["LeanStep", "SlotWriter", "lean_forward", "step_inputs"]


class SlotWriter:
    """A `StaticKVCache` as the layers of one lean step see it: ``update(layer, k, v)`` writes
    the new K/V at the slot in the tensor `slot` and returns the first `kv_len` slots of the
    layer's buffers (None: every slot, the fixed-shape step). `slot` and `slots` (the key slot
    numbers, for the mask) are allocated once per cache, not every step."""

    def __init__(self, cache: StaticKVCache) -> None:
        self.cache = cache
        self.slot = torch.zeros(1, dtype=torch.long, device=cache.start.device)
        self.slots = torch.arange(cache.max_len, device=cache.start.device)  # (max_len,)
        self.kv_len: int | None = None

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k, v`` ``(B, kv_heads, 1, head_dim)`` at `slot` of `layer`; return the
        layer's K/V of slots ``0..kv_len-1`` ``(B, kv_heads, S, head_dim)``."""
        cache, end = self.cache, self.kv_len
        if cache.quantized:
            return cache.write_int8(layer, self.slot, k, v, cache.max_len if end is None else end)
        cache.k[layer].index_copy_(2, self.slot, k)
        cache.v[layer].index_copy_(2, self.slot, v)
        return cache.k[layer][:, :, :end], cache.v[layer][:, :, :end]


def step_inputs(writer: SlotWriter, dtype: torch.dtype) -> AttentionInputs:
    """The layers' inputs for one new token per row, written at ``writer.slot``.

    Row b sees slots ``start[b]..slot``: an additive mask in `dtype` (the model's, converted
    once here rather than in every layer), or none for an eager step without padding, which
    may see every slot it reads."""
    cache, slot = writer.cache, writer.slot
    start = cache.start  # (B,)
    positions = (slot - start)[:, None]  # (B, 1): each row's own position
    mask, rows = None, None
    if writer.kv_len is not None and cache.padded:  # eager: row by row, each as it runs alone
        rows = start.tolist()
    elif writer.kv_len is None:
        slots = writer.slots[:writer.kv_len]  # (S,) the key slots read
        allowed = (slots <= slot) & (slots >= start[:, None])  # (B, S)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=slot.device)
        mask = mask.masked_fill(~allowed, float("-inf"))[:, None, None, :]  # (B, 1, 1, S)
    return AttentionInputs(positions, mask, False, writer, rows=rows)


def lean_forward(model: GPT, tokens: torch.Tensor, writer: SlotWriter) -> torch.Tensor:
    """Logits ``(B, vocab)`` for one new token per row ``(B, 1)``, its K/V written by `writer`.
    Through ``model(...)``, so that forward hooks (tensor parallelism's timers) see the step;
    `minifer.fast.compiled` compiles this function."""
    inputs = step_inputs(writer, model.transformer.wte.weight.dtype)
    return model(tokens, inputs)[:, 0]


class LeanStep:
    """The lean decode step, called as ``step(model, tokens, cache)`` by `minifer.decode_step`:
    checks that the cache has room, runs `forward` with the cache's `SlotWriter` set to
    ``cache.pos``, then advances the cache by one slot."""

    def __init__(self, fixed_shape: bool = False) -> None:
        self.fixed_shape = fixed_shape
        self.writer: SlotWriter | None = None

    def __call__(self, model: GPT, tokens: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        cache.check_room(1)
        if self.writer is None or self.writer.cache is not cache:
            self.writer = SlotWriter(cache)
        self.writer.slot.fill_(cache.pos)
        logits = self.forward(model, tokens, self.writer)  # (B, vocab)
        cache.advance(1)
        return logits

    def forward(self, model: GPT, tokens: torch.Tensor, writer: SlotWriter) -> torch.Tensor:
        """The uncompiled step: over the filled slots, or every slot when `fixed_shape`."""
        writer.kv_len = None if self.fixed_shape else writer.cache.pos + 1
        return lean_forward(model, tokens, writer)
