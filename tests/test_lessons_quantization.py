"""Lesson 09 builders: precision rows, figures, the panel callback, roofline and outliers."""

from __future__ import annotations

import ipywidgets as widgets
import plotly.graph_objects as go
import pytest
import torch

import minifer as mf
from minifer_course.lessons import quantization as Q
from minifer_course.quality import validation_perplexity


@pytest.fixture(scope="module")
def draft():
    return mf.load_pretrained("shakespeare-draft")


@pytest.fixture(scope="module")
def models(draft):
    return Q.quantized_models(draft[0], group_size=64, dequant=True)


@pytest.fixture(scope="module")
def rows(draft, models):
    quality = {k: v for k, v in models.items() if "dequant" not in k}
    return Q.precision_rows(quality, draft[1], "ROMEO:\n", n_tokens=8, max_chars=1_500)


def test_precision_rows(rows):
    r = {row.precision: row for row in rows}
    assert list(r) == ["fp32", "bf16", "fp16", "int8", "int4"]
    assert r["fp32"].agreement == 1.0 and r["fp32"].max_dlogit == 0 and r["fp32"].same_greedy == 8
    assert r["bf16"].total_mb * 2 == pytest.approx(r["fp32"].total_mb, abs=0.02)
    assert r["int4"].linear_mb < r["int8"].linear_mb < r["bf16"].linear_mb
    assert r["int4"].max_dlogit > r["int8"].max_dlogit > 0
    assert "top-1 agree" in Q.rows_table(rows, detail=True)
    portable = Q.rows_table(rows)  # bytes and perplexity's change, to 1 decimal
    assert "top-1 agree" not in portable and "Δ perplexity vs fp32" in portable
    assert portable.splitlines()[1].split()[-1] == "+0.0"  # fp32 against itself


def test_quality_figure_highlights(rows):
    fig = Q.quality_figure(rows, "int4")
    assert len(fig.data) == 5
    sizes = {t.name: t.marker.size for t in fig.data}
    assert sizes["int4"] > sizes["fp32"]


def test_panel_callback(rows, models):
    qp = Q.QuantPanel(rows, models, context=8, rounds=1)
    res = qp.result("int8", 4)
    assert res["batch"] == 4 and res["ms/token"] > 0 and res["tokens/s"] > 0
    assert qp.ms(4) is qp.ms(4)  # measured once per batch
    fig = qp.figure("int8", 4)  # the panel's callback: a plain function returning a figure
    assert isinstance(fig, go.Figure) and fig.layout.title.text.startswith("int8:")
    speed = fig.data[-1]
    assert list(speed.x) == list(models) and len(fig.data) == len(rows) + 1
    ui = Q.panel(qp, "int4", 1)
    assert isinstance(ui.result, go.Figure) and ui.result.layout.title.text.startswith("int4:")
    ui.children[1].value = 8  # the batch slider
    assert "at batch 8" in ui.result.layout.title.text
    precision = ui.children[0]  # an ordered slider, many bits to few
    assert isinstance(precision, widgets.SelectionSlider)
    assert [v for _, v in precision.options] == ["fp32", "bf16", "fp16", "int8", "int4"]
    assert precision.label == "int4 · 4 bit"  # common.precision_options' labels
    precision.value = "fp16"
    assert ui.result.layout.title.text.startswith("fp16:")
    with pytest.raises(ValueError, match="precision"):
        qp.result("int3", 1)
    with pytest.raises(ValueError, match="precision"):
        qp.figure("int3", 1)


def test_panel_measures_up_front(rows, models):
    qp = Q.QuantPanel(rows, {k: models[k] for k in ("fp32", "int8")}, context=8, rounds=1,
                      steps=1, batches=(1, 2))
    grid = qp.measure()
    assert list(grid) == [1, 2] and all(v > 0 for ms in grid.values() for v in ms.values())
    assert qp.ms(2) is grid[2]  # the panel reads what was measured, it does not measure again
    ui = Q.panel(qp, "int8", 1)
    assert ui.children[1].options == (1, 2)


def test_quality_figure_separates_coinciding_labels():
    rows = [Q.PrecisionRow(p, mb, mb, 10.0, 1.0, 8, 0.0)
            for p, mb in (("fp32", 35.0), ("bf16", 17.6), ("fp16", 17.6), ("int8", 11.0))]
    fig = Q.quality_figure(rows)
    spots = {t.name: t.textposition for t in fig.data}
    sizes = {t.name: t.marker.size for t in fig.data}
    assert spots["bf16"] != spots["fp16"] and spots["int8"] == "top center"
    assert sizes["bf16"] > sizes["fp16"]  # the hidden point shows as a ring around the other


