"""Where the engine's "same output" guarantees hold, stated as tests.

* fp32: cached == recomputed and batched (left padded) == alone hold to float rounding — logits
  within 1e-5 of each other (different kernel shapes add in different orders, so not always
  bit-identical) — and the greedy tokens are identical.
* bf16 (and fp16): the same computations agree only to the dtype's precision (~1% of the logits'
  scale). Greedy tokens stay identical until two candidates come within that distance of each
  other; after such a near-tie the two paths may pick different tokens and diverge. So the
  token-identity claims (KV-2, batching, SPEC-2) are fp32 claims.
"""

from __future__ import annotations

import pytest
import torch

import minifer as mf
from conftest import lively_model

GREEDY = mf.SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True)
PROMPTS = [[5, 6, 7], list(range(10, 30))]


def _cached_vs_full(model) -> tuple[float, float]:
    """Largest |cached - recomputed| logit over 40 positions, and the logits' scale."""
    ids = torch.randint(0, 257, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        full = model(ids).float()
        cache = mf.StaticKVCache.for_model(model, 2, 64)
        steps = [model(ids[:, :8], cache=cache).float()]
        steps += [model(ids[:, t:t + 1], cache=cache).float() for t in range(8, 40)]
    return (torch.cat(steps, 1) - full).abs().max().item(), full.abs().max().item()


def _batched_vs_alone(model) -> float:
    """Largest |batched - alone| next-token logit of left-padded prompts."""
    with torch.inference_mode():
        T = max(map(len, PROMPTS))
        ids = torch.tensor([[0] * (T - len(p)) + p for p in PROMPTS])
        start = torch.tensor([T - len(p) for p in PROMPTS])
        batched = model(ids, start=start)[:, -1].float()
        alone = torch.stack([model(torch.tensor([p]))[0, -1].float() for p in PROMPTS])
    return (batched - alone).abs().max().item()


def test_fp32_guarantees_hold_to_rounding_and_tokens_are_identical():
    model = lively_model("tiny", seed=0)
    diff, scale = _cached_vs_full(model)
    assert diff <= 1e-5 * max(scale, 1.0)
    assert _batched_vs_alone(model) <= 1e-5 * max(scale, 1.0)
    alone = [mf.generate(model, [p], GREEDY)[0].token_ids for p in PROMPTS]
    assert [c.token_ids for c in mf.generate(model, PROMPTS, GREEDY)] == alone
    assert [mf.generate(model, [p], GREEDY, use_cache=False)[0].token_ids
            for p in PROMPTS] == alone


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_low_precision_agrees_only_to_its_precision(dtype):
    """bf16: the same comparisons hold to ~1% of the logits' scale, not to rounding of fp32;
    token identity is therefore not promised (it holds here, with no near-tie, but a
    different prompt or CPU may diverge)."""
    model = lively_model("tiny", seed=0).to(dtype)
    diff, scale = _cached_vs_full(model)
    assert diff <= 0.05 * scale
    assert _batched_vs_alone(model) <= 0.05 * scale
