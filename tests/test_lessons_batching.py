"""Lesson 07's module: the measured batch sweep, its table and figure carry the claims'
numbers, and the batch slider drives the figure."""

import pytest
import torch

from minifer_course.lessons import batching as B
from minifer_course.lessons import scheduling as S


def controls(ui) -> dict:
    return {w.description: w for w in ui.children if getattr(w, "description", "")}


# ------------------------------------------------------------------ BATCH-1, BATCH-2, MET-4

def test_reference_sweep_is_batch1_claim():
    ref = B.REFERENCE_SWEEP
    assert ref.batches == (1, 8, 32, 64)
    assert [round(ref.total(b)) for b in ref.batches] == [149, 388, 668, 866]  # claim: 150/388/667/866
    assert round(ref.step(64) / ref.step(1)) == 11
    assert ref.per_user(64) < ref.per_user(1)  # a CPU is compute-bound early: each user slows


def test_batch_figure_and_panel():
    sweep = B.BatchSweep((1, 2, 8), (0.010, 0.012, 0.020), label="test")
    fig = B.batch_figure(sweep, 8)
    assert "batch 8: one step 20.0 ms (2.0× batch 1) → 50 tok/s per user, 400 tok/s" in \
        fig.layout.title.text
    server = next(t for t in fig.data if t.name == "server tok/s, test")
    assert list(server.y) == [100, 166.7, 400]  # batch / step, 4 significant digits
    assert "reference CPU: 20.6 ms" in fig.layout.title.text  # batch 8 is in the claim
    assert "<br>" not in B.batch_figure(sweep, 2).layout.title.text  # the claim has no batch 2
    ui = B.batch_panel(sweep, batch=2)
    assert "batch 2:" in ui.result.layout.title.text
    controls(ui)["batch"].value = 1
    assert "batch 1: one step 10.0 ms" in ui.result.layout.title.text
    with pytest.raises(ValueError, match="was not measured"):
        sweep.step(4)
    assert "claim ms" in B.sweep_table(sweep)


@pytest.mark.parametrize("batches, steps", [((), ()), ((2, 1), (1.0, 1.0)), ((1,), (0.0,)),
                                            ((1, 2), (1.0,))])
def test_sweep_bad_input(batches, steps):
    with pytest.raises(ValueError):
        B.BatchSweep(batches, steps)


def test_measure_sweep_tiny_model():
    import minifer as mf

    model = mf.GPT.from_config(mf.GPTConfig(vocab_size=64, context_length=32, n_layer=1,
                                            n_head=2, n_embd=16), seed=0)
    sweep = B.measure_sweep(model, (1, 2), context=8, repeats=1)
    assert sweep.batches == (1, 2) and all(t > 0 for t in sweep.step_s)
    costs = S.measure_costs(model, sweep, prompt_tokens=8, repeats=1)
    assert costs.prefill_s_per_token > 0


def test_step_work_figure_is_flat_in_bytes_and_linear_in_flops():
    from minifer_course.lessons.batching import step_work_figure

    fig = step_work_figure(1_000_000, batches=(1, 4, 64))
    read, flops, intensity = (list(t.y) for t in fig.data)
    assert read == [4.0, 4.0, 4.0] and flops == [2.0, 8.0, 128.0] and intensity == [0.5, 2.0, 32.0]
    with pytest.raises(ValueError, match="batches"):
        step_work_figure(1000, batches=(0, 2))


def test_mask_figure_marks_padding_attended_and_future_slots():
    from minifer_course.lessons.batching import mask_figure

    start = [0, 2]
    slots = torch.arange(5)
    visible = ((slots >= torch.tensor(start)[:, None]) & (slots <= 3)) | (slots == 3)
    kinds = mask_figure(visible, start, slot=3).data[0].z
    assert [list(r) for r in kinds] == [[1, 1, 1, 1, 2], [0, 0, 1, 1, 2]]
    with pytest.raises(ValueError, match="slot"):
        mask_figure(visible, start, slot=5)
