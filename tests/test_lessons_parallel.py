"""The multi-device lesson: the analytic figures carry PAR-1/PAR-2's numbers, sliders drive them,
and the measured tables read `run_local`'s reports faithfully."""

from __future__ import annotations

import math

import pytest

from minifer.distributed.parallel import RankReport, TPResult
from minifer_course import roofline as rl
from minifer_course.lessons import parallel as P


def controls(ui) -> dict:
    return {w.description: w for w in ui.children if hasattr(w, "description") and w.description}


def trace(fig, name: str):
    return next(t for t in fig.data if t.name == name)


def test_allreduce_time_is_the_ring_formula():
    assert rl.allreduce_time(1e6, 1, 1e9, 1e-6) == 0.0
    assert rl.allreduce_time(1e6, 2, 1e9) == pytest.approx(1e-3)  # 2·1/2 · 1 MB / 1 GB/s
    assert rl.allreduce_time(8e6, 8, 1e9, 1e-6) == pytest.approx(14e-6 + 14 / 8 * 8e-3)
    with pytest.raises(ValueError, match="world"):
        rl.allreduce_time(1.0, 0, 1e9)
    with pytest.raises(ValueError, match="bandwidth"):
        rl.allreduce_time(1.0, 2, 0)


def test_tp_decode_splits_memory_and_adds_communication():
    one, eight = (rl.tp_decode("llama-2-70b", "h100", d, "nvlink-h100", context=4096) for d in (1, 8))
    assert not one.fits and eight.fits  # 140 GB of weights: PAR-1, split to fit
    assert eight.weight_bytes_per_device == 140e9 / 8
    assert eight.kv_bytes_per_device == one.kv_bytes_per_device / 8
    assert one.comm_s == 0 and eight.allreduces_per_step == 160
    assert eight.allreduce_bytes == 8192 * 2
    assert eight.tpot_s == pytest.approx(max(eight.read_s, eight.compute_s) + eight.comm_s)
    sixteen_kv = rl.tp_decode("llama-2-70b-mha", "h100", 16, context=4096)
    assert sixteen_kv.kv_bytes_per_device == pytest.approx(
        rl.kv_cache_bytes("llama-2-70b-mha", 4096) / 16)
    with pytest.raises(ValueError, match="degree must divide n_head=64"):
        rl.tp_decode("llama-2-70b", "h100", 3)
    with pytest.raises(ValueError, match="unknown interconnect"):
        rl.tp_decode("llama-2-70b", "h100", 2, "carrier-pigeon")


def test_pcie_makes_degree_8_slower_than_4():
    nv = {t.degree: t.tpot_ms for t in rl.tp_table("llama-2-70b", "h100", link="nvlink-h100")}
    pcie = {t.degree: t.tpot_ms for t in rl.tp_table("llama-2-70b", "h100", link="pcie-4")}
    assert nv[8] < nv[4] < nv[2]
    assert pcie[4] < pcie[8]


def test_tp_figure_title_and_traces():
    fig = P.tp_figure(degree=8, bandwidth_gbs=450, batch=1)
    title = fig.layout.title.text
    assert "17.7 GB per device (fits)" in title and "7.52 ms/token" in title
    assert list(trace(fig, "weights").y) == [140.0, 70.0, 35.0, 17.5]
    assert trace(fig, "all-reduce").y[0] == 0
    assert "does NOT fit" in P.tp_figure(degree=1).layout.title.text
    # the TP labels sit at their curves' first points: on a log axis that is log10 of the value
    curves = {t.name: t for t in fig.data if t.xaxis == "x3"}
    for a in (a for a in fig.layout.annotations if a.text.startswith("TP")):
        first = curves[f"degree {a.text[2:]}"]
        assert a.x == pytest.approx(math.log10(first.x[0]), rel=1e-5)
        assert a.y == pytest.approx(math.log10(first.y[0]), rel=1e-5)
    assert fig.layout.xaxis3.type == "log" and len(fig.layout.xaxis3.tickvals) >= 2
    with pytest.raises(ValueError, match="degree must be one of"):
        P.tp_figure(degree=3)
    with pytest.raises(ValueError, match="bandwidth_gbs"):
        P.tp_figure(bandwidth_gbs=0)


def test_best_degree_depends_on_the_goal():
    best = P.best_degrees(450, batch=1)
    assert best == {"lowest latency": 8, "highest throughput per device": 2}  # PAR-2
    assert P.best_degrees(16, batch=64, latency_us=5)["lowest latency"] == 4
    assert P.best_degrees(450, batch=64, latency_us=5)["lowest latency"] == 8


def test_panel_drives_the_callback():
    ui = P.panel()
    c = controls(ui)
    assert set(c) >= {"TP degree", "link GB/s", "link latency µs", "batch"}
    assert "degree 8:" in ui.result.layout.title.text
    c["TP degree"].value = 4
    assert "degree 4: 35.3 GB per device" in ui.result.layout.title.text
    slow = ui.result.layout.title.text
    c["link GB/s"].value = 8
    c["batch"].value = 64
    assert ui.result.layout.title.text != slow and "batch 64" in ui.result.layout.title.text


def _fake_results() -> dict:
    def rep(rank, world, heads, sharded):
        return RankReport(rank=rank, world_size=world, device="cpu", q_heads=heads,
                          kv_heads=heads, mlp_units=(0, 10), weight_bytes={
                              "sharded": sharded, "replicated": 100, "total": sharded + 100},
                          kv_bytes=sharded // 10, token_ids=[[1, 2]], finish_reasons=["length"],
                          decode_steps=4, decode_s=0.4, decode_comm_s=0.1,
                          allreduce_calls_per_step=4 if world > 1 else 0,
                          allreduce_bytes_per_step=512 if world > 1 else 0)
    return {1: TPResult([[1, 2]], [rep(0, 1, (0, 4), 1000)], [1], 1.0),
            2: TPResult([[1, 2]], [rep(0, 2, (0, 2), 500), rep(1, 2, (2, 4), 500)], [2, 3], 1.0)}


def test_memory_rows_text_and_figure():
    res = _fake_results()
    rows = P.memory_rows(res)
    assert [(r["ranks"], r["rank"], r["heads"]) for r in rows] == [(1, 0, "0-3"), (2, 0, "0-1"),
                                                                   (2, 1, "2-3")]
    assert rows[1]["sharded weights B"] * 2 == rows[0]["sharded weights B"]
    assert "all-reduced B/token" in P.memory_text(res)
    fig = P.memory_figure(res, unit=1)
    assert list(trace(fig, "sharded weights (blocks)").y) == [1000, 500, 500]
    t = P.timing_rows(res)
    assert t[0]["compute ms/token"] == pytest.approx(75.0)
    assert t[0]["share in communication"] == pytest.approx(0.25)


def test_best_throughput_rows_read_the_tradeoff_off_the_figure():
    rows = {r["TP degree"]: r for r in P.best_throughput_rows()}
    assert sorted(rows) == [2, 4, 8]  # 70B in bf16 does not fit on one 80 GB device
    assert rows[2]["largest batch that fits"] == 8 and rows[2]["best tok/s per device"] == 174.9
    assert rows[4]["at batch"] == 128 and rows[4]["best tok/s per device"] == 1262.5
    assert rows[8]["ms/token there"] < rows[4]["ms/token there"]  # more devices: lower latency
