"""Lesson 13 — how minifer runs fast on a CPU: the measurements and figures of the appendix.

Plain functions (each testable without a notebook): a busy core for the thread experiment,
decode steps timed at a thread count, a simulated machine that drives minifer's
`ThreadGovernor`, one-row products timed per kernel, and the peers' table read from the
benchmarks' JSON files; then the figures, each a plain function a panel can call.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import plotly.graph_objects as go
import torch
import torch.nn.functional as F

import minifer
from minifer.generation import generate
from minifer.sampling import SamplingParams

from .common import sig, style

__all__ = ["busy_core", "step_ms", "thread_grid", "thread_figure", "SimulatedCPU",
           "governor_figure", "one_row_ms", "kernel_figure", "PEERS_FILE", "peer_rows",
           "peer_machine", "peer_figure", "source_lines"]

# minifer's own sources, which the lesson quotes
ENGINE = Path(minifer.__file__).resolve().parent
# the peers' results (BENCHMARKS.md cites this file), shipped with the course package so that the
# lesson reads it wherever the course is installed (Colab has no clone of the repository)
PEERS_FILE = Path(__file__).with_name("data") / "cpu-bench-2026-12-05.json"
PEERS_SECTION = "bf16 at batch 1 on minifer's own AVX512-BF16 kernel"


# ---- threads ------------------------------------------------------------------------------------
@contextlib.contextmanager
def busy_core(settle_s: float = 0.3) -> Iterator[subprocess.Popen]:
    """Another program keeping one core busy for the duration of the block: a child Python
    process that spins, ended (by its own id) when the block ends."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(settle_s)  # let it start spinning
        yield proc
    finally:
        proc.kill()
        proc.wait()


def step_ms(model: torch.nn.Module, batch: int, threads: int, steps: int = 24,
            rounds: int = 3) -> float:
    """Median ms per decode step of `generate` with ``batch`` sequences at ``threads`` torch
    threads (fixed for the call), greedy, EOS ignored."""
    params = SamplingParams(temperature=0, max_new_tokens=steps, ignore_eos=True)
    prompts = [[1 + i, 2 + i, 3 + i, 4 + i] for i in range(batch)]
    times = []
    for _ in range(rounds):
        out = generate(model, prompts, params, threads=threads)
        times.append(statistics.median(c.tpot for c in out) * 1e3)
    return statistics.median(times)


def thread_grid(model: torch.nn.Module, threads=(1, 2), batches=(1, 8), **kw) -> dict:
    """``{(busy, threads, batch): ms per decode step}``, quiet and beside `busy_core`."""
    grid = {}
    for busy in (False, True):
        with busy_core() if busy else contextlib.nullcontext():
            for b in batches:
                for t in threads:
                    grid[busy, t, b] = step_ms(model, b, t, **kw)
    return grid


def thread_figure(grid: dict, batch: int) -> go.Figure:
    """Decode ms per step at ``batch``: 1 and 2 threads, on a quiet machine and beside a busy
    core. The y axis spans the whole grid, so it stays put while the batch slider moves."""
    threads = sorted({t for _, t, _ in grid})
    top = max(grid.values()) * 1.15
    fig = go.Figure()
    for t in threads:
        ys = [grid[busy, t, batch] for busy in (False, True)]
        fig.add_trace(go.Bar(name=f"{t} thread{'s' if t > 1 else ''}",
                             x=["quiet machine", "another program busy on a core"],
                             y=[sig(y, 3) for y in ys], text=[f"{y:.1f}" for y in ys],
                             textposition="outside", cliponaxis=False))
    style(fig, f"Decode step at batch {batch}: threads against a busy core", None,
          "ms per decode step (measured)")
    fig.update_layout(barmode="group", yaxis_range=[0, top])
    return fig


class SimulatedCPU:
    """A machine whose CPU counters a cell moves by hand, for minifer's `ThreadGovernor`:
    ``run(seconds, others, ours)`` lets time pass with `others` cores busy in other programs and
    `ours` in this one (counters in clock ticks, 100 per second, as Linux counts them)."""

    def __init__(self, cpus: int = 2) -> None:
        self.cpus, self.t, self.idle, self.total, self.own = cpus, 0.0, 0.0, 0.0, 0.0

    def run(self, seconds: float, others: float, ours: float) -> None:
        self.t += seconds
        self.total += 100 * seconds * self.cpus
        self.idle += 100 * seconds * max(0.0, self.cpus - others - ours)
        self.own += seconds * ours

    def governor(self, **kw):
        """A `ThreadGovernor` that reads this machine instead of the real one."""
        from minifer.fast.threads import ThreadGovernor

        return ThreadGovernor(self.cpus, 1.0, counters=lambda: (self.idle, self.total),
                              own_cpu_s=lambda: self.own, waited_s=lambda: 0.0,
                              clock=lambda: self.t, ticks_per_s=100, **kw)


