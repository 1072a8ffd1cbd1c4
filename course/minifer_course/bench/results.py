"""Stored benchmark results: the dated JSON files in the repository's ``benchmarks/`` folder.

A GPU run (``python tools/gpu_check.py``, or ``python -m minifer_course.bench gpu --out DIR``) is kept
as ``benchmarks/gpu-<date>-<gpu>.json``; `latest_gpu_run` loads the newest, and `gpu_headline`
picks out the numbers a lesson shows beside its CPU measurement ("on an H100: …"). Both return
None where no GPU run is stored, so a lesson can say so instead of failing.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["BENCHMARKS_DIR", "gpu_runs", "latest_gpu_run", "gpu_headline"]

BENCHMARKS_DIR = Path(__file__).resolve().parents[3] / "benchmarks"


def gpu_runs(directory: str | Path | None = None) -> list[Path]:
    """The stored GPU runs, oldest first (their names start with the date)."""
    return sorted(Path(directory or BENCHMARKS_DIR).glob("gpu-*.json"))


def latest_gpu_run(directory: str | Path | None = None) -> dict | None:
    """The newest stored GPU run as written by `minifer_course.bench.gpu.run`, or None."""
    runs = gpu_runs(directory)
    return json.loads(runs[-1].read_text()) if runs else None


def _rows(run: dict, key: str) -> list[dict]:
    value = run.get(key)
    return [r for r in value if isinstance(r, dict)] if isinstance(value, list) else []


def gpu_headline(run: dict | None, model: str = "gpt2-124m") -> dict | None:
    """A run's headline numbers for `model`: the probes, its decode step at the smallest and
    largest batch measured (eager and CUDA graph, ms) and how much longer the largest batch's
    step takes (BATCH-1: flat means ~1), the best MBU, prefill's share of the probed peak,
    speculative decoding's speed-up on the shipped pair and serving's output tokens/s."""
    if run is None:
        return None
    probes = run.get("probes", {})
    graph = {r["batch"]: r for r in _rows(run, "decode_graph") if r.get("model") == model}
    decode = [graph.get(r["batch"], {}) | r for r in _rows(run, "decode")
              if r.get("model") == model and "eager_ms" in r]
    out: dict = {"gpu": run.get("machine", {}).get("gpu"), "date": run.get("machine", {}).get("date"),
                 "bandwidth_GBps": probes.get("bandwidth_GBps"),
                 "matmul_tflops": probes.get("matmul_tflops")}
    if decode:
        lo, hi = min(decode, key=lambda r: r["batch"]), max(decode, key=lambda r: r["batch"])
        out.update(batch_lo=lo["batch"], batch_hi=hi["batch"], step_ms_lo=lo["eager_ms"],
                   step_ms_hi=hi["eager_ms"], step_growth=hi["eager_ms"] / lo["eager_ms"],
                   graph_ms_lo=lo.get("graph_ms"), graph_ms_hi=hi.get("graph_ms"),
                   best_mbu=max(max(r.get("eager_mbu", 0), r.get("graph_mbu", 0))
                                for r in decode))
    prefill = [r for r in _rows(run, "prefill") if r.get("model") == model]
    if prefill:
        out["prefill_share_of_peak"] = prefill[0]["share_of_probed_peak"]
    spec = run.get("speculative")
    if isinstance(spec, dict) and "shipped" in spec:
        out["spec_speedup"] = {p["drafter"]: p["speedup"] for p in spec["shipped"]["points"]}
    serve = [r for r in _rows(run, "serve") if r.get("model") == model]
    if serve:
        out["serve_output_tok_s"] = max(r["output_tok_s"] for r in serve)
    return out
