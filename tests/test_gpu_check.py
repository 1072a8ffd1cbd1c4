"""The prepared GPU check (tools/gpu_check.py, `make test-gpu`) and `python -m minifer_course.bench gpu`,
run on a CPU: the cuda cases skip without counting as a missing package, the check says there is
no GPU and exits 0, and its plumbing (the benchmark's quick plan, results written as they come,
stored and loaded) works end to end."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import torch
from strict_deps import MISSING_PACKAGE
from tool_modules import load_tool

from conftest import NO_CUDA
from minifer_course.bench.results import gpu_headline, gpu_runs, latest_gpu_run

ROOT = Path(__file__).resolve().parent.parent
gpu_check = load_tool("gpu_check")


def test_cuda_cases_skip_for_hardware_not_for_a_missing_package():
    assert not MISSING_PACKAGE.match("Skipped: " + NO_CUDA)
    assert not MISSING_PACKAGE.match(NO_CUDA)


def test_the_check_runs_every_module_with_device_cases():
    uses = {f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py")
            if re.search(r"def \w+\([^)]*\bdevice\b[^)]*\)", p.read_text())}
    assert uses == set(gpu_check.GPU_TESTS)


def test_without_cuda_it_says_so_and_exits_0(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--out", str(tmp_path)]) == 0
    assert "nothing to check here" in capsys.readouterr().out
    assert not any(tmp_path.iterdir())


def test_pytest_command_collects_the_cuda_cases_without_the_project_addopts():
    out = subprocess.run(gpu_check.pytest_command() + ["--collect-only"], cwd=ROOT,
                         env=gpu_check._env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    ids = [line for line in out.stdout.splitlines() if "::" in line]
    assert ids and all("cuda" in i for i in ids)  # only the cuda cases
    for module in gpu_check.GPU_TESTS:
        if module.endswith(("test_hf.py", "test_families.py")) \
                and importlib.util.find_spec("transformers") is None:
            continue  # the parity tests skip as a module without transformers (the test extra)
        assert any(i.startswith(module) for i in ids), module


def test_the_benchmark_quick_on_a_cpu_writes_stores_and_loads(tmp_path):
    out = tmp_path / "out"
    assert gpu_check.main(["--device", "cpu", "--skip-tests", "--out", str(out),
                           "--budget-s", "300"]) == 0
    summary = json.loads((out / "gpu-check.json").read_text())
    assert summary["bench"]["exit"] == 0
    result = json.loads((out / "gpu-bench.json").read_text())
    for section in ("machine", "probes", "decode", "prefill", "serve", "speculative"):
        assert section in result and "error" not in result[section], section
    assert {r["model"] for r in result["decode"]} == {"tiny", "tiny-gqa"}
    assert all(r["eager_ms"] > 0 and 0 < r["eager_mbu"] for r in result["decode"])
    assert result["serve"][0]["output_tokens"] > 0
    assert {p["drafter"].split(" (")[0] for p in result["speculative"]["shipped"]["points"]} == {
        "draft model", "prompt lookup"}
    assert "projected_speedup_at_alpha" in result["speculative"]["sized"]["points"][0]
    assert "== decode" in (out / "gpu-bench.log").read_text()

    from minifer_course.bench.gpu import format_report

    table = format_report(result)
    assert "decode step at context" in table and "serving tiny" in table

    stored = gpu_check.store(out / "gpu-bench.json", tmp_path)
    assert re.fullmatch(r"gpu-\d{4}-\d\d-\d\d-cpu\.json", stored.name)
    assert gpu_runs(tmp_path) == [stored]
    head = gpu_headline(latest_gpu_run(tmp_path), model="tiny")
    assert head["batch_lo"] == 1 and head["batch_hi"] == 4 and head["step_growth"] > 0
    assert head["serve_output_tok_s"] > 0 and "prompt lookup (n-grams 1..3)" in head["spec_speedup"]


def test_no_stored_run_is_none(tmp_path):
    assert latest_gpu_run(tmp_path) is None and gpu_headline(None) is None


def test_the_bench_command_is_listed():
    out = subprocess.run([sys.executable, "-m", "minifer_course.bench", "--help"], cwd=ROOT,
                         env=gpu_check._env(), capture_output=True, text=True, timeout=120)
    assert "gpu" in out.stdout


def _gpu_like_result() -> dict:
    """A result shaped like a GPU run's (its CUDA-only sections included), numbers made up."""
    row = {"model": "gpt2-124m", "context": 512}
    return {
        "machine": {"gpu": "Some GPU", "device": "cuda", "date": "2030-01-01T00:00:00+00:00"},
        "probes": {"bandwidth_GBps": 3000.0, "matmul_tflops": 700.0, "matmul_dtype": "bfloat16",
                   "matmul_n": 8192},
        "decode": [row | {"batch": 1, "eager_ms": 5.0, "eager_tok_s": 200.0, "eager_mbu": 0.1},
                   row | {"batch": 256, "eager_ms": 6.0, "eager_tok_s": 42667.0,
                          "eager_mbu": 0.2}],
        "decode_graph": [row | {"batch": 1, "graph_ms": 2.0, "graph_tok_s": 500.0,
                                "graph_mbu": 0.25},
                         row | {"batch": 256, "error": "RuntimeError: capture failed"}],
        "decode_compiled": [{"model": "gpt2-124m", "batch": 1, "compiled_ms": 1.5,
                             "compiled_mbu": 0.3, "compile_s": 30.0},
                            {"model": "gpt2-1b", "batch": 64, "skipped": "time budget spent"}],
        "prefill": [{"model": "gpt2-124m", "tokens": 1024, "batch": 8, "ms": 20.0,
                     "tokens_per_s": 409600.0, "tflops": 300.0, "share_of_probed_peak": 0.43}],
        "serve": [{"model": "gpt2-124m", "requests": 256, "max_num_seqs": 64,
                   "output_tokens": 10000, "wall_s": 5.0, "output_tok_s": 2000.0,
                   "forward_share": 0.5}],
        "speculative": {"error": "ValueError: something"},
    }


def test_the_report_and_headline_merge_the_cuda_only_sections():
    from minifer_course.bench.gpu import format_report

    r = _gpu_like_result()
    table = format_report(r)
    first = next(line for line in table.splitlines() if line.strip().startswith("gpt2-124m") and " 1 " in line)
    assert "5.000" in first and "2.000" in first and "1.500" in first and "25.0%" in first
    assert "capture failed" in table and "speculative: FAILED ValueError" in table
    head = gpu_headline(r)
    assert head["graph_ms_lo"] == 2.0 and head["step_growth"] == 6.0 / 5.0
    assert head["best_mbu"] == 0.25 and head["serve_output_tok_s"] == 2000.0
    assert head["prefill_share_of_peak"] == 0.43 and "spec_speedup" not in head


def test_graph_rows_stop_at_the_first_failed_capture(monkeypatch):
    from minifer_course.bench import gpu

    calls = []

    def fake_graph(model, batch, context, repeats):
        calls.append(batch)
        if batch == 4:
            raise RuntimeError("operation not permitted when stream is capturing")
        return 0.001

    monkeypatch.setattr(gpu, "_time_graph", fake_graph)
    model = gpu.random_model("tiny", torch.device("cpu"), torch.float32)
    plan = gpu.replace(gpu.QUICK, batches=(1, 4, 16))
    rows = gpu._decode_rows("tiny", model, plan, 1e9, gpu.Recorder(None, quiet=True), graphs=True)
    assert calls == [1, 4] and rows[0]["graph_ms"] == 1.0 and "stream is capturing" in rows[1]["error"]
