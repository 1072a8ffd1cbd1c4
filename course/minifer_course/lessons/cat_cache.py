"""The claims' reference run grew its KV cache with ``torch.cat``: a baseline to time beside
minifer's preallocated cache (lessons 02 and 07, Claims PD-3 and BATCH-1).

At every decode step ``torch.cat([k_cached, k_new], dim=2)`` allocates a new tensor and copies
every cached key (and value) of every layer into it: with S tokens cached a step copies
2 × layers × batch × S × C × 4 bytes on top of reading the weights. `CatKVCache` keeps
`minifer.cache.KVCache`'s contract, so the same `GPT.forward` runs over either cache and only
the cache differs.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from minifer import hooks
from minifer.cache import StaticKVCache
from minifer.generation import decode_step, prefill


class CatKVCache:
    """K/V per layer, grown by concatenation (a new tensor at every step)."""

    padded = False

    def __init__(self, n_layer: int, batch_size: int, max_len: int) -> None:
        self.batch_size, self.max_len, self.pos = batch_size, max_len, 0
        self.start = torch.zeros(batch_size, dtype=torch.long)
        self.k: list[torch.Tensor | None] = [None] * n_layer
        self.v: list[torch.Tensor | None] = [None] * n_layer

    @classmethod
    def for_model(cls, model: torch.nn.Module, batch_size: int, max_len: int) -> CatKVCache:
        return cls(model.config.n_layer, batch_size, max_len)

    def check_room(self, n: int) -> None:
        if self.pos + n > self.max_len:
            raise ValueError(f"{n} more tokens do not fit: {self.pos} of {self.max_len} used")

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        if self.k[layer] is None:
            self.k[layer], self.v[layer] = k, v
        else:  # the source's step: a new tensor, every cached value copied into it
            self.k[layer] = torch.cat([self.k[layer], k], dim=2)  # (B, nkv, S, hd)
            self.v[layer] = torch.cat([self.v[layer], v], dim=2)
        return self.k[layer], self.v[layer]

    def advance(self, n: int) -> None:
        self.pos += n


@dataclass(frozen=True)
class CacheTiming:
    """Median ms of one decode step at `context` cached tokens, per cache."""

    batch: int
    context: int
    static_ms: float  # minifer: preallocated, written in place (`decode_step`)
    static_forward_ms: float  # the same cache through the plain `model(ids, cache=...)` call
    cat_ms: float  # the source's torch.cat cache, through that same plain call

    @property
    def cat_vs_static(self) -> float:
        """The cat cache's step over the in-place cache's, through the same forward call."""
        return self.cat_ms / self.static_forward_ms

    @property
    def copied_mb(self) -> float:
        """What one cat step copies (K and V of every layer, fp32), in MB."""
        return self.copy_bytes / 1e6

    copy_bytes: int = 0


@torch.inference_mode()
def time_cat_vs_static(model: torch.nn.Module, batch: int = 1, context: int = 512, *,
                       steps: int = 8, rounds: int = 2, seed: int = 0) -> CacheTiming:
    """One decode step at `context` cached tokens with minifer's cache and with a cat cache,
    timed turn about (`rounds` × `steps` steps each, the median kept) after the same prefill."""
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    prompt = torch.randint(0, cfg.vocab_size, (1, context), generator=gen).to(device)
    token = torch.zeros(batch, dtype=torch.long, device=device)
    times: dict[str, list[float]] = {"static": [], "forward": [], "cat": []}
    # one prefill, its K/V copied into every row (a step's cost does not depend on what is cached)
    one = StaticKVCache.for_model(model, batch_size=1, max_len=context)
    prefill(model, prompt, one)
    filled = [(one.k[i][:, :, :context], one.v[i][:, :, :context]) for i in range(cfg.n_layer)]

    def run(kind: str) -> None:
        if kind == "cat":
            cache = CatKVCache.for_model(model, batch, context + steps)
            cache.k = [k.repeat(batch, 1, 1, 1) for k, _ in filled]
            cache.v = [v.repeat(batch, 1, 1, 1) for _, v in filled]
        else:
            cache = StaticKVCache.for_model(model, batch_size=batch, max_len=context + steps)
            for i, (k, v) in enumerate(filled):
                cache.k[i][:, :, :context] = k
                cache.v[i][:, :, :context] = v
        cache.advance(context)
        step = hooks.decode_function(model, cache, False)  # the step `generate` runs
        for _ in range(steps):
            t0 = time.perf_counter()
            if kind == "static":
                out = decode_step(model, token, cache, step=step)
            else:
                out = model(token.view(-1, 1), cache=cache)
            out.sum().item()  # wait for the device
            times[kind].append(time.perf_counter() - t0)

    for kind in times:  # warm-up
        run(kind)
        times[kind].clear()
    for _ in range(rounds):
        for kind in times:
            run(kind)
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    copy = 2 * cfg.n_layer * batch * context * cfg.kv_heads * cfg.head_dim * 4
    return CacheTiming(batch, context, ms["static"], ms["forward"], ms["cat"], copy)
