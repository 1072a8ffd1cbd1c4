"""Lesson 02 (prefill vs decode) and `python -m minifer_course.bench decode`: tiny models, no timing
asserts beyond "a positive number came back"."""

from __future__ import annotations

import math

import pytest
import torch

import minifer as mf
from minifer.cache import AttentionInputs
from minifer_course.bench import decode as bench_decode
from minifer_course.bench.__main__ import COMMANDS
from minifer_course.bench.__main__ import main as bench_main
from minifer_course.lessons import prefill_decode as PD


@pytest.fixture(scope="module")
def tiny():
    return mf.GPT.from_config("tiny", seed=0)


# A hand-made sweep: prefill 10 ms per 100 tokens (+2 ms), decode 5 ms (+1 ms per 1,000 cached).
LENGTHS = (16, 64, 512)
SWEEP = PD.Sweep(LENGTHS, tuple(0.002 + t * 1e-4 for t in LENGTHS),
                 tuple(0.005 + t * 1e-6 for t in LENGTHS), threads=1)


# ---------------------------------------------------------------- bench_decode

def test_random_ids_are_seeded_and_in_range():
    a = bench_decode.random_ids(2, 5, 7, seed=3)
    assert a.shape == (2, 5) and a.dtype == torch.long
    assert torch.equal(a, bench_decode.random_ids(2, 5, 7, seed=3))
    assert int(a.min()) >= 0 and int(a.max()) < 7


def test_time_prefill_and_generation_return_timings(tiny):
    t = bench_decode.time_prefill(tiny, 8, batch=2, warmup=0, repeats=2)
    assert t.repeats == 2 and t.median_s > 0
    for use_cache in (True, False):
        g = bench_decode.time_generation(tiny, 4, 3, use_cache=use_cache, warmup=1, repeats=1)
        assert g.repeats == 1 and g.median_s > 0


def test_time_decode_step_keeps_the_context_fixed(tiny):
    seen = []

    def hook(module, args, kwargs):
        cache = args[1] if len(args) > 1 else kwargs["cache"]
        if isinstance(cache, AttentionInputs):  # the lean decode step: its slot is in a tensor
            seen.append((args[0].shape, int(cache.cache.slot)))
        else:
            seen.append((args[0].shape, cache.pos))

    handle = tiny.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        t = bench_decode.time_decode_step(tiny, batch=3, context=5, warmup=1, repeats=4)
    finally:
        handle.remove()
    assert t.repeats == 4 and t.median_s > 0
    assert seen[0] == (torch.Size([1, 5]), 0)  # one prefill of the context, copied to every row
    assert seen[1:] == [(torch.Size([3, 1]), 5)] * 5  # every step sees exactly 5 cached tokens


@pytest.mark.parametrize("call, word", [
    (lambda m: bench_decode.time_prefill(m, 0), "prompt_tokens"),
    (lambda m: bench_decode.time_prefill(m, 129), "prompt_tokens"),
    (lambda m: bench_decode.time_decode_step(m, context=128), "context"),
    (lambda m: bench_decode.time_generation(m, 100, 29), "new_tokens"),
])
def test_lengths_beyond_the_context_are_clear_errors(tiny, call, word):
    with pytest.raises(ValueError, match=word):
        call(tiny)


def test_run_and_report_on_tiny():
    r = bench_decode.run("tiny", prefill_tokens=16, context=4, batches=(1, 2), new_tokens=(3,),
                         prompt_tokens=4, repeats=1)
    assert r.model == "tiny" and r.params == mf.GPTConfig.preset("tiny").num_params()
    assert r.prefill_tokens_per_s == 16 / r.prefill_s and r.decode_tokens_per_s == 1 / r.decode_s
    assert [s.batch for s in r.batches] == [1, 2] and r.batches[1].tokens_per_s > 0
    (c,) = r.cache
    assert c.new_tokens == 3 and c.speedup == c.without_cache_s / c.with_cache_s
    assert math.isclose(c.with_ms_per_token, c.with_cache_s / 3 * 1e3)
    text = bench_decode.format_report(r)
    assert "prefill    16 tokens" in text and "batch    2" in text and "3 new tokens" in text
    assert "claims" not in text  # reference figures only beside the reference model
    assert "[claims: 147.0 ms" in bench_decode.format_report(r, reference=True)


def test_cli_decode_is_registered_and_runs(capsys):
    rc = bench_main(["decode", "--preset", "tiny", "--prefill-tokens", "16", "--context", "4",
                     "--batches", "1", "2", "--new-tokens", "3", "--prompt-tokens", "4",
                     "--repeats", "1"])
    out = capsys.readouterr().out
    assert rc == 0 and "decode" in COMMANDS
    assert "tiny model" in out and "tokens/s" in out and "ms/step" in out and "no cache" in out


# ---------------------------------------------------------------- the lesson

