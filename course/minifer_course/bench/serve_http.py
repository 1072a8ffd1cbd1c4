"""The standard serving load over HTTP, server against server: ``python -m minifer_course.bench serve
--http``.

Each run starts a fresh ``python -m minifer.serve`` process (one checkout or another, one
``--threads`` or ``--engine-in`` setting or another), waits for ``/health``, sends a warm-up of 8 requests, then
the measured load with `serve_load.run_load` (streaming clients, greedy, ``ignore_eos``, token
ids as prompts so every server sees the same tokens), and stops the server. The variants take
turns within every round, on the quiet machine and beside a background load
(`bench.threads.background_load`: processes that keep cores busy), so a slow spell of the
machine hits all of them. Reported per variant and load: medians over the rounds of output
tokens/s, mean TTFT and TPOT median / p99 (vLLM's serving-benchmark metrics), output
tokens/s against the first variant on the quiet machine, and where the CPU went during the
load (read from ``/proc`` on Linux): the server's CPU milliseconds per output token, counting
its engine processes, and the cores the server, the client and the background load kept busy.
A server that uses no more CPU per token beside a busy core than on the quiet machine wastes
nothing waiting; what it then loses is the share of the cores the background load takes.
"""

from __future__ import annotations

import functools
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from minifer.checks import check_int

from .common import cpu_seconds
from .serve_load import make_requests, run_load
from .threads import background_load

try:
    import resource
except ImportError:  # not on Windows
    resource = None

__all__ = ["Variant", "HttpRow", "free_port", "checkout_root", "server_takes", "serve_once", "compare", "format_http"]


@dataclass(frozen=True)
class Variant:
    """A server to start: the checkout on ``PYTHONPATH`` (None: this one), its ``--threads``
    (None: the server's default), its ``--engine-in`` and its ``--engine-replicas`` (None:
    the server's default)."""

    label: str
    root: str | None = None
    threads: int | str | None = None
    engine_in: str | None = None
    replicas: int | None = None


@dataclass
class HttpRow:
    """One variant under one background load at one rate: each round's summary."""

    variant: Variant
    busy_cores: int
    rate: float
    runs: list[dict] = field(default_factory=list)

    def median(self, key: str, stat: str | None = None) -> float:
        vals = [r[key][stat] if stat else r[key] for r in self.runs]
        return statistics.median(vals)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server at {url} was not ready within {timeout_s:g} s")


@functools.cache
def checkout_root(root: str) -> str:
    """`root` made absolute, once checked to be where ``PYTHONPATH=root`` imports `minifer`
    from (an installed copy could win instead, and the run would measure the wrong engine)."""
    root = os.path.abspath(root)
    where = subprocess.run([sys.executable, "-c", "import minifer; print(minifer.__file__)"],
                           env=dict(os.environ, PYTHONPATH=root), cwd=root,
                           capture_output=True, text=True).stdout.strip()
    if not os.path.abspath(where).startswith(root + os.sep):
        raise RuntimeError(f"PYTHONPATH={root} imports minifer from {where or 'nowhere'}, not "
                           f"from that checkout")
    return root


def server_takes(root: str | None, option: str) -> bool:
    """Whether the ``python -m minifer.serve`` of checkout `root` (None: this one) has
    `option` (an older checkout may not)."""
    return option in _server_usage(root)


@functools.cache
def _server_usage(root: str | None) -> str:
    """The ``--help`` text of checkout `root`'s server: one process (which imports torch)
    per checkout, however many options are asked about."""
    env = dict(os.environ)
    if root is not None:
        env["PYTHONPATH"] = checkout_root(root)
    return subprocess.run([sys.executable, "-m", "minifer.serve", "--help"], env=env,
                          cwd=root or None, capture_output=True, text=True).stdout


def serve_once(variant: Variant, requests: list, *, model: str = "shakespeare",
               max_num_seqs: int = 32, warmup: int = 8, timeout_s: float = 600.0,
               background: list[int] = ()) -> dict:
    """Start `variant`'s server, warm it up, run `requests` (``make_requests``'s tuples)
    against it, stop it; returns the load's summary, with ``"cpu"``: the CPU seconds the
    server (with its engine processes), this client and the `background` processes used
    during the measured load, and its wall time (Linux; None elsewhere)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "minifer.serve", "--model", model, "--port", str(port),
           "--max-num-seqs", str(max_num_seqs), "--max-waiting", str(max(len(requests), 64)),
           "--log-level", "warning"]
    if variant.threads is not None:
        cmd += ["--threads", str(variant.threads)]
    if variant.engine_in is not None:
        cmd += ["--engine-in", variant.engine_in]
    if variant.replicas is not None:
        cmd += ["--engine-replicas", str(variant.replicas)]
    env = dict(os.environ)
    if variant.root is not None:
        env["PYTHONPATH"] = checkout_root(variant.root)
    with tempfile.TemporaryFile("w+") as log:  # a file, not a pipe: a pipe nobody reads fills up
        proc = subprocess.Popen(cmd, env=env, cwd=variant.root or None,
                                stdout=subprocess.DEVNULL, stderr=log, text=True)
        try:
            try:
                _wait_healthy(url, proc, 120.0)
            except RuntimeError as err:
                log.seek(0)
                raise RuntimeError(f"{variant.label}: {err}\n{log.read()[-2000:]}") from None
            if warmup:
                run_load(url, [(r[0], 8, 0.0) for r in requests[:warmup]], timeout_s=timeout_s)
            before = _cpu_readings(proc.pid, background)
            wall = time.perf_counter()
            result = run_load(url, requests, timeout_s=timeout_s)
            wall = time.perf_counter() - wall
            after = _cpu_readings(proc.pid, background)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    if result.errors:
        raise RuntimeError(f"{variant.label}: {len(result.errors)} requests failed: "
                           f"{result.errors[:3]}")
    cpu = {"wall_s": wall}
    for key in before:
        cpu[key] = None if before[key] is None else after[key] - before[key]
    return {**result.summary, "cpu": cpu}


def _cpu_readings(server: int, background: list[int]) -> dict:
    """CPU seconds so far: the server's process tree, this process (the client), the
    background load's processes."""
    own = resource.getrusage(resource.RUSAGE_SELF) if resource else None
    return {"server_s": cpu_seconds([server]),
            "client_s": own.ru_utime + own.ru_stime if own else None,
            "background_s": cpu_seconds(list(background), descendants=False) if background
            else 0.0}


