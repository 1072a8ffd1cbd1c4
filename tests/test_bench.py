"""minifer_course.bench: the timing helpers do what they say (no assertions on how fast anything is)."""

from __future__ import annotations

import importlib
import math
import subprocess
import sys

import pytest
import torch

from minifer_course import bench
from minifer_course.bench import probes
from minifer_course.bench.__main__ import main as bench_main


def test_time_fn_runs_warmup_plus_repeats_and_reports_the_median():
    calls = []
    timing = bench.time_fn(lambda: calls.append(1), warmup=3, repeats=7)
    assert len(calls) == 3 + 7
    assert timing.repeats == 7 and len(timing.times) == 7 and timing.warmup == 3
    ordered = sorted(timing.times)
    assert timing.median_s == ordered[3]
    assert timing.min_s == ordered[0] and timing.max_s == ordered[-1]
    assert timing.min_s <= timing.mean_s <= timing.max_s
    assert timing.median_ms == timing.median_s * 1e3
    assert all(t >= 0 for t in timing.times)
    assert "median" in str(timing)


def test_time_fn_warmup_calls_come_first_and_are_not_counted():
    log = []
    timing = bench.time_fn(lambda: log.append(len(log)), warmup=2, repeats=1)
    assert log == [0, 1, 2] and timing.repeats == 1


def test_time_fn_zero_warmup_and_even_repeats():
    timing = bench.time_fn(lambda: None, warmup=0, repeats=4)
    assert timing.repeats == 4
    ordered = sorted(timing.times)
    assert timing.median_s == pytest.approx((ordered[1] + ordered[2]) / 2)


@pytest.mark.parametrize("kwargs, word", [
    ({"warmup": -1}, "warmup"),
    ({"repeats": 0}, "repeats"),
    ({"repeats": 2.5}, "repeats"),
    ({"device": "not-a-device"}, "device"),
])
def test_time_fn_rejects_bad_arguments(kwargs, word):
    with pytest.raises(ValueError, match=word):
        bench.time_fn(lambda: None, **kwargs)


def test_sync_is_a_noop_on_cpu():
    bench.sync("cpu")
    bench.sync(torch.device("cpu"))


def test_bandwidth_probe_returns_a_positive_finite_rate():
    bw = probes.measure_bandwidth("cpu", nbytes=1 << 16, warmup=0, repeats=2)
    assert math.isfinite(bw) and bw > 0
    with pytest.raises(ValueError, match="nbytes"):
        probes.measure_bandwidth("cpu", nbytes=0)


@pytest.mark.parametrize("dtype", [torch.float32, "bfloat16"])
def test_matmul_probe_returns_a_positive_finite_rate(dtype):
    flops = probes.measure_matmul_flops("cpu", n=32, dtype=dtype, warmup=1, repeats=2)
    assert math.isfinite(flops) and flops > 0


def test_matmul_probe_rejects_bad_arguments():
    with pytest.raises(ValueError, match="dtype"):
        probes.measure_matmul_flops("cpu", n=8, dtype="float99")
    with pytest.raises(ValueError, match="n must"):
        probes.measure_matmul_flops("cpu", n=0)


