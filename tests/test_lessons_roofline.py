"""The roofline and KV-memory lessons: figures carry the claims' numbers, sliders drive them."""

from __future__ import annotations

import pytest

from minifer_course import roofline as rl
from minifer_course.lessons import kv_memory, roofline


def controls(ui) -> dict:
    return {w.description: w for w in ui.children if hasattr(w, "description") and w.description}


def trace(fig, name: str):
    return next(t for t in fig.data if t.name == name)


# ---------------------------------------------------------------- roofline lesson

def test_decode_figure_batch_1_and_512_match_pd8():
    fig = roofline.decode_figure("llama-3-8b", "bf16", 1, "illustrative")
    assert "TPOT 5.33 ms, memory-bound" in fig.layout.title.text
    assert "188 tok/s total" in fig.layout.title.text
    tpot = dict(zip(trace(fig, "TPOT").x, trace(fig, "TPOT").y, strict=True))
    assert round(tpot[1], 2) == 5.33 and round(tpot[512], 2) == 8.19
    assert round(tpot[1024], 2) == 16.38
    total = dict(zip(trace(fig, "tok/s total").x, trace(fig, "tok/s total").y, strict=True))
    assert total[512] == total[1024] == 62_500 and total[256] == 48_000
    roof = trace(fig, "roof")
    assert round(roof.x[1]) == 333 and roof.y[1] == 1000  # ridge at 1,000 TFLOP/s
    point = trace(fig, "batch 1")
    assert point.x == (1.0,)

    fig = roofline.decode_figure(batch=512)
    assert "TPOT 8.19 ms, compute-bound, 62,500 tok/s" in fig.layout.title.text


def test_decode_figure_context_adds_kv_reads():
    plain = roofline.decode_figure(batch=8, context=0)
    long = roofline.decode_figure(batch=8, context=32768)
    assert trace(long, "TPOT").y[3] > trace(plain, "TPOT").y[3]  # batch 8 is BATCHES[3]


def test_decode_panel_drives_the_callback():
    ui = roofline.panel()
    c = controls(ui)
    assert set(c) >= {"model", "weights", "batch", "hardware", "context"}
    assert "TPOT 5.33 ms" in ui.result.layout.title.text
    c["batch"].value = 1024
    assert "TPOT 16.38 ms, compute-bound" in ui.result.layout.title.text
    c["weights"].value = "int4"
    assert ui.kwargs["precision"] == "int4"
    c["batch"].value = 1
    assert "TPOT 1.33 ms" in ui.result.layout.title.text  # 4 GB at 3 TB/s (QUANT-2)
    c["hardware"].value = "h100"
    c["model"].value = "6.74b"
    c["weights"].value = "bf16"
    assert "TPOT 4.02 ms" in ui.result.layout.title.text  # PD-4: ~4.0 ms


def test_prefill_figure_pd7_and_panel():
    fig = roofline.prefill_figure("llama-3-8b", "bf16", 2000, "illustrative")
    assert "32 TFLOP, TTFT 32.00 ms, compute-bound" in fig.layout.title.text
    read = trace(fig, "read weights")
    assert set(read.y) == {5.33333}
    ui = roofline.prefill_panel()
    controls(ui)["prompt"].value = 100
    assert "memory-bound" in ui.result.layout.title.text


def test_pd8_rows_text_and_table():
    rows = roofline.pd8_rows()
    assert [(r["batch"], r["TPOT ms"], r["bound"], r["tok/s total"]) for r in rows] == [
        (1, 5.33, "memory", 188), (8, 5.33, "memory", 1500), (32, 5.33, "memory", 6000),
        (128, 5.33, "memory", 24000), (256, 5.33, "memory", 48000),
        (512, 8.19, "compute", 62500), (1024, 16.38, "compute", 62500)]
    text = roofline.pd8_text()
    assert "62,500" in text and "16.38" in text and "8.192" in text
    fig = roofline.pd8_table_figure()
    assert fig.data[0].header.values[0] == "batch"
    assert fig.data[0].cells.values[-1][-1] == "62,500"