def compare(variants: list[Variant], *, rates: tuple[float, ...] = (float("inf"),),
            busy_cores: tuple[int, ...] = (0,), rounds: int = 3, num_requests: int = 100,
            prompt_len: int = 64, output_len: int = 64, model: str = "shakespeare",
            max_num_seqs: int = 32, seed: int = 0, on_run=None) -> list[HttpRow]:
    """Every variant once per round, in turn, for each load and rate; `rounds` rounds."""
    check_int("rounds", rounds, 1)
    check_int("num_requests", num_requests, 1)
    rows = {(v, b, r): HttpRow(v, b, r) for r in rates for b in busy_cores for v in variants}
    loads = {r: make_requests(num_requests, r, prompt_len=(prompt_len, prompt_len),
                              output_len=(output_len, output_len), seed=seed,
                              prompt_format="ids") for r in rates}
    for i in range(rounds):
        for rate in rates:
            for b in busy_cores:
                with background_load(b) as spinners:
                    for v in variants:
                        summary = serve_once(v, loads[rate], model=model,
                                             max_num_seqs=max_num_seqs, background=spinners)
                        rows[v, b, rate].runs.append(summary)
                        if on_run is not None:
                            on_run(i, rows[v, b, rate], summary)
    return list(rows.values())


def format_http(rows: list[HttpRow], header: str = "") -> str:
    """A table per rate: output tok/s, mean TTFT, TPOT median / p99 (medians over rounds),
    output tok/s ÷ the first variant's on the quiet machine, and where the CPU went (medians
    over rounds): the server's CPU milliseconds per output token (all its processes), and the
    cores the server, the client and the background load kept busy on average."""
    lines = [header] if header else []
    for rate in sorted({r.rate for r in rows}):
        base_row = next((r for r in rows if r.rate == rate and r.busy_cores == 0), None)
        base = base_row.median("output_throughput") if base_row else None
        lines += ["", f"rate {rate:g} req/s"
                  f" (÷ {base_row.variant.label} on the quiet machine)" if base_row else "",
                  f"{'server':<28} {'busy':>4} {'out tok/s':>10} {'per round':>22} "
                  f"{'TTFT mean':>10} {'TPOT med/p99 ms':>16} {'÷ base':>7} "
                  f"{'CPU ms/tok':>10} {'cores srv/cli/bg':>17}"]
        for r in (r for r in rows if r.rate == rate):
            tput = r.median("output_throughput")
            per = ", ".join(f"{x['output_throughput']:.0f}" for x in r.runs)
            tpot = f"{r.median('tpot', 'median') * 1e3:.0f} / {r.median('tpot', 'p99') * 1e3:.0f}"
            ratio = f"{tput / base:.2f}" if base else "-"
            per_token, cores = _cpu_columns(r)
            lines.append(f"{r.variant.label:<28} {r.busy_cores:>4} {tput:>10.0f} {per:>22} "
                         f"{r.median('ttft', 'mean'):>9.2f}s {tpot:>16} {ratio:>7} "
                         f"{per_token:>10} {cores:>17}")
    return "\n".join(lines)


def _cpu_columns(row: HttpRow) -> tuple[str, str]:
    """The server's CPU ms per output token and the cores each side kept busy, as text ("-"
    where a reading is missing: not Linux, or a summary without ``"cpu"``)."""
    cpus = [r.get("cpu") for r in row.runs]
    if not cpus or any(c is None or c.get("server_s") is None for c in cpus):
        return "-", "-"
    per_token = statistics.median(1e3 * c["server_s"] / max(1, r["output_tokens"])
                                  for c, r in zip(cpus, row.runs))
    cores = [statistics.median((c[k] or 0.0) / c["wall_s"] for c in cpus)
             for k in ("server_s", "client_s", "background_s")]
    return f"{per_token:.2f}", "/".join(f"{x:.2f}" for x in cores)
