"""Batched == alone: what holds by default, and what ``batch_invariant=True`` adds.

By default a left-padded batch attends row by row over each row's own slots (the call the row
makes alone), so a row computes what it computes alone except for matrix products of other
shapes: with W8A8 (int8), whose integer sums are exact, the shipped model's tokens are the
same batched as alone. With ``batch_invariant=True`` (`minifer.fast.invariant`) every product
has a fixed shape and attention runs one query at a time, so batched == alone == recomputed in
every precision (property tests on random prompt mixes: the shipped model and a tiny Llama).
"""

from __future__ import annotations

import pytest

import minifer as mf

FIVE = ["ROMEO:\n", "First Citizen:\nBefore we proceed any further, hear me speak.\n",
        "KING HENRY:\n", "To be, or not", "JULIET:\nO"]


@pytest.fixture(scope="module")
def shipped():
    return mf.load_pretrained("shakespeare")


def test_int8_batched_equals_alone_by_default(shipped):
    """The issue's case: W8A8 on the shipped model, five prompts, 64 greedy tokens."""
    model, tok = shipped
    q = mf.quantize(model, "int8")
    greedy = mf.SamplingParams(temperature=0, max_new_tokens=64)
    batched = [c.token_ids for c in mf.generate(q, FIVE, greedy, tok)]
    assert batched == [mf.generate(q, [p], greedy, tok)[0].token_ids for p in FIVE]
