"""Lesson 10: figure builders and the k / temperature panel, called without a kernel."""

from __future__ import annotations

import pytest

from conftest import lively_model
from minifer import SamplingParams
from minifer.speculative import PromptLookupDrafter, SpecStats, speculative_generate
from minifer_course.bench.spec import SpecPoint, measure
from minifer_course.bench.timing import round_robin
from minifer_course.lessons import speculative as L


@pytest.fixture(scope="module")
def pair():
    return lively_model("tiny", seed=0), lively_model("tiny-gqa", seed=1)


def test_reference_rows_and_stats_row(pair):
    target, draft = pair
    s = speculative_generate(target, draft, [1, 2, 3], SamplingParams(temperature=0, max_new_tokens=20,
                                                                      ignore_eos=True), k=4)[0].stats
    rows = L.reference_rows(s, target.num_params(), draft.num_params())
    assert rows[0]["target passes"] == 21 and rows[0]["accepted"] == 59
    assert rows[1]["tokens"] == 20 and rows[1]["target passes"] == s.target_passes
    row = L.stats_row("x", s)
    assert row["accepted"] <= row["tested"] <= row["proposed"] and 0 <= row["alpha"] <= 1
    assert row["alpha"] == round(row["accepted"] / row["tested"], 3)  # one denominator
    assert f"{s.accepted}/{row['tested']} = {s.alpha:.2f}" in L.alpha_line(s)
    fig = L.accept_hist_figure({"x": s})
    assert list(fig.data[0].y) == s.accept_hist


def test_measure_sweep_and_figures(pair):
    target, draft = pair
    points = L.sweep(target, draft, [1, 2, 3], ks=(1, 3), new_tokens=12, repeats=1)
    assert [p.k for p in points] == [1, 3]
    for p in points:
        assert isinstance(p, SpecPoint) and p.tokens == 12 and p.speedup > 0
        assert p.cost_ratio > 0 and p.expected_speedup > 0
    verify = L.verify_cost(target, [1, 2, 3], ks=(1, 3), repeats=1)
    assert set(verify) == {1, 3} and all(v > 0 for v in verify.values())
    notes = L.sweep_notes(points, verify, size_ratio=23)
    assert notes.startswith("α (accepted ÷ tested): ") and "1/23 ≈ 0.04" in notes
    assert f"at k = 1 and {verify[3]:.2f}× at k = 3" in notes
    fig = L.speedup_figure(points, verify, k_max=6)
    assert len(fig.data[0].y) == 6 and len(fig.data) == 5
    lookup = measure(target, [PromptLookupDrafter()], [1, 2, 1, 2], k=2, new_tokens=8, repeats=1)[0]
    assert lookup.cost_ratio == 0.0 and lookup.stats.draft_passes == 0
    fig = L.acceptance_figure([L.stats_row("a", lookup.stats), L.stats_row("b", points[0].stats)])
    assert list(fig.data[0].x) == ["a", "b"]
    fig = L.acceptance_figure([L.stats_row("loop · lookup", lookup.stats), L.stats_row("loop · draft", points[0].stats)])
    assert list(fig.data[0].x) == ["loop<br>lookup", "loop<br>draft"] and len(set(fig.data[0].marker.color)) == 2


def test_panel_callback(pair):
    target, draft = pair
    ui = L.panel(target, draft, [1, 2, 3], new_tokens=10)
    ui.children[0].value = 3
    ui.children[1].value = 1.0
    fig = ui.result
    # one unit per axis: α (a probability), tokens per target pass (at least 1), speed-up
    assert len(fig.data[0].y) == 1 and 0 <= fig.data[0].y[0] <= 1 and fig.data[1].y[0] >= 1
    assert fig.data[0].x[0] == "k=3, T=1" and fig.data[0].yaxis != fig.data[1].yaxis
    ui.children[1].value = 0.0
    ui.children[1].value = 1.0  # back to a setting already measured: the same run, not a new one
    assert ui.result.layout.title.text == fig.layout.title.text


def test_panel_uses_known_points(pair):
    target, draft = pair
    points = L.sweep(target, draft, [1, 2, 3], ks=(2,), new_tokens=10, repeats=1)
    ui = L.panel(target, draft, [1, 2, 3], new_tokens=10, known=points)
    ui.children[0].value = 2
    p = points[0]
    tested = p.stats.accepted + p.stats.rejections
    assert ui.result.layout.title.text.endswith(f"α = accepted / tested = {p.stats.accepted}/{tested} = {p.alpha:.2f}")


def test_legends_stay_below_the_titles(pair):
    target, draft = pair
    points = L.sweep(target, draft, [1, 2, 3], ks=(1,), new_tokens=8, repeats=1)
    for fig in (L.speedup_figure(points), L.point_figure(points[0])):
        # common.style's one slot: title, then the legend, then the subplot titles and the plot
        h, top = fig.layout.height, fig.layout.margin.t
        title_y, legend_y = (1 - fig.layout.title.y) * h, (1 - fig.layout.legend.y) * h
        assert fig.layout.legend.yref == fig.layout.title.yref == "container"
        assert title_y < legend_y < top and fig.layout.margin.b == 50  # nothing moved below


def test_distribution_check_separates_right_from_wrong_rule():
    t, d = L.toy_pair(vocab=4)
    exact = L.exact_last_token(t, [0, 1], 3)
    assert abs(sum(exact) - 1) <= 0.5e-3 * len(exact)  # each rounded to 3 decimals
    target_only = L.target_counts(t, [0, 1], 3, 300)
    right = L.spec_counts(t, d, [0, 1], 3, 150, k=2)
    wrong = L.spec_counts(t, d, [0, 1], 3, 150, k=2, accept=L.always_accept)
    assert L.tv_distance(exact, target_only) < 0.1 and L.tv_distance(exact, right) < 0.15
    assert L.tv_distance(exact, wrong) > 0.3
    fig = L.distribution_figure(exact, {"target only": target_only, "speculative": right})
    assert len(fig.data) == 3 and list(fig.data[0].y) == exact


def test_round_robin():
    calls = []
    med = round_robin([lambda: calls.append("a"), lambda: calls.append("b")], warmup=1, repeats=2)
    assert calls == ["a", "b"] * 3 and len(med) == 2
    calls.clear()
    round_robin([lambda: calls.append("a"), lambda: calls.append("b")], warmup=0, repeats=2, calls=3)
    assert calls == ["a"] * 3 + ["b"] * 3 + ["a"] * 3 + ["b"] * 3
    with pytest.raises(ValueError):
        round_robin([lambda: None], repeats=0)
    with pytest.raises(ValueError, match="calls"):
        round_robin([lambda: None], calls=0)
    assert SpecStats(k=1).merge(SpecStats(k=1)).prompts == 2


def test_rounds_figure():
    fig = L.rounds_figure([0, 4, 2, 1], k=4)
    accepted, own = fig.data[:2]
    assert list(accepted.y) == [0, 4, 2, 1] and list(own.y) == [1, 1, 1, 1]
    assert "11 tokens from 4 verification passes" in fig.layout.title.text
    assert fig.layout.yaxis.range[1] > 5  # room above the k + 1 line
