"""Lesson 06: the distribution reshaper and its sliders, called without a kernel."""

from __future__ import annotations

import pytest
import torch

from minifer_course.lessons import sampling as S

LOGITS = torch.randn(257, generator=torch.Generator().manual_seed(3)) * 3


def test_reshape_defaults_leave_distribution_alone():
    d = S.reshape(LOGITS)
    assert torch.allclose(d.after, d.before) and d.n_kept == 257


@pytest.mark.parametrize("k", [1, 2, 10, 100])
def test_top_k_keeps_exactly_k(k):
    assert S.reshape(LOGITS, top_k=k).n_kept == k


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 0.99])
def test_top_p_keeps_smallest_set_reaching_p(p):
    n = S.reshape(LOGITS, top_p=p).n_kept
    mass = LOGITS.softmax(-1).sort(descending=True).values.cumsum(0)
    assert mass[n - 1] >= p - 1e-6 and (n == 1 or mass[n - 2] < p)


def test_greedy_is_one_hot_at_argmax():
    d = S.reshape(LOGITS, temperature=0)
    assert d.n_kept == 1 and int(d.after.argmax()) == int(LOGITS.argmax())


def test_penalty_lowers_seen_tokens():
    seen = torch.zeros(257, dtype=torch.bool)
    seen[:20] = True
    before, after = S.reshape(LOGITS, seen).after, S.reshape(LOGITS, seen, repetition_penalty=2.0).after
    assert (after[:20] < before[:20]).all() and (after[20:] > before[20:]).all()


def test_next_token_logits_marks_prompt_tokens(tiny, tok):
    logits, seen = S.next_token_logits(tiny, tok, "aab")
    assert logits.shape == (257,) and seen.sum() == 2 and seen[ord("a")] and seen[ord("b")]


def test_tokens_are_shown_with_the_course_labels(tok):
    from minifer.tokenizer import ByteTokenizer

    bt = ByteTokenizer()
    ids = (10, 32, 9, 7, 0xFF, ord("a"))
    logits = torch.full((256,), -10.0)
    logits[list(ids)] = torch.tensor([6.0, 5.0, 4.0, 3.0, 2.0, 1.0])
    shown = [r["token"] for r in S.top_tokens(logits, bt, k=len(ids))]
    assert shown == ["⏎", "␣", "⇥", "<0x07>", "<0xFF>", "a"]  # common.token_label's glyphs
    rows = S.top_tokens(LOGITS, tok, k=3)
    assert [r["rank"] for r in rows] == [1, 2, 3] and all("\\" not in r["token"] for r in rows)


def test_figure_and_panel(tok):
    fig = S.distribution_figure(LOGITS, tok, top_k=5, show=10)
    before, after = fig.data[:2]
    assert len(before.y) == len(after.y) == 10
    assert sum(1 for y in after.y if y > 0) == 5
    # the 5 cut tokens keep their bar, drawn in red, at the model's probability
    assert list(before.marker.color).count(S.CUT_COLOR) == 5 and all(y > 0 for y in before.y)
    assert len(set(before.x)) == 10  # one bar per token, even if two tokens look alike
    # a cut beyond the shown tokens (top-p keeps most of them): the figure shows where it falls
    kept = S.reshape(LOGITS, top_p=0.9).n_kept
    assert 10 < kept < 257
    fig = S.distribution_figure(LOGITS, tok, top_p=0.9, show=10)
    before = fig.data[0]
    assert S.GAP in before.x and list(before.marker.color).count(S.CUT_COLOR) >= 1
    assert f"ranks {kept - 2}–{kept + 3}" in fig.layout.xaxis.title.text
    assert fig.layout.title.text.endswith(f"{kept} of 257 tokens can be drawn")
    ui = S.panel(LOGITS, tok)
    assert ui.result.layout.title.text.endswith("257 of 257 tokens can be drawn")
    ui.children[1].value = 4
    assert ui.result.layout.title.text.endswith("4 of 257 tokens can be drawn")


def test_continuations_seeded(tiny, tok):
    a = S.continuations(tiny, tok, "ab", (0, 1.0), max_new_tokens=8, seed=1)
    b = S.continuations(tiny, tok, "ab", (0, 1.0), max_new_tokens=8, seed=1)
    assert a == b and [r["temperature"] for r in a] == [0, 1.0]


def test_temperature_figure(tok):
    fig = S.temperature_figure(LOGITS, tok, (0.5, 1.0, 2.0), show=8)
    assert [len(t.y) for t in fig.data] == [8, 8, 8]
    assert fig.data[0].y[0] > fig.data[1].y[0] > fig.data[2].y[0]  # T < 1 sharpens the top token
    assert fig.data[0].name.startswith("T=0.5 (these 8 hold")


def test_cumulative_figure_marks_the_top_p_cut():
    fig = S.cumulative_figure(LOGITS, (0.5, 0.9))
    curve, *cuts = fig.data
    assert curve.x[-1] == 257 and abs(curve.y[-1] - 1) < 1e-3
    for p, trace in zip((0.5, 0.9), cuts):
        assert trace.x[0] == S.reshape(LOGITS, top_p=p).n_kept
        assert trace.name == f"top-p={p:g}: keeps {trace.x[0]}"


def test_steps_figure():
    fig = S.steps_figure([3, 1, 40], [0.5, 1.0, 0.02], ["a", "b", "c"])
    assert list(fig.data[0].y) == [3, 1, 40] and list(fig.data[1].x) == [1, 2, 3]
    assert "1–40 tokens left" in fig.layout.title.text
