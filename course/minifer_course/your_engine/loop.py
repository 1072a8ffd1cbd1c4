"""Lesson 01: the generation loop, by hand: one forward pass over the whole sequence per new
token, greedy, until the token limit or the end-of-text token.

Nothing is kept between steps: every pass starts from a fresh cache, so the whole sequence is
recomputed each time (the cache that makes this cheap is lesson 03's, in `model.py`).
"""

from __future__ import annotations

from .model import Cache, feed


def next_token(model, ids: list[int], vocab_size: int) -> int:
    """One forward pass over the whole sequence; greedy: the last row's argmax."""
    logits = feed(model, ids, Cache(model, len(ids)))  # (T, vocab): a row of scores per position
    return int(logits[-1, :vocab_size].argmax())  # the ids past vocab_size are padding rows


def greedy_loop(model, ids: list[int], max_new_tokens: int, vocab_size: int) -> list[int]:
    seq = list(ids)
    for _ in range(max_new_tokens):
        seq.append(next_token(model, seq, vocab_size))  # one forward pass per new token
    return seq[len(ids):]  # the new tokens only


def generate_until(model, ids: list[int], max_new_tokens: int, vocab_size: int,
                   eos_id: int) -> tuple[list[int], str]:
    """The loop with its two stop conditions: the new tokens, and why it stopped."""
    seq = list(ids)
    while len(seq) - len(ids) < max_new_tokens:
        seq.append(next_token(model, seq, vocab_size))
        if seq[-1] == eos_id:  # the model says it is done
            return seq[len(ids):], "eos"
    return seq[len(ids):], "length"