def test_unknown_preset_in_a_figure_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown model"):
        roofline.decode_figure(model="gpt-9")


# ---------------------------------------------------------------- KV-memory lesson

def test_kv_figure_kv6_numbers():
    fig = kv_memory.kv_figure(context=4096, batch=32, precision="fp16", model="llama-3-8b",
                              hardware="a100-80gb")
    title = fig.layout.title.text
    assert "131,072 B = 128 KiB per token" in title
    assert "= 16.00 GiB" in title and "119 sequences of 4,096 tokens fit" in title
    assert trace(fig, "KV cache").y == (16.0,)  # the stacked bar, GiB
    curve = trace(fig, "KV cache by context")
    assert dict(zip(curve.x, curve.y, strict=True))[4096] == 16.0
    assert set(trace(fig, "weights (size)").y) == {14.9012}  # 16 GB = 14.9 GiB


def test_kv_figure_units_and_int8():
    gb = kv_memory.kv_figure(context=32768, batch=8, precision="bf16", model="80L-8kv",
                             hardware="h100", unit="GB")
    assert "= 85.90 GB" in gb.layout.title.text  # KV-8
    int8 = kv_memory.kv_figure(precision="int8")
    assert "65,536 B = 64 KiB per token" in int8.layout.title.text  # KV-6
    with pytest.raises(ValueError, match="unit"):
        kv_memory.kv_figure(unit="MB")


def test_kv_panel_drives_the_callback():
    ui = kv_memory.panel()
    c = controls(ui)
    assert set(c) >= {"context", "batch", "cache", "model"}
    assert "= 0.50 GiB" in ui.result.layout.title.text  # 512 MiB at 4K (KV-6)
    c["context"].value = 32768
    assert "= 4.00 GiB" in ui.result.layout.title.text
    c["model"].value = "llama-7b"
    c["context"].value = 4096
    assert "524,288 B = 512 KiB" in ui.result.layout.title.text  # KV-5
    assert "= 2.00 GiB" in ui.result.layout.title.text


def test_gqa_figure_is_8x():
    fig = kv_memory.gqa_figure()
    mha, gqa = fig.data[0].y[:2]
    assert mha / gqa == 8 and gqa == 320


def test_kv_rows_match_kv6():
    rows = kv_memory.kv_rows()
    assert [r["KV GiB"] for r in rows] == [0.5, 4.0, 16.0, 16.0]
    assert "16.000" in kv_memory.kv_text()
    assert rl.kv_cache_bytes("llama-3-8b", 4096) == 512 * rl.MiB


# ---------------------------------------------------------------- this machine (lesson 04)

CPU = rl.Hardware("test cpu", bandwidth=10e9, flops={"fp32": 100e9}, memory_bytes=16e9)


def test_measured_rows_against_the_machine_roofline():
    rows = roofline.measured_rows(CPU, "reference", [1, 64], [0.02, 0.05], context=64)
    one, big = rows
    assert (one["batch"], one["measured ms"], one["tok/s total"]) == (1, 20.0, 50)
    step = rl.decode_time("reference", CPU, batch=1, context=64, precision="fp32",
                          include_kv=True, include_attention=True)
    assert one["roofline ms"] == round(step.tpot_ms, 2) and one["bound"] == "memory"
    assert one["MBU"] == round((step.weight_bytes + step.kv_bytes) / 0.02 / 10e9, 3)
    assert one["MFU"] == round(step.flops / 0.02 / 100e9, 3)
    assert one["claim ms"] == 6.7 and big["claim ms"] == 73.9  # BATCH-1's reference CPU
    assert big["bound"] == "compute"  # ridge 10 FLOP/byte: fp32 decode turns at batch 20
    assert "claim ms" not in roofline.measured_rows(CPU, "reference", [1], [0.02],
                                                    reference_ms={})[0]
    with pytest.raises(ValueError, match="equally long"):
        roofline.measured_rows(CPU, "reference", [1, 8], [0.02])
    with pytest.raises(ValueError, match="> 0"):
        roofline.measured_rows(CPU, "reference", [1], [0.0])


