"""The thread policy (`minifer.threads`) and the benchmark that measures it (`bench threads`)."""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from minifer import threads as T
from minifer.bench import threads as BT


@pytest.mark.parametrize("idle,cpus,expected", [(0.0, 2, 1), (0.3, 2, 1), (0.6, 2, 1),
                                                (1.4, 2, 1), (1.6, 2, 2), (7.0, 2, 2),
                                                (3.5, 8, 4)])
def test_auto_threads_takes_the_idle_cores_at_least_one(idle, cpus, expected):
    assert T.auto_threads(idle=idle, cpus=cpus) == expected


def test_idle_cpus_is_within_the_machine():
    cpus = os.cpu_count() or 1
    assert 0.0 <= T.idle_cpus(interval=0.05) <= cpus
    assert 1 <= T.auto_threads() <= cpus


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="Linux's CPU counters")
def test_cpu_times_count_idle_within_total():
    idle, total = T.cpu_times()
    assert 0 < idle <= total


def test_parse_threads_takes_a_count_or_auto():
    assert T.parse_threads("auto") == "auto"
    assert T.parse_threads("3") == 3
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive integer or 'auto'"):
            T.parse_threads(bad)


def test_apply_threads_sets_a_count_and_none_leaves_it():
    saved = torch.get_num_threads()
    try:
        assert T.apply_threads(1) == 1 == torch.get_num_threads()
        assert T.apply_threads(None) == 1
        assert 1 <= T.apply_threads("auto") <= (os.cpu_count() or 1)
        with pytest.raises(ValueError, match="threads"):
            T.apply_threads(0)
    finally:
        torch.set_num_threads(saved)


def test_the_benchmark_options_take_auto():
    from minifer.bench.commands import add_machine_options

    parser = argparse.ArgumentParser()
    add_machine_options(parser)
    assert parser.parse_args(["--threads", "auto"]).threads == "auto"
    assert parser.parse_args(["--threads", "2"]).threads == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["--threads", "0"])


def test_default_settings_cover_one_all_and_auto_with_both_wait_policies():
    names = [s.name for s in BT.default_settings(cpus=2)]
    assert names == ["threads=1", "threads=1, OMP_WAIT_POLICY=passive", "threads=2",
                     "threads=2, OMP_WAIT_POLICY=passive", "threads=auto",
                     "threads=auto, OMP_WAIT_POLICY=passive"]
    assert [s.threads for s in BT.default_settings(cpus=1)] == [1, 1, "auto", "auto"]


def test_background_load_starts_and_ends_its_processes(monkeypatch):
    started = []
    real = BT.subprocess.Popen

    def spy(*args, **kwargs):
        started.append(real(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(BT.subprocess, "Popen", spy)
    with BT.background_load(0):
        assert started == []
    with BT.background_load(1, max_s=30):
        assert len(started) == 1 and started[0].poll() is None
    assert started[0].poll() is not None  # killed with the block


def test_a_trial_runs_in_its_own_process_with_its_settings():
    res = BT.trial(BT.Setting(1, "passive"), preset="tiny", new_tokens=4, repeats=1)
    assert res["threads"] == 1 and res["t_all"] > 0
    assert res["tokens_per_s"] > 0 or res["tokens_per_s"] != res["tokens_per_s"]  # a rate or NaN


def test_report_gives_medians_spread_and_the_ratio_to_the_quiet_default():
    rows = [BT.ThreadsRow(BT.Setting(2), 0, [100.0, 110.0, 90.0], [2, 2, 2]),
            BT.ThreadsRow(BT.Setting(1), 1, [60.0, 50.0, 40.0], [1, 1, 1]),
            BT.ThreadsRow(BT.Setting("auto", "passive"), 1, [55.0, 50.0, 50.0], [1, 2, 1])]
    assert rows[0].median == 100.0 and rows[1].spread == 1.5
    text = BT.format_report(rows, cpus=2)
    assert "background load: 0 busy core(s) of 2" in text and "1 busy core(s)" in text
    line = next(x for x in text.splitlines() if x.startswith("threads=auto"))
    assert line.split()[-4:] == ["50.0", "1.10", "1/2", "0.50"]
