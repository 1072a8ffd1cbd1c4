"""The load generator against a real server on 127.0.0.1, and `python -m minifer.serve`."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import time

import httpx
import pytest

import minifer as mf
from conftest import lively_model
from minifer_course.server import running_server

pytest.importorskip("minifer_course.workload")
pytest.importorskip("minifer.engine.llm_engine")
from minifer_course.bench.serve_load import format_report, make_requests, parse_slo, run_load  # noqa: E402


@pytest.fixture(scope="module")
def server():
    model, tok = lively_model("tiny"), mf.ByteTokenizer()
    engine = mf.LLMEngine(model, tok, max_num_seqs=4)
    with running_server(engine=engine, model_name="tiny") as url:
        yield url, engine, model, tok


def test_parse_slo():
    assert parse_slo("ttft=0.5,tpot=50ms") == {"ttft": 0.5, "tpot": 0.05}
    assert parse_slo(None) is None
    for bad in ("ttft", "speed=1", "ttft=fast"):
        with pytest.raises(ValueError, match="slo"):
            parse_slo(bad)


def test_make_requests_is_seeded_and_rate_only_rescales_arrivals():
    a = make_requests(6, 2.0, prompt_len=(4, 8), output_len=5, seed=3)
    b = make_requests(6, 4.0, prompt_len=(4, 8), output_len=5, seed=3)
    assert [r[:2] for r in a] == [r[:2] for r in b]
    assert [r[2] / 2 for r in a] == pytest.approx([r[2] for r in b])
    assert all(isinstance(p, str) and n == 5 for p, n, _ in a)
    ids = make_requests(3, 1.0, prompt_len=6, output_len=2, prompt_format="ids")
    assert all(len(p) == 6 and all(isinstance(t, int) for t in p) for p, _, _ in ids)
    with pytest.raises(ValueError, match="prompt_format"):
        make_requests(2, 1.0, prompt_format="json")


def test_load_run_counts_every_token_and_matches_generate(server):
    url, engine, model, tok = server
    reqs = [([int(t) % 200 + 32 for t in range(i, i + 5)], 3 + i, 0.01 * i) for i in range(8)]
    res = run_load(url, reqs, slo={"ttft": 60.0, "tpot": 60.0}, max_concurrency=3)
    s = res.summary
    assert (s["completed"], s["failed"], s["good"]) == (8, 0, 8)
    assert s["output_tokens"] == sum(n for _, n, _ in reqs)  # ignore_eos: exact lengths
    assert s["input_tokens"] == 8 * 5
    for m, (_, n, _) in zip(res.metrics, reqs):
        assert m.output_tokens == n and len(m.itl) == n - 1
        assert 0 < m.ttft <= m.e2el
    for text, (prompt, n, _) in zip(res.texts, reqs):
        [ref] = mf.generate(model, [prompt], mf.SamplingParams(temperature=0, max_new_tokens=n,
                                                               ignore_eos=True), tok)
        assert text == ref.text
    report = format_report(res, rate=1.0)
    assert "Successful requests:" in report and "P99 ITL (ms):" in report
    assert json.loads(json.dumps(res.to_json()))["summary"]["completed"] == 8
    assert not engine.has_unfinished()


def test_failed_requests_are_reported_not_raised(server):
    url, *_ = server
    res = run_load(url, [("x" * 500, 4, 0.0), ([65, 66], 2, 0.0)])  # the first is too long
    assert res.summary["completed"] == 1 and res.summary["failed"] == 1
    assert "HTTP 400" in res.errors[0] and "prompt" in res.errors[0]


def test_cli_writes_json(server, tmp_path):
    from minifer_course.bench.__main__ import main

    url, *_ = server
    out = tmp_path / "load.json"
    rc = main(["serve-load", "--url", url, "--rate", "inf", "--num-requests", "4",
               "--prompt-len", "4,8", "--output-len", "3", "--slo", "ttft=60,tpot=60",
               "--max-concurrency", "2", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["summary"]["completed"] == 4 and data["summary"]["output_tokens"] == 12
    assert data["config"]["rate"] == math.inf or data["config"]["rate"] == "inf"
    assert len(data["requests"]) == 4


def test_python_m_minifer_serve_on_loopback():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "minifer.serve", "--model", "tiny",
                             "--port", str(port), "--max-num-seqs", "2", "--device", "cpu",
                             "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "Hi",
                                                      "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_load_generator_sends_the_api_key():
    model, tok = lively_model("tiny"), mf.ByteTokenizer()
    engine = mf.LLMEngine(model, tok, max_num_seqs=2)
    with running_server(engine=engine, model_name="tiny", api_key="sekret") as url:
        refused = run_load(url, [([65, 66], 2, 0.0)], model="tiny")
        assert refused.summary["completed"] == 0 and "HTTP 401" in refused.errors[0]
        res = run_load(url, [([65, 66], 2, 0.0)], api_key="sekret")  # also finds the model
        assert res.summary["completed"] == 1 and not res.errors
