"""`python -m minifer.bench serve` runs on a tiny preset and reports both comparisons (no
assertion on how fast anything is)."""

from __future__ import annotations

import math

import pytest

from minifer.bench.__main__ import main as bench_main
from minifer.bench.serve import mixed_workload


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
