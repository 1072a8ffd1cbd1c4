"""The roofline and KV-memory lessons: figures carry the claims' numbers, sliders drive them."""

from __future__ import annotations

import plotly.io as pio
import pytest

from minifer import roofline as rl
from minifer.lessons import kv_memory, roofline


@pytest.fixture(autouse=True)
def json_renderer():
    old = pio.renderers.default
    pio.renderers.default = "json"  # outside a kernel: no browser
    yield
    pio.renderers.default = old


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
