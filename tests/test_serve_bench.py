"""`python -m minifer_course.bench serve` runs on a tiny preset and reports both comparisons (no
assertion on how fast anything is)."""

from __future__ import annotations

import math

import pytest

from minifer_course.bench.__main__ import main as bench_main
from minifer_course.bench.serve import mixed_workload


def test_serve_command_runs_on_a_tiny_preset(capsys):
    assert bench_main(["serve", "--models", "tiny", "--requests", "6", "--prefix-requests", "4",
                       "--rate", "inf", "--max-num-seqs", "3", "--block-size", "4",
                       "--system-prompt", "40", "--threads", "1", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    for label in ("static", "continuous", "prefix cache off", "prefix cache on"):
        assert f"tiny         {label} " in out
    assert "continuous / static =" in out and "prefix caching computes" in out


def test_mixed_workload_is_seeded_and_fits_the_context():
    a = mixed_workload(50, 10.0, vocab_size=100, context=128, prompt_len=(4, 40),
                       system_prompt=20, seed=3)
    b = mixed_workload(50, 10.0, vocab_size=100, context=128, prompt_len=(4, 40),
                       system_prompt=20, seed=3)
    assert a == b
    assert all(r.prompt[:20] == a[0].prompt[:20] for r in a)  # the shared system prompt
    assert all(len(r.prompt) + r.max_new_tokens - 1 <= 128 for r in a)
    times = [r.arrival_s for r in a]
    assert times == sorted(times) and times[0] == 0 and times[-1] > 0
    assert len({r.max_new_tokens for r in a}) > 5  # mixed output lengths
    assert all(r.arrival_s == 0 for r in mixed_workload(5, math.inf, vocab_size=100, context=64))
    with pytest.raises(ValueError, match="rate"):
        mixed_workload(5, 0, vocab_size=100, context=64)


def test_long_tail_workload_is_seeded_with_the_issue_shape():
    from minifer_course.bench.serve_offline import long_tail_workload

    work = long_tail_workload(400, vocab_size=50, seed=3)
    assert work == long_tail_workload(400, vocab_size=50, seed=3) != long_tail_workload(
        400, vocab_size=50, seed=4)
    assert all(16 <= len(p) <= 64 and all(0 <= t < 50 for t in p) for p, _ in work)
    outs = [n for _, n in work]
    assert all(8 <= n <= 32 or 128 <= n <= 192 for n in outs)
    long_share = sum(n >= 128 for n in outs) / len(outs)
    assert 0.12 < long_share < 0.28  # 20% long, give or take the sampling


def test_serve_offline_command_runs_on_a_tiny_preset(capsys):
    assert bench_main(["serve", "--offline", "--models", "tiny", "--requests", "6",
                       "--rounds", "1", "--max-num-seqs", "3", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "serve --offline: tiny, 6 requests" in out and "load average" in out
    for policy in ("static", "continuous"):
        assert f" {policy} " in out
    assert "continuous / static =" in out and "wall/fwd" in out


def test_offline_runs_count_every_output_token_and_time_the_forward_calls(tiny):
    from minifer_course.bench.serve_offline import format_offline, serve_offline

    work = [([1, 2, 3], 4), ([5] * 9, 7), ([7, 8], 2)]
    runs = [serve_offline(tiny, work, p, max_num_seqs=2, engine="x")
            for p in ("static", "continuous")]
    for r in runs:
        assert r.output_tokens == 4 + 7 + 2
        assert 0 < r.forward_s <= r.wall_s and r.forward_calls > 0
    assert runs[0].forward_calls > runs[1].forward_calls  # static waits for its longest row
    assert "x: continuous / static" in format_offline(runs)


def test_compare_roots_runs_each_checkout_from_itself():
    """One round per checkout in a subprocess that imports minifer from that checkout (the
    child asserts it: ``python -c`` would otherwise import the working directory's copy)."""
    from pathlib import Path

    import minifer
    from minifer_course.bench.serve_offline import compare_roots

    root = str(Path(minifer.__file__).parent.parent)
    runs = compare_roots({"here": root}, "tiny", rounds=1, requests=4, max_num_seqs=2,
                         threads=1)
    assert [(r.engine, r.policy) for r in runs] == [("here", "static"), ("here", "continuous")]
    assert all(r.output_tokens > 0 for r in runs)


def test_engine_vs_generate_times_each_pool_read_and_checks_their_tokens(tiny):
    from minifer_course.bench.serve_offline import engine_vs_generate

    times = engine_vs_generate(tiny, batch=3, prompt_len=5, new_tokens=4, rounds=2,
                               kv_reads=("blocks", "kernel"))
    assert set(times) == {"engine-blocks", "engine-kernel", "generate"}
    assert all(len(t) == 2 and min(t) > 0 for t in times.values())
    assert set(engine_vs_generate(tiny, batch=2, prompt_len=3, new_tokens=2, rounds=1)) == {
        "engine", "generate"}
