"""Lesson 13 builders: the busy core, step timing, the simulated governor, one-row kernels,
the peers' table read from benchmarks/, and the figures (fixed axes while a slider moves)."""

from __future__ import annotations

import json
import pathlib

import plotly.graph_objects as go
import torch

import minifer as mf
from minifer_course.lessons import fast_cpu as F13


def test_busy_core_runs_a_process_and_ends_it():
    with F13.busy_core(settle_s=0.05) as proc:
        assert proc.poll() is None
    assert proc.poll() is not None


def test_step_ms_and_thread_figure_keep_their_axis():
    model = mf.GPT.from_config("tiny", seed=0).eval()
    ms = F13.step_ms(model, batch=2, threads=1, steps=4, rounds=1)
    assert ms > 0
    grid = {(busy, t, b): 1.0 + busy + t + b for busy in (False, True) for t in (1, 2)
            for b in (1, 8)}
    a, b = F13.thread_figure(grid, 1), F13.thread_figure(grid, 8)
    assert isinstance(a, go.Figure) and a.layout.yaxis.range == b.layout.yaxis.range
    assert [t.name for t in a.data] == ["1 thread", "2 threads"]


def test_the_simulated_cpu_drives_minifers_governor():
    saved = torch.get_num_threads()
    try:
        cpu = F13.SimulatedCPU(2)
        torch.set_num_threads(2)
        g = cpu.governor()
        assert g.maybe_adjust() is None
        cpu.run(1.0, others=1.0, ours=1.0)
        assert g.maybe_adjust() == 1
        cpu.run(1.0, others=0.0, ours=1.0)
        assert g.maybe_adjust() == 2
    finally:
        torch.set_num_threads(saved)
    fig = F13.governor_figure([{"t": 0.0, "others": 0.0, "threads": 2},
                               {"t": 0.5, "others": 1.0, "threads": 1}])
    assert len(fig.data) == 2 and list(fig.layout.yaxis.range) == [-0.1, 2.4]


def test_one_row_ms_and_kernel_figure():
    model = mf.GPT.from_config("tiny", seed=0).eval()
    ms = F13.one_row_ms(model, threads=1, repeats=1)
    assert {"fp32 F.linear", "int8 tensor math", "bf16 tensor math"} <= set(ms)
    assert all(v > 0 for v in ms.values())
    both = {1: ms, 2: {k: v / 2 for k, v in ms.items()}}
    assert F13.kernel_figure(both, 1).layout.yaxis.range == F13.kernel_figure(both, 2).layout.yaxis.range


def test_source_lines():
    text = F13.source_lines(F13.ENGINE / "fast" / "csrc" / "int8_gemv.cpp",
                            "__m512i a = _mm512_setzero_si512();", 5)
    assert len(text.splitlines()) == 5 and "_mm_prefetch" in text and "dpbusd" in text


def test_peer_rows_read_the_stored_benchmark():
    rows = F13.peer_rows()
    assert len(rows) == 18
    first = rows[0]
    assert first == {"precision": "fp32", "batch": 1, "threads": 2, "minifer": 47.0,
                     "minifer runs": "compiled", "CTranslate2": 36.4, "OpenVINO": 52.7}
    assert rows[1]["threads"] == 1 and rows[1]["minifer"] == 27.2
    bf16 = [r for r in rows if r["precision"] == "bf16"]
    assert bf16 and all(r["CTranslate2"] is None and r["OpenVINO"] for r in bf16)
    assert bf16[0]["minifer runs"] == "prepacked"
    where = F13.peer_machine()
    assert "Xeon" in where and "2026-12-05" in where
    one, two = F13.peer_figure(rows, 1), F13.peer_figure(rows, 2)
    assert one.layout.yaxis.range == two.layout.yaxis.range
    assert [t.name for t in one.data] == ["minifer", "CTranslate2", "OpenVINO"]


def test_the_peers_file_is_stored_once_with_the_course_and_cited():
    """Lesson 13 reads the peers' results from the course package (it runs where there is no
    clone, e.g. Colab); BENCHMARKS.md cites that file, and no second copy is kept."""
    root = pathlib.Path(__file__).resolve().parents[1]
    cited = str(F13.PEERS_FILE.relative_to(root))
    assert cited in (root / "BENCHMARKS.md").read_text(encoding="utf-8")
    assert json.loads(F13.PEERS_FILE.read_text(encoding="utf-8"))["records"]
    assert not (root / "benchmarks" / "2026-12-05-cpu-bench.json").exists()
