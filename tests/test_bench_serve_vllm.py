"""`python -m minifer_course.bench serve-vllm`: its options, its report and its reading of vLLM's
result JSON, on a canned result. No servers here (CI has no vLLM)."""

from __future__ import annotations

import argparse
import json
import sys

import pytest

from minifer_course.bench import serve_vllm
from minifer_course.bench.commands import serve_vllm as command

# the fields this reads from `vllm bench serve --save-result` (vLLM 0.32.0, 20 prompts, this
# machine's vLLM server; the per-request lists cut short)
CANNED = {"date": "20261207-005844", "endpoint_type": "vllm", "backend": "vllm",
          "model_id": "shakespeare", "num_prompts": 20, "request_rate": "inf",
          "duration": 0.7773710069996014, "completed": 20, "failed": 0,
          "total_input_tokens": 1285, "total_output_tokens": 1280,
          "request_throughput": 25.72774109134, "output_throughput": 1646.57542984576,
          "total_token_throughput": 3299.5827949643553, "latencies": [0.7, 0.71],
          "mean_ttft_ms": 191.8458768000619, "median_ttft_ms": 198.42797349929242,
          "p99_ttft_ms": 206.66222692044357, "mean_tpot_ms": 9.145030429363755,
          "median_tpot_ms": 9.034837682542102, "mean_itl_ms": 9.145030429363755}


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return parser.parse_args(argv)


def test_defaults_match_the_brief():
    args = parse()
    assert (args.rounds, args.num_prompts, args.input_len, args.output_len, args.max_num_seqs,
            args.busy_cores, args.json) == (3, 100, 64, 64, 32, 0, None)
    assert command.vllm_path(args) == serve_vllm.DEFAULT_VLLM == "/work/vllm-venv/bin/vllm"


def test_options_parse(tmp_path):
    args = parse("--rounds", "1", "--num-prompts", "20", "--busy-cores", "2",
                 "--vllm", "/opt/v/bin/vllm", "--json", str(tmp_path / "r.json"))
    assert (args.rounds, args.num_prompts, args.busy_cores) == (1, 20, 2)
    assert command.vllm_path(args) == "/opt/v/bin/vllm" and args.json == tmp_path / "r.json"
    assert command.vllm_path(parse("--vllm-python", "/opt/v/bin/python")) == "/opt/v/bin/vllm"


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--num-prompts", "-1"],
                                  ["--vllm", "a", "--vllm-python", "b"]])
def test_bad_options_are_refused(argv):
    with pytest.raises(SystemExit):
        parse(*argv)


def test_the_command_is_registered():
    from minifer_course.bench.__main__ import COMMANDS

    assert COMMANDS["serve-vllm"][0] == "minifer_course.bench.commands.serve_vllm"


def test_a_missing_vllm_says_how_to_set_it_up(tmp_path, monkeypatch, capsys):
    missing = tmp_path / "no-venv" / "bin" / "vllm"
    problem = serve_vllm.vllm_problem(missing)
    assert str(missing) in problem and "docstring" in problem and "--vllm" in problem
    monkeypatch.setattr(sys, "argv", ["x"])
    with pytest.raises(SystemExit) as e:
        command.run_command(parse("--vllm", str(missing)))
    assert "serve-vllm: error: no vLLM executable" in str(e.value.code)
    with pytest.raises(FileNotFoundError):  # and nothing is started
        serve_vllm.run(str(missing))


def test_parse_result_reads_the_canned_json():
    m = serve_vllm.parse_result(json.loads(json.dumps(CANNED)), "vllm", 0)
    assert m.output_tok_s == pytest.approx(1646.5754, rel=1e-4) and m.completed == 20 and m.failed == 0
    assert m.mean_ttft_ms == pytest.approx(191.8459, rel=1e-4) and m.mean_tpot_ms == pytest.approx(9.1450, rel=1e-4)
    assert m.duration_s == pytest.approx(0.7774, rel=1e-4)
    with pytest.raises(RuntimeError, match="2 of 20 requests failed"):
        serve_vllm.parse_result({**CANNED, "completed": 18, "failed": 2}, "minifer", 0)
    with pytest.raises(ValueError, match="not a vllm bench serve result"):
        serve_vllm.parse_result({k: v for k, v in CANNED.items() if k != "mean_tpot_ms"},
                                "vllm", 0)


def test_the_engines_alternate():
    assert serve_vllm.order(0) == ("minifer", "vllm")
    assert serve_vllm.order(1) == ("vllm", "minifer")
    assert serve_vllm.order(2) == ("minifer", "vllm")


def measure(engine, r, tok_s, ttft=100.0, tpot=10.0):
    return serve_vllm.Measure(engine, r, tok_s, ttft, tpot, 20, 0, 1.0)


def test_summary_takes_medians_and_the_report_shows_the_ratio():
    ms = [measure("minifer", 0, 900.0, 120.0, 11.0), measure("vllm", 0, 1000.0, 200.0, 9.0),
          measure("vllm", 1, 1200.0, 150.0, 8.0), measure("minifer", 1, 600.0, 300.0, 20.0),
          measure("minifer", 2, 800.0, 100.0, 12.0), measure("vllm", 2, 800.0, 180.0, 10.0)]
    s = serve_vllm.summarize(ms)
    assert s["minifer"]["output_tok_s"] == 800.0 and s["vllm"]["output_tok_s"] == 1000.0
    assert s["minifer"]["mean_ttft_ms"] == 120.0 and s["vllm"]["mean_tpot_ms"] == 9.0
    assert s["ratio"] == 0.8 and s["rounds_ratio"] == [0.9, 0.5, 1.0]
    json.dumps(s)  # what --json writes
    text = serve_vllm.format_report(s, "0.32.0")
    lines = text.splitlines()
    assert "output tok/s" in lines[0] and "mean TTFT ms" in lines[0] and "mean TPOT ms" in lines[0]
    assert lines[1].split()[:4] == ["minifer", "800.0", "120.0", "12.0"]
    assert lines[2].split()[:5] == ["vLLM", "0.32.0", "1000.0", "180.0", "9.0"]
    assert "minifer ÷ vLLM output tok/s: 0.80x" in lines[3] and "0.90 0.50 1.00" in lines[3]


def test_one_engine_alone_has_no_ratio():
    s = serve_vllm.summarize([measure("minifer", 0, 500.0)])
    assert "ratio" not in s and "vllm" not in s
    assert "÷" not in serve_vllm.format_report(s)


def test_the_client_and_servers_use_loopback_only(tmp_path):
    argv = serve_vllm.client_argv("/v/bin/vllm", "http://127.0.0.1:9", tmp_path / "m", 20, 64, 64,
                                  tmp_path, "r.json")
    joined = " ".join(argv)
    for flag in ("--backend vllm", "--dataset-name random", "--random-input-len 64",
                 "--random-output-len 64", "--num-prompts 20", "--request-rate inf",
                 "--ignore-eos", "--save-result", "--result-filename r.json"):
        assert flag in joined
    for engine in serve_vllm.ENGINES:
        a = serve_vllm.server_argv(engine, 9, tmp_path, "/v/bin/vllm", 32)
        assert a[a.index("--host") + 1] == "127.0.0.1" and "--max-num-seqs" in a
    assert "float32" in serve_vllm.server_argv("vllm", 9, tmp_path, "/v/bin/vllm", 32)
