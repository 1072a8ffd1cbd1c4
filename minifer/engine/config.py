"""`EngineConfig`: how an `LLMEngine` schedules requests and stores their K/V, in one object."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..checks import check_int, check_number
from ..config import kv_token_bytes
from ..device import as_device, available_memory
from ..speculative import check_draft

__all__ = ["EngineConfig", "POLICIES", "KV_CACHE_FRACTION", "MAX_SPECULATIVE_TOKENS"]

POLICIES = ("static", "continuous")  # the scheduler's (`engine.scheduler`)
KV_CACHE_FRACTION = 0.5  # of the memory available when the engine starts: the pool's default
MAX_SPECULATIVE_TOKENS = 16  # most drafts per request and step (past a few, most are rejected)


@dataclass(frozen=True)
class EngineConfig:
    """An `LLMEngine`'s options (vLLM's engine arguments); `LLMEngine(model, tok, **fields)`
    and `LLMEngine(model, tok, config)` are the same.

    - `policy`: ``"continuous"`` (requests join and leave at every step) or ``"static"``
      (fixed groups run to completion: the baseline).
    - `block_size`, `num_blocks`: the KV pool. Default: room for `max_num_seqs` requests of
      `max_model_len` tokens, within `kv_cache_memory` (bytes, or a fraction of the memory
      available on the pool's device now; default `KV_CACHE_FRACTION`: a 128k-context checkpoint
      still starts on a laptop). A pool too small for one request of a given `max_model_len` is
      an error; by default requests are bounded by the pool instead.
    - `max_model_len`: most tokens (prompt + output) of a request (default, most: the context).
    - `max_num_seqs`: most requests running at once; `max_num_batched_tokens`: most tokens fed
      in one step (default: the context length, or 256 with chunked prefill).
    - `enable_chunked_prefill`: split long prompts across steps, beside other requests' decode.
    - `enable_prefix_caching`: share full blocks with equal contents (a common system prompt).
    - `device`: the pool's (default: the model's); `aging`: priority per step waited (0: none).
    - `sample_vocab`: sample only among the first `sample_vocab` token ids (default: the
      tokenizer's vocabulary, else the model's).
    - `batch_invariant`: each request's tokens exactly as `generate` gives them alone, whatever
      else shares its steps (`minifer.fast.invariant`: slower; keep torch's thread count fixed).
    - `draft_model`, `num_speculative_tokens`: speculative decoding (`engine.speculative`): that
      many drafts (default 4, 1 to 16) per decoding request and step; their K/V count in the pool."""

    policy: str = "continuous"
    block_size: int = 16
    num_blocks: int | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = False
    enable_prefix_caching: bool = False
    device: str | None = None
    aging: float = 0.0
    sample_vocab: int | None = None
    max_model_len: int | None = None
    kv_cache_memory: int | float | None = None
    batch_invariant: bool = False
    draft_model: torch.nn.Module | None = None
    num_speculative_tokens: int | None = None

    def resolved(self, model: torch.nn.Module) -> EngineConfig:
        """Every field checked against `model` and the defaults filled in, before any allocation."""
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        ctx, model_device = model.config.context_length, next(model.parameters()).device
        check_int("block_size", self.block_size, 1, ctx,
                  why=" (tokens per KV block, at most the model's context)")
        check_int("max_num_seqs", self.max_num_seqs, 1)
        spec = self.draft_model is not None or self.num_speculative_tokens is not None
        k, ctx = self._speculation(model, ctx) if spec else (None, ctx)
        if self.max_model_len is not None:
            ctx = check_int("max_model_len", self.max_model_len, 1, ctx,
                            why=" (tokens one request may hold, at most the model's context and a draft's)")
        device = model_device if self.device is None else _model_device(self.device, model_device)
        num_blocks, ctx = (self._pool_blocks(model, ctx, device) if self.num_blocks is None
                           else (self.num_blocks, ctx))
        check_int("num_blocks", num_blocks, 1)
        budget = self.max_num_batched_tokens if self.max_num_batched_tokens is not None else (
            min(256, ctx) if self.enable_chunked_prefill else ctx)
        check_int("max_num_batched_tokens", budget, 1)
        check_number("aging", self.aging, ge=0,
                     why=" (priority points per step waited; 0 = strict priority)")
        if self.sample_vocab is not None:
            check_int("sample_vocab", self.sample_vocab, 1, model.config.vocab_size)
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant must be True or False, got {self.batch_invariant!r}")
        return dataclasses.replace(self, num_blocks=num_blocks, max_num_batched_tokens=budget, device=str(device),
                                   aging=float(self.aging), max_model_len=ctx, num_speculative_tokens=k)

    def _speculation(self, model: torch.nn.Module, ctx: int) -> tuple[int, int]:
        """(num_speculative_tokens, the context a request must fit: the draft's too), checked."""
        draft, k = self.draft_model, self.num_speculative_tokens
        if draft is None:
            raise ValueError("num_speculative_tokens needs a draft_model to draft them")
        check_draft(draft, model, "draft_model")
        k = check_int("num_speculative_tokens", 4 if k is None else k, 1, MAX_SPECULATIVE_TOKENS,
                      why=" (tokens drafted per request and step)")
        return k, min(ctx, draft.config.context_length)

    def _pool_blocks(self, model: torch.nn.Module, max_len: int, device) -> tuple[int, int]:
        """Blocks for `max_num_seqs` requests of `max_len` tokens or what the budget holds."""
        memory = KV_CACHE_FRACTION if self.kv_cache_memory is None else self.kv_cache_memory
        if isinstance(memory, float):  # a fraction of what is free now
            memory = int(check_number("kv_cache_memory", memory, gt=0, le=1) * available_memory(device))
        check_int("kv_cache_memory", memory, 1, why=" (bytes, or a fraction in (0, 1])")
        cfgs = [(m.config, next(t for t in m.parameters() if t.is_floating_point())) for m in (model, self.draft_model) if m is not None]
        fits = memory // int(sum(kv_token_bytes(c.n_layer, c.kv_heads, c.head_dim, p.element_size()) for c, p in cfgs) * self.block_size)
        if fits < 1 or (fits * self.block_size < max_len and self.max_model_len is not None):
            raise ValueError(f"kv_cache_memory={memory:,} bytes holds {fits * self.block_size:,} tokens, fewer than "
                             f"one request of max_model_len={max_len:,}: raise --kv-cache-memory or lower --max-model-len")
        blocks = min(self.max_num_seqs * -(-max_len // self.block_size), fits)
        return blocks, min(max_len, blocks * self.block_size)


def _model_device(device: str, model_device: torch.device) -> torch.device:
    """`device`, checked to exist and to be where the model is (``"cuda"`` for ``cuda:0``)."""
    dev = as_device(device)
    if dev != model_device and not (dev.type == model_device.type and dev.index is None):
        raise ValueError(f"device={device!r} but the model is on {model_device}; move "
                         f"the model first (model.to(device)) or leave device=None")
    return dev