def test_measured_figure_overlays_measurements_on_the_roofline():
    fig = roofline.measured_figure(CPU, "reference", [1, 8, 32, 64], [0.02, 0.03, 0.05, 0.08])
    measured = trace(fig, "measured")
    assert measured.x == (1, 8, 32, 64) and measured.y == (20.0, 30.0, 50.0, 80.0)
    assert trace(fig, "claim BATCH-1 (reference CPU)").y == (6.7, 20.6, 47.9, 73.9)
    read = trace(fig, "roofline: read")
    assert read.x[0] == 1 and read.x[-1] == 256
    roof = trace(fig, "roof")
    assert roof.x[1] == 10.0 and roof.y[1] == 100.0  # ridge 10 FLOP/byte at 100 GFLOP/s
    achieved = fig.data[-1]
    assert achieved.text[0] == "batch 1" and len(achieved.y) == 4
    assert "10.0 GB/s, 100 GFLOP/s" in fig.layout.title.text


# ---------------------------------------------------------------- lesson 05 additions

def test_kv8_rows_both_readings_of_32k():
    rows = kv_memory.kv8_rows()
    assert rows[0] == {"tokens": 32768, "1 seq GB": 10.74, "1 seq GiB": 10.0,
                       "8 seqs GB": 85.9, "8 seqs GiB": 80.0}
    assert rows[1]["tokens"] == 32000 and rows[1]["8 seqs GB"] == 83.9
    assert round(rows[1]["1 seq GB"], 1) == 10.5


def test_batch3_rows_memory_limits_first_from_4k():
    rows = kv_memory.batch3_rows()
    assert all(r["limit"] == "memory" for r in rows if r["context"] >= 4096)
    a100 = {r["context"]: r for r in rows if r["hardware"].startswith("A100")}
    assert (a100[4096]["fits in memory"], a100[4096]["compute-bound from"]) == (119, 153)
    assert a100[1024]["limit"] == "compute"


@pytest.fixture
def one_thread():
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)  # the fused kernel's scratch buffers scale with the thread count
    yield
    torch.set_num_threads(old)


def test_prefill_peak_memory_math_grows_faster_than_sdpa(one_thread):
    import minifer as mf

    model = mf.GPT.from_config("tiny", seed=0)
    model.set_attention("math")
    peak = {(impl, t): kv_memory.prefill_peak_bytes(model, t, impl)
            for impl in ("math", "sdpa") for t in (32, 128)}
    assert all(block.attn.impl == "math" for block in model.transformer.h)  # restored
    assert all(v > 0 for v in peak.values())
    assert peak["math", 128] > peak["sdpa", 128]
    math_growth = peak["math", 128] / peak["math", 32]
    sdpa_growth = peak["sdpa", 128] / peak["sdpa", 32]
    assert math_growth > 8 and sdpa_growth < 5  # T² versus T for 4× the tokens
    assert kv_memory.score_matrix_bytes(model, 128) == 4 * 128 * 128 * 4


def test_attention_memory_rows_and_figure():
    import minifer as mf

    rows = kv_memory.attention_memory_rows(mf.GPT.from_config("tiny", seed=0), lengths=(16, 64))
    assert [r["tokens"] for r in rows] == [16, 64]
    assert rows[1]["one score matrix MiB"] == round(4 * 64 * 64 * 4 / 2**20, 2)
    fig = kv_memory.attention_memory_figure(rows)
    assert len(fig.data) == 3 and fig.data[0].x == (16, 64)


# ---------------------------------------------------------------- figures that teach

