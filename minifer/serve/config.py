"""`EngineConfig`: how an `LLMEngine` schedules requests and stores their K/V, in one object."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..checks import check_int, check_number
from .kv_pool import check_read

__all__ = ["EngineConfig", "POLICIES"]

POLICIES = ("static", "continuous")  # the scheduler's (`serve.scheduler`)


@dataclass(frozen=True)
class EngineConfig:
    """An `LLMEngine`'s options (vLLM's engine arguments); `LLMEngine(model, tok, **fields)`
    and `LLMEngine(model, tok, config)` are the same.

    - `policy`: ``"continuous"`` (requests join and leave at every step) or ``"static"``
      (fixed groups run to completion: the baseline).
    - `block_size`, `num_blocks`: the KV pool (default: room for `max_num_seqs` full contexts).
    - `max_num_seqs`: most requests running at once; `max_num_batched_tokens`: most tokens fed
      in one step (default: the context length, or 256 with chunked prefill).
    - `enable_chunked_prefill`: split long prompts across steps, beside other requests' decode.
    - `enable_prefix_caching`: share full blocks with equal contents (a common system prompt).
    - `device`: where the pool lives (default: the model's device).
    - `aging`: priority points a waiting request gains per step (0 = strict priority).
    - `sample_vocab`: sample only among the first `sample_vocab` token ids (default: the
      tokenizer's vocabulary, else the model's); a worker without the tokenizer gets its size.
    - `kv_read`: how attention reads the pool (`kv_pool.READS`): ``"blocks"`` (whole blocks by
      the block table), ``"slots"`` (the readable reference) or ``"kernel"`` (decode rows
      through a paged-attention kernel built for this machine on first use). The first and
      last are `minifer.fast.paged`'s: with the speed-ups off every read is the reference.
    - `batch_invariant`: each request's tokens exactly as `generate` gives them alone, whatever
      else shares its steps (`minifer.fast.invariant`: slower; keep torch's thread count fixed).
    """

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
    kv_read: str = "blocks"
    batch_invariant: bool = False

    def resolved(self, model: torch.nn.Module) -> EngineConfig:
        """Every field checked against `model` (ValueErrors name the field and its range) and
        the defaults filled in, before anything is allocated."""
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        cfg, model_device = model.config, next(model.parameters()).device
        ctx = cfg.context_length
        check_int("block_size", self.block_size, 1, ctx,
                  why=" (tokens per KV block, at most the model's context)")
        check_int("max_num_seqs", self.max_num_seqs, 1)
        num_blocks = self.num_blocks
        if num_blocks is None:
            num_blocks = self.max_num_seqs * -(-ctx // self.block_size)
        check_int("num_blocks", num_blocks, 1)
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = min(256, ctx) if self.enable_chunked_prefill else ctx
        check_int("max_num_batched_tokens", budget, 1)
        check_number("aging", self.aging, ge=0,
                     why=" (priority points per step waited; 0 = strict priority)")
        if self.sample_vocab is not None:
            check_int("sample_vocab", self.sample_vocab, 1, cfg.vocab_size)
        check_read(self.kv_read)
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant must be True or False, got {self.batch_invariant!r}")
        device = model_device if self.device is None else _model_device(self.device, model_device)
        return dataclasses.replace(self, num_blocks=num_blocks, max_num_batched_tokens=budget,
                                   device=str(device), aging=float(self.aging))


def _model_device(device: str, model_device: torch.device) -> torch.device:
    """`device`, checked to exist and to be where the model is (``"cuda"`` for ``cuda:0``)."""
    from ..device import as_device

    dev = as_device(device)
    if dev != model_device and not (dev.type == model_device.type and dev.index is None):
        raise ValueError(f"device={device!r} but the model is on {model_device}; move "
                         f"the model first (model.to(device)) or leave device=None")
    return dev
