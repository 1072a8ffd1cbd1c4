"""Lessons 01 and 03: the figure builders and slider callbacks, called without a kernel."""

from __future__ import annotations

import pytest
import torch

import minifer as mf
from minifer_course.lessons import generation as gen
from minifer_course.lessons import kv_cache as kv
from minifer_course.lessons.common import table


def test_trace_loop_matches_generate(tiny, tok):
    trace = gen.trace_loop(tiny, tok, "abc", steps=6)
    out = mf.generate(tiny, "abc", mf.SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True), tok)[0]
    assert [s.token_id for s in trace] == out.token_ids
    assert [s.phase for s in trace] == ["prefill"] + ["decode"] * 5
    assert [s.cache_slots for s in trace] == [3, 4, 5, 6, 7, 8]
    assert [s.tokens_in for s in trace] == [3, 1, 1, 1, 1, 1]


def test_top_tokens_and_figure(tiny, tok):
    logits = torch.randn(tok.vocab_size, generator=torch.Generator().manual_seed(0))
    rows = gen.top_tokens(logits, tok, k=5)
    probs = [r["prob"] for r in rows]
    assert probs == sorted(probs, reverse=True) and len(rows) == 5
    assert rows[0]["id"] == int(logits.argmax())
    fig = gen.next_token_figure(logits, tok, k=7)
    assert len(fig.data[0].y) == 7 and abs(fig.data[0].y[0] - probs[0]) < 1e-9


def test_forward_passes_equal_new_tokens(tiny):
    for n in (1, 5, 17):
        assert gen.passes_for(tiny, [1, 2, 3], n) == n


def test_pass_counter_counts_tokens(tiny):
    with gen.count_forward_passes(tiny) as c:
        mf.generate(tiny, [[1, 2, 3, 4]], mf.SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True))
    assert (c.passes, c.tokens) == (3, 4 + 1 + 1)


def test_generation_panel_drives_timeline(tiny):
    ui = gen.panel(tiny, [1, 2, 3], max_tokens=20)
    assert len(ui.result.data[0].y) == 16
    end = ui.result.layout.xaxis.range[1]
    ui.children[0].value = 6
    arrivals = ui.result.data[0]
    assert list(arrivals.y) == [1, 2, 3, 4, 5, 6]  # tokens received, one per arrival
    assert list(arrivals.x) == sorted(arrivals.x) and arrivals.x[0] > 0
    assert ui.result.layout.xaxis.range == (0, end)  # one time scale for every slider value


def test_timeline_starts_at_zero_and_marks_the_ttft():
    c = mf.Completion(index=0, prompt_token_ids=[1] * 5, token_ids=[7, 8, 9],
                      token_times=[0.5, 0.6, 0.7])
    fig = gen.timeline_figure(c)
    assert fig.layout.xaxis.range[0] == 0 and fig.layout.yaxis.range[0] == 0
    line = next(s for s in fig.layout.shapes if s.type == "line")
    assert line.x0 == line.x1 == 500.0 and line.line.width > 0  # the TTFT, drawn
    assert "TTFT 500.0 ms" in fig.layout.annotations[0].text
    steps = fig.data[1]
    assert steps.x[:2] == (0.0, 500.0) and steps.y[:2] == (0, 1)  # nothing until the TTFT
    first = gen.first_tokens(c, 2)
    assert first.token_times == [0.5, 0.6] and first.completion_tokens == 2
    with pytest.raises(ValueError, match="n must be"):
        gen.first_tokens(c, 4)


def test_token_labels_are_readable(tok):
    assert gen.show_token(tok, 10) == "⏎" and gen.show_token(tok, 32) == "␣"
    assert gen.show_token(tok, 255) == "<0xFF>" and gen.show_token(tok, 19) == "<0x13>"
    assert gen.show_token(tok, 69) == "E"
    rows = gen.top_tokens(torch.arange(tok.vocab_size, dtype=torch.float), tok, k=2)
    assert [r["token"] for r in rows] == ["<|endoftext|>", "<0xFF>"]


def test_keys_never_change(tiny):
    check = kv.keys_never_change(tiny, [5, 6, 7, 8], steps=5)
    assert check["old_slots_unchanged"] and check["max_abs_diff_vs_recompute"] < 1e-5


def test_tokens_processed_linear_vs_quadratic():
    assert kv.tokens_processed(4, 3, use_cache=True) == [4, 1, 1]
    assert kv.tokens_processed(4, 3, use_cache=False) == [4, 5, 6]
    fig = kv.work_figure(10, 20)
    recompute, cached = fig.data
    assert cached.y[-1] == 10 + 19 and recompute.y[-1] == 20 * 10 + 20 * 19 // 2


def test_compare_uses_prefix_of_the_run():
    cached, recompute = [9.0] + [1.0] * 10, [9.0] + [float(i) for i in range(2, 12)]
    row = kv.compare(cached, recompute, 4)
    assert row["cache ms/token"] == 1.0 and row["no-cache ms/token"] == 3.0 and row["ratio"] == 3.0
    # the source's way: the whole call (prefill included) over its new tokens
    whole = kv.compare(cached, recompute, 4, whole_call=True)
    assert whole["cache ms/token"] == (9 + 3) / 4 and whole["no-cache ms/token"] == (9 + 2 + 3 + 4) / 4


def test_step_times_pair_best_of_rounds(tiny):
    cached, recompute = kv.step_times_pair(tiny, [1, 2, 3], 4, repeats=2, best=True)
    assert len(cached) == len(recompute) == 4 and all(t > 0 for t in cached + recompute)
    with pytest.raises(ValueError, match="repeats"):
        kv.step_times_pair(tiny, [1, 2, 3], 4, repeats=0)


def test_kv_panel_measures_once_then_redraws(tiny):
    measured = kv.measure_contexts(tiny, contexts=(8, 32), new_tokens=4)
    assert sorted(measured) == [8, 32]
    assert all(len(c) == len(r) == 4 for c, r in measured.values())
    ui = kv.panel(measured)
    top = ui.result.layout.yaxis.range
    ui.children[0].value = 32
    no_cache, cached = ui.result.data
    assert len(no_cache.y) == len(cached.y) == 3
    assert "prompt of 32 tokens" in ui.result.layout.title.text
    assert ui.result.layout.yaxis.range == top and top[0] == 0  # one scale for every context
    with pytest.raises(ValueError, match="contexts"):
        kv.measure_contexts(tiny, contexts=(200,), new_tokens=4)
    with pytest.raises(ValueError, match="measured"):
        kv.panel({})


def test_table_formats():
    text = table([{"a": 1234, "b": 0.5, "c": "x"}])
    assert text.splitlines() == ["    a     b  c", "1,234  0.50  x"]


def test_step_probs_figure_draws_each_step_of_the_loop():
    rows = [{"step": 0, "token": "E", "prob": 0.013, "eos prob": 0.002},
            {"step": 1, "token": "(", "prob": 0.011, "eos prob": 0.003}]
    fig = gen.step_probs_figure(rows, 257)
    bars, eos = fig.data
    assert list(bars.x) == ["0: E", "1: ("] and list(bars.y) == [0.013, 0.011]
    assert list(eos.y) == [0.002, 0.003]
    line = next(s for s in fig.layout.shapes if s.type == "line")
    assert line.y0 == line.y1 == 1 / 257  # an even spread, for comparison
    assert fig.layout.yaxis.range[0] == 0 and fig.layout.yaxis.range[1] > 0.013
    with pytest.raises(ValueError, match="at least one step"):
        gen.step_probs_figure([], 257)
