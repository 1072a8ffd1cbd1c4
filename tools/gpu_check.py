"""The GPU check (`make test-gpu`): every CUDA path of minifer, then the GPU benchmark.

    python tools/gpu_check.py [--out DIR] [--budget-s 480]

1. The tests' cuda cases (`pytest -m cuda` over `GPU_TESTS`: the tests that take
   tests/conftest.py's `device` fixture): cache == recompute, batched == alone, greedy parity
   with transformers, speculative decoding's greedy exactness and sampling distribution, the
   serving engine equal to one request at a time under preemption, every precision (bf16, fp16,
   int8, int4) and the int8 KV cache, the fixed-shape step and the compiled step (a CUDA graph)
   equal to eager, and the Llama/Qwen families' parity with transformers.
2. ``python -m minifer_course.bench gpu`` (see `minifer_course.bench.gpu`).

Everything lands in `--out` (default: ``$OUT``, else ``gpu-check/``) as it happens:
``gpu-tests.log`` and ``gpu-tests.xml`` (JUnit), ``gpu-bench.json`` and ``gpu-bench.log``, and
``gpu-check.json`` (what ran, exit codes, times), so a run cut off keeps what it measured. It runs
from a plain checkout (the repository root goes on ``PYTHONPATH``; nothing is installed) with
torch, numpy, tokenizers, safetensors, tqdm, pytest and hypothesis (transformers for the parity
test). On a machine without CUDA it says so and exits 0. Store a run's results with
``python tools/gpu_check.py --store DIR/gpu-bench.json`` (into ``benchmarks/``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The test modules with cases on the `device` fixture (tests/test_gpu_check.py keeps this list
# equal to the modules that use it).
GPU_TESTS = (
    "tests/test_model.py",
    "tests/test_generate.py",
    "tests/test_fast_decode.py",
    "tests/test_hf.py",
    "tests/test_speculative.py",
    "tests/test_serve_engine.py",
    "tests/test_engine_speculative.py",
    "tests/test_quantize.py",
    "tests/test_families.py",
    "tests/test_batch_invariant.py",
)


def pytest_command(junit: Path | None = None) -> list[str]:
    """pytest over the cuda cases only, without the project's nbval options (a GPU machine need
    not have nbval)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-m", "cuda", "-o", "addopts=",
           "-p", "no:cacheprovider", "--durations=10"]
    if junit is not None:
        cmd += ["--junitxml", str(junit)]
    return cmd + list(GPU_TESTS)


def _env() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def run_logged(cmd: list[str], log: Path, timeout_s: float) -> tuple[int, float]:
    """Run `cmd` in the repository root, its output printed and appended to `log` line by line;
    stopped (its whole process group) after `timeout_s`. Returns (exit code, seconds); 124 for a
    run stopped at its limit."""
    t0 = time.monotonic()
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        stopped = threading.Event()

        def stop() -> None:  # a silent hang is stopped too, not only a chatty one
            stopped.set()
            os.killpg(proc.pid, signal.SIGKILL)

        timer = threading.Timer(timeout_s, stop)
        timer.start()
        try:
            for line in proc.stdout:
                sys.stdout.write(line)
                f.write(line)
                f.flush()
            proc.wait()
        finally:
            timer.cancel()
        if stopped.is_set():
            f.write(f"(stopped after {timeout_s:.0f} s)\n")
            return 124, time.monotonic() - t0
    return proc.returncode, time.monotonic() - t0


def _counts(log: Path) -> dict:
    """pytest's closing line ("3 failed, 97 passed, 2 skipped in 80.1s") as numbers."""
    text = log.read_text() if log.is_file() else ""
    found = re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected)", text)
    return {word: int(n) for n, word in found}


def store(result_file: Path, directory: Path = ROOT / "benchmarks") -> Path:
    """Copy a run's ``gpu-bench.json`` into `directory` as ``gpu-<date>-<gpu>.json``."""
    data = json.loads(Path(result_file).read_text())
    m = data.get("machine", {})
    slug = re.sub(r"[^a-z0-9]+", "-", str(m.get("gpu") or m.get("device", "gpu")).lower()).strip("-")
    target = Path(directory) / f"gpu-{str(m.get('date', 'undated'))[:10]}-{slug}.json"
    target.write_text(json.dumps(data, indent=1) + "\n")
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu-check",
                    help="folder for the logs and results (default: $OUT, else gpu-check/)")
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="the whole check's seconds (default 480): tests up to 45%% of it, "
                    "the benchmark the rest")
    ap.add_argument("--skip-tests", action="store_true", help="the benchmark only")
    ap.add_argument("--skip-bench", action="store_true", help="the tests only")
    ap.add_argument("--device", default="cuda",
                    help="cpu: the same plumbing on a CPU (the cuda cases skip, the benchmark "
                    "runs --quick); the suite tests it so")
    ap.add_argument("--store", metavar="GPU_BENCH_JSON",
                    help="copy a run's gpu-bench.json into benchmarks/ and exit")
    args = ap.parse_args(argv)
    if args.store:
        print(f"stored {store(Path(args.store))}")
        return 0
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        why = ("this torch is built without CUDA" if torch.version.cuda is None
               else "no CUDA GPU is visible")
        print(f"gpu check: {why} (torch {torch.__version__}): nothing to check here. On a GPU "
              f"machine this runs the tests' cuda cases and `python -m minifer_course.bench gpu`.")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else None
    summary: dict = {"gpu": gpu, "device": args.device, "torch": torch.__version__,
                     "cuda": torch.version.cuda, "budget_s": args.budget_s}

    def save() -> None:
        summary["elapsed_s"] = round(time.monotonic() - start, 1)
        (out / "gpu-check.json").write_text(json.dumps(summary, indent=1) + "\n")

    save()
    if not args.skip_tests:
        log = out / "gpu-tests.log"
        rc, secs = run_logged(pytest_command(out / "gpu-tests.xml"), log, 0.45 * args.budget_s)
        summary["tests"] = {"exit": rc, "seconds": round(secs, 1), **_counts(log)}
        save()
    if not args.skip_bench:
        left = args.budget_s - (time.monotonic() - start)
        # the compiled steps stop starting a minute before the end (one may take that long)
        cmd = [sys.executable, "-m", "minifer_course.bench", "gpu", "--device", args.device, "--out",
               str(out), "--budget-s", str(max(0.0, left - 75))]
        rc, secs = run_logged(cmd, out / "gpu-bench-stdout.log", left)
        summary["bench"] = {"exit": rc, "seconds": round(secs, 1)}
        save()
    tests_ok = args.skip_tests or summary["tests"]["exit"] == 0
    bench_ok = args.skip_bench or summary["bench"]["exit"] == 0
    print(f"gpu check: tests {'skipped' if args.skip_tests else summary['tests']}, "
          f"bench {'skipped' if args.skip_bench else summary['bench']}; results in {out}/")
    return 0 if tests_ok and bench_ok else 1


if __name__ == "__main__":
    sys.exit(main())
