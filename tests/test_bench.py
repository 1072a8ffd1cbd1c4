"""minifer.bench: the timing helpers do what they say (no assertions on how fast anything is)."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from minifer import bench


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
    bw = bench.measure_bandwidth("cpu", nbytes=1 << 16, warmup=0, repeats=2)
    assert math.isfinite(bw) and bw > 0
    with pytest.raises(ValueError, match="nbytes"):
        bench.measure_bandwidth("cpu", nbytes=0)


@pytest.mark.parametrize("dtype", [torch.float32, "bfloat16"])
def test_matmul_probe_returns_a_positive_finite_rate(dtype):
    flops = bench.measure_matmul_flops("cpu", n=32, dtype=dtype, warmup=1, repeats=2)
    assert math.isfinite(flops) and flops > 0


def test_matmul_probe_rejects_bad_arguments():
    with pytest.raises(ValueError, match="dtype"):
        bench.measure_matmul_flops("cpu", n=8, dtype="float99")
    with pytest.raises(ValueError, match="n must"):
        bench.measure_matmul_flops("cpu", n=0)


def test_cli_probe_prints_both_numbers(capsys):
    rc = bench.main(["probe", "--size-mib", "1", "--n", "32", "--repeats", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "GB/s" in out and "GFLOP/s" in out


def test_cli_without_a_command_prints_help(capsys):
    assert bench.main([]) == 2
    assert "probe" in capsys.readouterr().out


def test_commands_can_be_registered(capsys, monkeypatch):
    monkeypatch.setattr(bench, "COMMANDS", dict(bench.COMMANDS))
    seen = {}

    def add(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--k", type=int, default=1)

    def run(args: argparse.Namespace) -> int:
        seen["k"] = args.k
        return 3

    bench.register_command("demo", "a demo command", add, run)
    assert bench.main(["demo", "--k", "5"]) == 3
    assert seen == {"k": 5}


def test_hardware_measure_uses_the_probes(monkeypatch):
    from minifer.roofline import Hardware

    monkeypatch.setattr(bench, "measure_bandwidth", lambda device="cpu": 10e9)
    monkeypatch.setattr(bench, "measure_matmul_flops", lambda device="cpu", dtype=None: 100e9)
    hw = Hardware.measure("cpu")
    assert hw.bandwidth == 10e9 and hw.peak_flops("fp32") == 100e9
    assert hw.memory_bytes > 0
    with pytest.raises(ValueError, match="precisions"):
        Hardware.measure("cpu", precisions=("int4",))


def test_this_machine_preset_is_measured_once(monkeypatch):
    from minifer import roofline

    calls = []
    monkeypatch.setattr(bench, "measure_bandwidth", lambda device="cpu": calls.append(1) or 5e9)
    monkeypatch.setattr(bench, "measure_matmul_flops", lambda device="cpu", dtype=None: 50e9)
    roofline._measured_this_machine.cache_clear()
    try:
        hw = roofline.Hardware.preset("this-machine")
        assert roofline.Hardware.preset("this-machine") is hw and calls == [1]
        assert hw.name == "this-machine" and roofline.ridge_point(hw, "fp32") == 10
        assert roofline.decode_step("reference", "this-machine", precision="fp32").bound == "memory"
    finally:
        roofline._measured_this_machine.cache_clear()
