"""Lesson 10: speculative decoding. A small draft model proposes k tokens, the target checks
them in one pass, keeps the agreeing prefix and adds one token of its own; both caches roll back
the rest. Greedy: exactly the target's own tokens, in fewer target passes.

`my_speculative` is the loop for one request over lesson 03's caches; the engine (`engine.py`)
runs the same three steps for many requests at once over its paged pools.
"""

from __future__ import annotations

from .model import Cache, feed, prefill


def propose(draft, d_cache: Cache, new: list[int], k: int, vocab: int) -> list[int]:
    """k greedy draft tokens; `new`: the tokens the draft's cache does not hold yet."""
    out = []
    for _ in range(k):
        out.append(int(feed(draft, new, d_cache)[-1, :vocab].argmax()))  # one cheap step
        new = [out[-1]]
    return out


def greedy_verify(proposal: list[int], choice: list[int]) -> tuple[int, list[int]]:
    """Keep the drafts the target agrees with, then add the target's own next token."""
    accepted = 0
    while accepted < len(proposal) and proposal[accepted] == choice[accepted]:
        accepted += 1
    return accepted, proposal[:accepted] + [choice[accepted]]


def my_speculative(target, draft, ids: list[int], k: int, max_new: int, vocab: int):
    """Greedy speculative decoding of one prompt: its tokens, the target passes, and the
    drafts accepted in each round."""
    t_cache, d_cache = (Cache(m, len(ids) + max_new) for m in (target, draft))
    out = [int(prefill(target, ids, t_cache)[:vocab].argmax())]
    prefill(draft, ids, d_cache)  # the draft's logits are not needed
    fed, passes, rounds = len(ids), 1, []  # fed: tokens of the sequence in the draft's cache
    while len(out) < max_new:
        seq, kk = ids + out, min(k, max_new - len(out) - 1)
        proposal = propose(draft, d_cache, seq[fed:], kk, vocab) if kk else []
        logits = feed(target, [seq[-1], *proposal], t_cache)  # one pass: (kk + 1, V)
        accepted, kept = greedy_verify(proposal, logits[:, :vocab].argmax(-1).tolist())
        t_cache.rollback(len(proposal) - accepted)
        if kk:  # the draft's cache: seq, then d1..d(kk-1); keep the accepted ones
            fed = len(seq) + min(accepted, kk - 1)
            d_cache.rollback(kk - 1 - min(accepted, kk - 1))
        out, passes, rounds = out + kept, passes + 1, rounds + [accepted]
    return out[:max_new], passes, rounds
