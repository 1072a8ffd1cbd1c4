"""Lesson 06: choosing the next token. The processors in minifer's order (repetition penalty,
temperature, top-k, top-p), then one draw by inverse CDF from the request's own generator:
the same seed gives the same tokens, alone or in a batch.
"""

from __future__ import annotations

import torch


def temperature(logits, T):
    """Divide the logits by T: below 1 their differences grow, above 1 they shrink."""
    return logits / T


def top_k(logits, k):
    """Keep the k largest logits (ties with the k-th are kept too); -inf for the rest."""
    kth = logits.topk(k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p(logits, p):
    """Keep the most likely tokens until their probability reaches p (at least one)."""
    ranked = logits.sort(descending=True).values
    probs = ranked.softmax(-1)
    before = probs.cumsum(-1) - probs
    n_keep = max(int((before < p).sum()), 1)
    return logits.masked_fill(logits < ranked[n_keep - 1], float("-inf"))  # ties with the last kept stay


def penalize(logits, seen, penalty):
    """CTRL's penalty: a seen token's logit is divided by the penalty (multiplied, if negative)."""
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


def my_sampler(logits, seen, T=1.0, k=0, p=1.0, penalty=1.0):
    x = penalize(logits, seen, penalty) if penalty != 1.0 else logits
    x = temperature(x, T)
    x = top_k(x, k) if 0 < k < len(x) else x
    return top_p(x, p) if p < 1.0 else x


def draw(probs, generator):
    cdf = probs.double().cumsum(-1)
    u = torch.rand(1, generator=generator, dtype=torch.float64)
    return int(torch.searchsorted(cdf, u * cdf[-1], right=True).clamp(max=len(probs) - 1))


def pick(logits, params, seen, generator) -> int:
    """One token from next-token logits ``(vocab,)`` for a request's `params` (minifer's
    `SamplingParams`): greedy at temperature 0, else a draw from the processed distribution."""
    x = my_sampler(logits.float(), seen, params.temperature or 1.0, params.top_k, params.top_p,
                   params.repetition_penalty)
    return int(x.argmax()) if params.temperature == 0 else draw(x.softmax(-1), generator)