def test_roofline_rows_quant2():
    rows = Q.roofline_rows("llama-7b", "a100-80gb", 512)
    assert [r["weights"] for r in rows] == ["bf16", "int8", "int4"]
    assert rows[0]["TPOT ms"] > rows[1]["TPOT ms"] > rows[2]["TPOT ms"]
    assert rows[0]["TTFT ms"] == rows[2]["TTFT ms"]
    assert len(Q.roofline_figure(rows).data) == 2


def test_outlier_rows():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=gen) * torch.linspace(0.1, 2, 64)[:, None]
    clean, out = Q.outlier_rows(w, n_outliers=2, magnitude=30)
    assert clean["per-channel"] < clean["per-tensor"]
    assert out["per-channel"] > 2 * clean["per-channel"]
    assert out["per-channel + outliers in float"] < out["per-channel"]
    assert len(Q.outlier_figure([clean, out]).data) == 3


def test_speed_notes_follow_the_numbers():
    ms = {"fp32": 20.0, "bf16": 21.0, "fp16": 60.0, "int8": 15.0, "int4": 10.0,
          "int8 dequant": 16.0, "int4 dequant": 40.0}
    notes = Q.speed_notes(ms)
    assert "fp16 takes 3.0× fp32's time: this CPU has no native fp16" in notes
    assert "bf16 takes about fp32's time" in notes
    assert "dequantizing at every call: 16.0 ms, about as fast as the fused kernel" in notes
    assert "dequantizing at every call: 40.0 ms, much slower than the fused kernel" in notes
    assert "fp16 is faster" in Q.speed_notes({**ms, "fp16": 10.0})


def test_greedy_note(rows):
    note = Q.greedy_note(rows)
    assert note.startswith("Greedy tokens identical to fp32's from the prompt, of 8:")
    assert "int4" in note and "fp32 " not in note


def test_top1_tokens_batches_windows_like_one_at_a_time(draft):
    from minifer_course.quality import top1_agreement, top1_tokens

    model, tok = draft
    ids = tok.encode(mf.pretrained.load_validation_text()[:3_000])
    assert len(ids) > 2 * model.config.context_length  # several windows, the last one shorter
    batched, single = top1_tokens(model, ids), top1_tokens(model, ids, batch_size=1)
    assert batched.shape == (len(ids),) and torch.equal(batched, single)
    assert top1_agreement(model, model, ids, reference_top1=batched) == 1.0
    with pytest.raises(ValueError, match="reference_top1"):
        top1_agreement(model, model, ids, reference_top1=batched[:-1])


def test_perplexity_and_top1_in_one_pass(draft):
    model, tok = draft
    text = mf.pretrained.load_validation_text()[:1_500]
    ctx = model.config.context_length
    ppl, top1 = Q._perplexity_and_top1(model, tok, text, ctx)
    assert ppl == validation_perplexity(model, tok, text, stride=ctx).perplexity
    ids = tok.encode(text)
    assert top1.numel() == len(ids)  # each scored position once (an EOS goes in front)


def test_int16_pair_saturation_model_is_exact_for_small_operands_and_clips_large_ones():
    """The model of a non-VNNI int8 kernel (lesson 09, QUANT-6) is exact where no pair sum
    leaves int16 and clips where one does, so the lesson's verdict can tell the two apart."""
    from minifer_course.lessons import int_math as IM

    small = IM.int8_operands(8, 64, 8, limit=63)
    assert torch.equal(IM.pair_saturating_mm(*small), small[0].int() @ small[1].int())
    a, b = IM.int8_operands(8, 64, 8)
    exact = a.int() @ b.int()
    clipped = IM.pair_saturating_mm(a, b)
    assert not torch.equal(clipped, exact)
    assert "equals the exact product" in IM.int_mm_verdict(exact, exact, a, b)
    said = IM.int_mm_verdict(clipped, exact, a, b)
    assert "DIFFERS" in said and "pair-saturating" in said
    assert "not modelled" in IM.int_mm_verdict(exact + 1, exact, a, b)


def test_codes_and_channel_error_figures():
    from minifer.quantization import quantize_int8

    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    q, scale = quantize_int8(w)
    fig = Q.codes_figure(q, rows=(0, 1))
    assert [t.name for t in fig.data] == ["row 0", "row 1"]
    assert sum(fig.data[0].y) == 64 and list(fig.layout.xaxis.range) == [-132, 132]
    err = (q.float() * scale[:, None] - w).abs().amax(1)
    fig = Q.channel_error_figure(err, scale)
    assert len(fig.data) == 2 and all(e <= b for e, b in zip(fig.data[1].y, fig.data[0].y))