def test_cli_probe_prints_both_numbers(capsys):
    rc = bench_main(["probe", "--size-mib", "1", "--n", "32", "--repeats", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "GB/s" in out and "GFLOP/s" in out


def test_cli_without_a_command_prints_help(capsys):
    assert bench_main([]) == 2
    assert "probe" in capsys.readouterr().out


def test_command_table_names_importable_modules():
    from minifer_course.bench.__main__ import COMMANDS

    for name, (module, help_text) in COMMANDS.items():
        mod = importlib.import_module(module)
        assert callable(mod.add_arguments) and callable(mod.run_command), name
        assert help_text


def test_python_dash_m_runs_the_table(tmp_path):
    out = subprocess.run([sys.executable, "-m", "minifer_course.bench", "probe", "--size-mib", "1",
                          "--n", "16", "--repeats", "1"], capture_output=True, text=True,
                         check=True)
    assert "GB/s" in out.stdout and not out.stderr


def test_measure_hardware_uses_the_probes(monkeypatch):
    monkeypatch.setattr(probes, "measure_bandwidth", lambda device="cpu": 10e9)
    monkeypatch.setattr(probes, "measure_matmul_flops", lambda device="cpu", dtype=None: 100e9)
    hw = probes.measure_hardware("cpu")
    assert hw.bandwidth == 10e9 and hw.peak_flops("fp32") == 100e9
    assert hw.memory_bytes > 0
    with pytest.raises(ValueError, match="precisions"):
        probes.measure_hardware("cpu", precisions=("int4",))


def test_this_machine_is_measured_once(monkeypatch):
    from minifer_course import roofline

    calls = []
    monkeypatch.setattr(probes, "measure_bandwidth", lambda device="cpu": calls.append(1) or 5e9)
    monkeypatch.setattr(probes, "measure_matmul_flops", lambda device="cpu", dtype=None: 50e9)
    probes.this_machine.cache_clear()
    try:
        hw = probes.this_machine()
        assert probes.this_machine() is hw and calls == [1]
        assert hw.name == "this-machine" and roofline.ridge_point(hw, "fp32") == 10
        assert roofline.decode_time("reference", hw, precision="fp32").bound == "memory"
    finally:
        probes.this_machine.cache_clear()


# ---- quick scopes, shared random K/V, the profiler command (machinery only, no timings) ------
def test_random_past_starts_every_engine_at_the_same_tokens(tiny):
    """From the same random cache and last token, minifer and the textbook engine agree (fp32),
    and minifer agrees with its own prefilled run on the cache it copies."""
    from minifer_course.bench.baselines import MinifierDecoder, TextbookEngine, random_past

    prompt = torch.randint(0, 257, (2, 9), generator=torch.Generator().manual_seed(0))
    past = random_past(tiny, 2, 8, seed=1)
    assert len(past) == tiny.config.n_layer
    assert past[0][0].shape == (2, tiny.config.kv_heads, 8, tiny.config.head_dim)
    out = {}
    for engine in (MinifierDecoder(tiny), TextbookEngine(tiny)):
        engine.start(prompt, 6, past)
        out[engine.name] = engine.decode(6).tolist()
        assert engine.decode(6).tolist() == out[engine.name]  # repeatable
    assert out["minifer"] == out["textbook"]
    fresh = MinifierDecoder(tiny)
    fresh.start(prompt, 6)  # a real prefill gives other K/V, so (in general) other tokens
    assert len(fresh.decode(6)[0]) == 6
    with pytest.raises(ValueError, match="past"):
        MinifierDecoder(tiny).start(prompt[:, :5], 6, past)
    with pytest.raises(ValueError, match="tokens"):
        random_past(tiny, 1, tiny.config.context_length)


def test_quick_table_uses_fewer_steps_at_large_batches(capsys):
    from minifer_course.bench.engines import quick_new_tokens, quick_repeats

    assert quick_new_tokens(1) >= quick_new_tokens(64) >= 2
    assert quick_repeats(1) >= quick_repeats(64) >= 3
    assert bench_main(["decode", "--table", "--presets", "tiny", "--dtypes", "fp32",
                       "--batches", "1", "16", "--table-prompt-tokens", "8",
                       "--no-baselines"]) == 0
    out = capsys.readouterr().out
    assert "random K/V" in out and f"{quick_new_tokens(1)} at batch 1" in out
    assert f"{quick_repeats(1)} at batch 1, {quick_repeats(16)} at batch 16" in out


def test_quant_command_quick_scope_writes_json(tmp_path, capsys):
    import json

    from minifer_course.bench import quant

    path = tmp_path / "q.json"
    assert bench_main(["quant", "--preset", "tiny", "--rounds", "1", "--group-size", "32",
                       "--json", str(path)]) == 0
    text = capsys.readouterr().out
    labels = [r["label"] for r in json.loads(path.read_text())["rows"]]
    assert labels == [v[0] for v in quant.QUICK_VARIANTS]
    assert "b=1 tok/s" in text and "b=32" not in text


@pytest.mark.parametrize("engine", ["minifer", "textbook", "int8", "serve", "serve-kernel"])
def test_profile_splits_the_step(engine, tiny):
    from minifer_course.bench.profile import format_summary, profile_decode

    p = profile_decode(engine, "tiny", batch=2, prompt_tokens=8, steps=2, model=tiny)
    assert p.wall_s > 0 and p.linear_s > 0 and p.outside_ops_s >= 0
    assert "Self CPU" in p.table
    text = format_summary(p)
    assert "linear layers" in text and "outside torch ops" in text
    serve = engine.startswith("serve")
    assert ("K/V copies" in text) == serve and (p.kv_copy_s > 0) == serve
    if engine == "serve-kernel":  # the paged kernel's time counts as attention
        assert p.attention_s > 0


def test_profile_rejects_bad_arguments(tiny):
    from minifer_course.bench.profile import profile_decode

    with pytest.raises(ValueError, match="engine"):
        profile_decode("fastest", "tiny", model=tiny)
    with pytest.raises(ValueError, match="dtype"):
        profile_decode("minifer", "tiny", dtype="fp8", model=tiny)
    with pytest.raises(ValueError, match="steps"):
        profile_decode("minifer", "tiny", steps=0, model=tiny)


def test_the_table_is_its_own_command_and_keeps_its_old_spelling():
    from minifer_course.bench.commands.table import from_decode_table

    assert from_decode_table(["decode", "--table", "--presets", "tiny", "--table-prompt-tokens",
                              "8", "--table-new-tokens=2", "--batches", "1"]) == \
        ["table", "--presets", "tiny", "--prompt-tokens", "8", "--new-tokens=2", "--batches", "1"]
