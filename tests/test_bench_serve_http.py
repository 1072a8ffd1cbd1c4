"""`python -m minifer_course.bench serve --http`: a real server process per run, and the report."""

from __future__ import annotations

import os
import sys

from minifer_course.bench import serve_http as H
from minifer_course.bench.serve_load import make_requests


def test_a_run_starts_a_server_sends_the_load_and_stops_it():
    requests = make_requests(3, float("inf"), prompt_len=(8, 8), output_len=(4, 4),
                             prompt_format="ids")
    for where in ("thread", "process"):
        summary = H.serve_once(H.Variant("one thread", threads=1, engine_in=where), requests,
                               max_num_seqs=4, warmup=1)
        assert summary["completed"] == 3 and summary["failed"] == 0
        assert summary["output_tokens"] == 12 and summary["output_throughput"] > 0
        cpu = summary["cpu"]  # where the machine's time went during the load
        assert cpu["wall_s"] > 0 and cpu["background_s"] == 0.0
        if sys.platform == "linux":
            assert cpu["server_s"] > 0 and cpu["client_s"] > 0


def test_cpu_seconds_count_a_process_and_its_children():
    import time

    from minifer_course.bench.common import background_load, cpu_seconds

    if sys.platform != "linux":
        assert cpu_seconds([os.getpid()]) is None
        return
    with background_load(1) as pids:
        before = cpu_seconds(pids, descendants=False)
        time.sleep(0.5)
        spun = cpu_seconds(pids, descendants=False) - before
        mine = cpu_seconds([os.getpid()])  # this process and its children: the spinner too
    assert 0.2 < spun < 0.8 and mine >= cpu_seconds([os.getpid()], descendants=False) + 0.2


def test_a_checkout_whose_server_lacks_an_option_is_known():
    assert H.server_takes(None, "--engine-in") and H.server_takes(None, "--threads")
    assert not H.server_takes(None, "--no-such-option")


def _summary(tput, ttft, tpot, cpu=None):
    return {"output_throughput": tput, "output_tokens": 1000, "ttft": {"mean": ttft},
            "tpot": {"median": tpot, "p99": 2 * tpot}, "cpu": cpu}


def test_report_gives_medians_and_the_ratio_to_the_first_variant_on_the_quiet_machine():
    a, b = H.Variant("old"), H.Variant("new threads=auto", ".", "auto")
    rows = [H.HttpRow(a, 0, float("inf"), [_summary(400, 5.0, 0.06), _summary(300, 6.0, 0.07),
                                           _summary(420, 5.5, 0.05)]),
            H.HttpRow(b, 1, float("inf"), [
                _summary(300, 6.0, 0.07, {"wall_s": 2.0, "server_s": 2.0, "client_s": 0.5,
                                          "background_s": 1.0}),
                _summary(360, 5.0, 0.06, {"wall_s": 2.0, "server_s": 3.0, "client_s": 0.6,
                                          "background_s": 1.2}),
                _summary(380, 5.5, 0.05, {"wall_s": 4.0, "server_s": 4.0, "client_s": 1.0,
                                          "background_s": 2.0})])]
    assert rows[0].median("output_throughput") == 400 and rows[1].median("tpot", "p99") == 0.12
    text = H.format_http(rows, "header")
    assert text.startswith("header") and "÷ old on the quiet machine" in text
    line = next(x for x in text.splitlines() if x.startswith("new threads=auto"))
    assert line.split()[-3:] == ["0.90", "3.00", "1.00/0.25/0.50"]  # ÷ base, ms/tok, cores
    assert "300, 360, 380" in line and "60 / 120" in line
    old = next(x for x in text.splitlines() if x.startswith("old"))
    assert old.split()[-2:] == ["-", "-"]  # runs without CPU readings


def test_a_checkout_is_checked_to_be_what_its_server_imports(tmp_path):
    import pathlib

    import pytest

    repo = pathlib.Path(H.__file__).resolve().parents[3]
    assert H.checkout_root(str(repo)) == str(repo)
    with pytest.raises(RuntimeError, match="not from that checkout"):
        H.checkout_root(str(tmp_path))  # no minifer there: the installed copy would be run
