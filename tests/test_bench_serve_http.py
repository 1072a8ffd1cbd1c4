"""`python -m minifer.bench serve --http`: a real server process per run, and the report."""

from __future__ import annotations

from minifer.bench import serve_http as H
from minifer.bench.serve_load import make_requests


def test_a_run_starts_a_server_sends_the_load_and_stops_it():
    requests = make_requests(3, float("inf"), prompt_len=(8, 8), output_len=(4, 4),
                             prompt_format="ids")
    for where in ("thread", "process"):
        summary = H.serve_once(H.Variant("one thread", threads=1, engine_in=where), requests,
                               max_num_seqs=4, warmup=1)
        assert summary["completed"] == 3 and summary["failed"] == 0
        assert summary["output_tokens"] == 12 and summary["output_throughput"] > 0


def test_a_checkout_whose_server_lacks_an_option_is_known():
    assert H.server_takes(None, "--engine-in") and H.server_takes(None, "--threads")
    assert not H.server_takes(None, "--no-such-option")


def _summary(tput, ttft, tpot):
    return {"output_throughput": tput, "ttft": {"mean": ttft}, "tpot": {"median": tpot,
                                                                         "p99": 2 * tpot}}


def test_report_gives_medians_and_the_ratio_to_the_first_variant_on_the_quiet_machine():
    a, b = H.Variant("old"), H.Variant("new threads=auto", ".", "auto")
    rows = [H.HttpRow(a, 0, float("inf"), [_summary(400, 5.0, 0.06), _summary(300, 6.0, 0.07),
                                           _summary(420, 5.5, 0.05)]),
            H.HttpRow(b, 1, float("inf"), [_summary(300, 6.0, 0.07), _summary(360, 5.0, 0.06),
                                           _summary(380, 5.5, 0.05)])]
    assert rows[0].median("output_throughput") == 400 and rows[1].median("tpot", "p99") == 0.12
    text = H.format_http(rows, "header")
    assert text.startswith("header") and "÷ old on the quiet machine" in text
    line = next(x for x in text.splitlines() if x.startswith("new threads=auto"))
    assert line.split()[-1] == "0.90" and "300, 360, 380" in line and "60 / 120" in line


def test_a_checkout_is_checked_to_be_what_its_server_imports(tmp_path):
    import pathlib

    import pytest

    repo = pathlib.Path(H.__file__).resolve().parents[2]
    assert H.checkout_root(str(repo)) == str(repo)
    with pytest.raises(RuntimeError, match="not from that checkout"):
        H.checkout_root(str(tmp_path))  # no minifer there: the installed copy would be run