def test_measure_on_tiny(tiny):
    s = PD.measure(tiny, lengths=(4, 8), repeats=1, decode_repeats=1)
    assert s.lengths == (4, 8) and len(s.prefill_s) == len(s.decode_s) == 2
    assert all(t > 0 for t in (*s.prefill_s, *s.decode_s)) and s.threads >= 1


def test_sweep_lookups_and_validation():
    assert SWEEP.ttft_s(64) == 0.002 + 64e-4 and SWEEP.tpot_s(512) == 0.005 + 512e-6
    assert SWEEP.prefill_tokens_per_s(512) == 512 / SWEEP.ttft_s(512)
    assert SWEEP.decode_tokens_per_s(16) == 1 / SWEEP.tpot_s(16)
    with pytest.raises(ValueError, match="was not measured"):
        SWEEP.ttft_s(100)
    with pytest.raises(ValueError, match="equally long"):
        PD.Sweep((1, 2), (0.1,), (0.1, 0.2))
    with pytest.raises(ValueError, match="> 0"):
        PD.Sweep((1,), (0.0,), (0.1,))


def test_rows_and_reference_rows():
    rows = PD.rows(SWEEP)
    assert [r["tokens"] for r in rows] == list(LENGTHS)
    last = rows[-1]
    assert last["prefill ms"] == 53.2 and last["decode ms/token"] == 5.51
    assert last["prefill tok/s"] == round(512 / 0.0532)
    ref = PD.reference_rows(SWEEP, prompt_tokens=512, context=64)
    assert ref[0]["claim ms"] == 147.0 and ref[0]["claim tok/s"] == 3480
    assert ref[1]["claim ms"] == 11.1 and ref[1]["claim tok/s"] == 90
    assert ref[2]["claim tok/s"] == 38.7  # 3,480 / 90
    assert ref[2]["ours tok/s"] == round((512 / SWEEP.ttft_s(512)) * SWEEP.tpot_s(64), 1)


def test_phase_rows_reference_model():
    pre, dec = PD.phase_rows("reference", 512, "fp32")
    assert pre["FLOP/byte"] == 256.0 and dec["FLOP/byte"] == 0.5
    assert pre["MB read"] == dec["MB read"] == 107.2
    assert pre["GFLOP"] == round(2 * 26_792_960 * 512 / 1e9, 2)


def test_request_is_the_met2_formula():
    r = PD.request(SWEEP, 64, 500)
    assert r["e2e_s"] == r["ttft_s"] + 500 * r["tpot_s"]
    assert r["ttft_s"] == SWEEP.ttft_s(64) and r["tpot_s"] == SWEEP.tpot_s(64)
    assert 0 < r["decode_share"] < 1


def test_figures_and_panel():
    fig = PD.sweep_figure(SWEEP)
    names = [t.name for t in fig.data]
    assert names[0].startswith("prefill") and names[1].startswith("one decode step")
    assert fig.data[0].y[-1] == 53.2 and fig.data[1].y[0] == 5.016
    assert "claim PD-3 (reference CPU)" in names
    assert PD.sweep_figure(SWEEP, reference=False).data[-1].name == "decode tok/s"

    ui = PD.panel(SWEEP, context=64, output_tokens=10)
    assert ui.result.data[-1].x == (10, 10)  # the request's answer length, marked
    assert "prompt of 64 tokens" in ui.result.layout.title.text
    ui.children[0].value = 512
    ui.children[1].value = 1000
    assert ui.result.data[-1].x == (1000, 1000)
    assert "1,000 tokens take 5.57 s" in ui.result.layout.title.text  # 0.0532 + 1000 × 0.005512


def test_busy_warning(monkeypatch):
    from minifer_course.bench import common

    assert bench_decode.busy_warning is common.busy_warning  # the old home still has it
    monkeypatch.setattr(common.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(common.os, "getloadavg", lambda: (1.0, 1.0, 1.0))
    assert "consider --threads 1" in common.busy_warning(2)
    assert common.busy_warning(1) is None
    monkeypatch.setattr(common.os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    assert common.busy_warning(2) is None


def test_run_figure_one_bar_per_pass():
    fig = PD.run_figure([0.120, 0.010, 0.011, 0.012], prompt_tokens=256)
    prefill, decode = fig.data
    assert list(prefill.x) == [0] and list(prefill.y) == [120.0]
    assert list(decode.x) == [1, 2, 3] and list(decode.y) == [10.0, 11.0, 12.0]
    assert "prefill of 256 tokens 120.0 ms" in fig.layout.title.text
    assert "~11.0 ms" in fig.layout.title.text  # the median decode step
    with pytest.raises(ValueError, match="at least one decode step"):
        PD.run_figure([0.1], 8)
    with pytest.raises(ValueError, match="> 0"):
        PD.run_figure([0.1, 0.0], 8)