def governor_figure(timeline: list[dict]) -> go.Figure:
    """The governor's thread count over time beside the cores other programs used; rows of
    ``{"t": s, "others": cores, "threads": n}``."""
    t = [r["t"] for r in timeline]
    fig = go.Figure([
        # a row's load is the load of the half second that ends at its time: drawn before it
        go.Scatter(name="cores other programs use", x=t, y=[r["others"] for r in timeline],
                   mode="lines", line=dict(shape="vh", dash="dot")),
        go.Scatter(name="torch threads the governor sets", x=t, y=[r["threads"] for r in timeline],
                   mode="lines+markers", line=dict(shape="hv"))])
    style(fig, "minifer's thread governor on a simulated 2-core machine", "time (s)", "cores")
    fig.update_layout(yaxis_range=[-0.1, 2.4], yaxis_dtick=1)
    return fig


# ---- one-row products ---------------------------------------------------------------------------
def one_row_ms(model: torch.nn.Module, threads: int, repeats: int = 5) -> dict[str, float]:
    """ms for one row through every linear layer of ``model`` (one decode step's products at
    batch 1), per kernel: fp32 ``F.linear``; int8 W8A8 as tensor math (`w8a8_reference`) and on
    minifer's VNNI kernel; bf16 as tensor math and on minifer's AVX512-BF16 kernel; both on the
    AVX2 kernels where those two do not run; fp32 on minifer's own kernel on a CPU not Intel's
    (the kernels only where this CPU has them). The best of ``repeats``, at ``threads`` threads."""
    from minifer.fast import bf16_gemv, int8_gemv
    from minifer.fast.avx2 import AVX2
    from minifer.fast.layout import mkl_generic
    from minifer.quantization import quantize_int8, w8a8_reference

    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    mats = []
    for m in layers:
        w = m.weight.detach().contiguous()
        q, s = quantize_int8(w)
        mats.append((w, q, s, q.sum(1, dtype=torch.int32), w.bfloat16().contiguous()))
    g = torch.Generator().manual_seed(0)
    xs = {w.shape[1]: torch.randn(1, w.shape[1], generator=g) for w, *_ in mats}
    runs = {"fp32 F.linear": lambda w, q, s, r, wb: F.linear(xs[w.shape[1]], w),
            "int8 tensor math": lambda w, q, s, r, wb: w8a8_reference(xs[w.shape[1]], q, s),
            "bf16 tensor math": lambda w, q, s, r, wb: bf16_gemv.bf16_reference(
                xs[w.shape[1]].bfloat16(), wb)}
    if int8_gemv.GEMV.available():
        runs["int8 kernel (VNNI)"] = lambda w, q, s, r, wb: int8_gemv.GEMV(xs[w.shape[1]], q, s, r)
    if bf16_gemv.GEMV.available():
        runs["bf16 kernel (AVX512-BF16)"] = lambda w, q, s, r, wb: bf16_gemv.GEMV(
            xs[w.shape[1]].bfloat16(), wb)
    if not (int8_gemv.GEMV.available() and bf16_gemv.GEMV.available()) and AVX2.available():
        runs["int8 kernel (AVX2)"] = lambda w, q, s, r, wb: AVX2.w8a8(xs[w.shape[1]], q, s)
        runs["bf16 kernel (AVX2)"] = lambda w, q, s, r, wb: AVX2.bf16(xs[w.shape[1]].bfloat16(), wb)
    if mkl_generic() and AVX2.available():  # a CPU not Intel's: fp32 layers' few rows run it
        runs["fp32 kernel (minifer's)"] = lambda w, q, s, r, wb: AVX2.f32(xs[w.shape[1]], w)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        best = {k: float("inf") for k in runs}
        for i in range(repeats + 1):
            for name, fn in runs.items():
                t0 = time.perf_counter()
                for mat in mats:
                    fn(*mat)
                if i:  # the first pass warms up (and builds a kernel)
                    best[name] = min(best[name], time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return {k: v * 1e3 for k, v in best.items()}


def kernel_figure(ms_by_threads: dict[int, dict[str, float]], threads: int) -> go.Figure:
    """One decode step's products at batch 1, per kernel, at ``threads`` (y axis fixed over all
    the thread counts measured)."""
    ms = ms_by_threads[threads]
    top = max(v for d in ms_by_threads.values() for v in d.values()) * 1.2
    names = list(ms)
    fig = go.Figure(go.Bar(x=[n.replace(" (", "<br>(") for n in names], y=[sig(ms[n], 3) for n in names],
                           text=[f"{ms[n]:.2f}" for n in names], textposition="outside",
                           cliponaxis=False))
    style(fig, f"One row through every matrix of the model, {threads} thread(s)", None,
          "ms (measured, best of the repeats)")
    fig.update_layout(yaxis_range=[0, top])
    return fig


def source_lines(path: str | Path, start: str, count: int) -> str:
    """``count`` lines of a source file from the first line containing ``start``: the few lines
    that matter, not the file."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    i = next(n for n, line in enumerate(lines) if start in line)
    return "\n".join(lines[i:i + count])


# ---- the peers ----------------------------------------------------------------------------------
_CELL = re.compile(r"^\**([\d.]+)(?: \(([^)]*)\))?\**$")


def _number(text: str) -> tuple[float | None, str]:
    text = text.strip().strip("*").strip()
    if text in ("—", "-", ""):
        return None, ""
    m = _CELL.match(text)
    if m is None:
        raise ValueError(f"not a tokens/s cell: {text!r}")
    return float(m.group(1)), m.group(2) or ""


def _section(path: Path) -> dict:
    records = json.loads(Path(path).read_text(encoding="utf-8"))["records"]
    return next(r for r in records if r["section"].startswith(PEERS_SECTION))


def peer_rows(path: str | Path = PEERS_FILE) -> list[dict]:
    """The stored comparison with CTranslate2 and OpenVINO GenAI (tokens/s, GPT-2 124M), one row
    per precision, batch and thread count: ``{"precision", "batch", "threads", "minifer",
    "minifer runs", "CTranslate2", "OpenVINO"}`` (None where a peer has no such precision)."""
    table = next(t for t in _section(Path(path))["tables"]
                 if t["columns"][2].startswith("2 threads: minifer / CT2 / OpenVINO"))
    rows = []
    for r in table["rows"]:
        for threads, col in ((2, 2), (1, 4)):
            cells = [_number(c) for c in r[col].split(" / ")]
            rows.append({"precision": r[0], "batch": int(r[1]), "threads": threads,
                         "minifer": cells[0][0], "minifer runs": cells[0][1],
                         "CTranslate2": cells[1][0], "OpenVINO": cells[2][0]})
    return rows


def peer_machine(path: str | Path = PEERS_FILE) -> str:
    """Where and when the stored comparison ran: the machine its notes name (the first
    parenthesis: CPU, versions), and its date."""
    rec = _section(Path(path))
    notes = rec["notes"] if isinstance(rec["notes"], str) else " ".join(rec["notes"])
    machine = re.search(r"\(([^)]*)\)", " ".join(notes.split())).group(1)
    return f"{machine}; {rec['date']}"


ENGINES = ("minifer", "CTranslate2", "OpenVINO")


def peer_figure(rows: list[dict], threads: int) -> go.Figure:
    """Tokens/s of minifer and its peers per precision and batch at ``threads`` threads (log y
    axis, the same range for every thread count)."""
    shown = [r for r in rows if r["threads"] == threads]
    x = [f"{r['precision']}<br>batch {r['batch']}" for r in shown]
    fig = go.Figure([go.Bar(name=e, x=x, y=[r[e] for r in shown]) for e in ENGINES])
    values = [r[e] for r in rows for e in ENGINES if r[e]]
    style(fig, f"GPT-2 124M on another machine, {threads} thread(s): tokens/s", None,
          "tokens/s (stored benchmark)")
    fig.update_layout(barmode="group", yaxis_type="log")
    fig.update_yaxes(range=[math.log10(min(values)) - 0.1, math.log10(max(values)) + 0.1],
                     tickvals=[20, 50, 100, 200, 500, 1000, 2000],
                     ticktext=["20", "50", "100", "200", "500", "1k", "2k"])
    return fig