def test_precision_sliders_run_from_32_to_4_bits():
    for ui, names in ((roofline.panel(), ("weights",)), (kv_memory.panel(), ("cache", "weights"))):
        c = controls(ui)
        for name in names:
            values = [v for _, v in c[name].options]
            assert values == ["fp32", "bf16", "fp16", "int8", "int4"], (name, values)
            assert type(c[name]).__name__ == "SelectionSlider"


def test_device_memory_line_is_drawn_and_red_when_the_cache_does_not_fit():
    fits = kv_memory.kv_figure(context=4096, batch=32)
    (line,) = [s for s in fits.layout.shapes if s.type == "line"]
    assert line.y0 == line.y1 == 74.5058 and line.line.width == 2  # 80 GB in GiB, drawn
    texts = [a.text for a in fits.layout.annotations]
    assert any("device memory" in t for t in texts)
    assert "weights 14.9 GiB" in texts  # the dotted weights line is labelled where it ends
    over = kv_memory.kv_figure(context=16384, batch=64)
    (line,) = [s for s in over.layout.shapes if s.type == "line"]
    assert line.line.color == "#D62728"
    assert any("does not fit" in a.text for a in over.layout.annotations)
    assert "only 29 sequences of 16,384 tokens fit" in over.layout.title.text
    assert over.layout.yaxis.range[1] > 128 + 14.9  # the whole overflowing bar is in view


def test_measured_lengths_and_contexts_are_labelled():
    rows = [{"tokens": t, "math MiB": t / 10, "sdpa MiB": t / 20, "one score matrix MiB": t / 40}
            for t in (128, 256, 512, 1024)]
    fig = kv_memory.attention_memory_figure(rows)
    assert fig.layout.xaxis.ticktext == ("128", "256", "512", "1,024")
    fig = kv_memory.kv_figure()
    assert fig.layout.xaxis2.ticktext[:3] == ("512", "1K", "2K")  # K = 1,024 tokens


def test_mbu_sentence_follows_the_measurement():
    assert "MBU 67%: close to the roofline" in roofline.mbu_sentence(0.67)
    assert "within about 3×" in roofline.mbu_sentence(0.42)
    assert "overheads" in roofline.mbu_sentence(0.12)
    assert "caches" in roofline.mbu_sentence(1.3)


def test_linear_bytes_figure_labels_shares():
    rows = [{"layer": "mlp.c_fc", "MB": 30.0, "MFLOP": 15.0},
            {"layer": "lm_head", "MB": 10.0, "MFLOP": 5.0}]
    fig = roofline.linear_bytes_figure(rows)
    bars = fig.data[0]
    assert list(bars.x) == ["mlp.c_fc", "lm_head"] and list(bars.y) == [30.0, 10.0]
    assert bars.text[0].startswith("75%") and "5.0 MFLOP" in bars.text[1]
    assert "40.0 MB" in fig.layout.title.text
    with pytest.raises(ValueError):
        roofline.linear_bytes_figure([])


def test_own_roofline_figure_places_points_under_the_roof():
    points = [{"batch": 1, "FLOP/byte": 0.5, "GFLOP/s": 4.0},
              {"batch": 64, "FLOP/byte": 30.0, "GFLOP/s": 90.0}]
    fig = roofline.own_roofline_figure(10e9, 160e9, points)
    roof, measured = fig.data
    assert list(roof.x)[1] == 16.0 and max(roof.y) == 160.0  # the ridge: 160 / 10 FLOP per byte
    assert list(measured.x) == [0.5, 30.0] and list(measured.y) == [4.0, 90.0]
    assert list(measured.text) == ["batch 1", "batch 64"]
    lo, hi = fig.layout.yaxis.range
    assert 10 ** lo <= 2.0 and 10 ** hi >= 160.0  # every point and the roof fit
    with pytest.raises(ValueError):
        roofline.own_roofline_figure(0, 1, points)
    with pytest.raises(ValueError):
        roofline.own_roofline_figure(1, 1, [])
