"""The speed-up package (`minifer.fast`): plugged in at one seam, off without changing results."""

from __future__ import annotations

import torch

import minifer as mf
from minifer import fast, hooks
from minifer.fast.argmax import first_argmax
from minifer.fast.layout import column_major_linears


def test_import_minifer_plugs_the_speed_ups_in_and_disabled_takes_them_out():
    assert fast.installed()
    assert hooks.argmax is first_argmax and hooks.lay_out_weights is column_major_linears
    with fast.disabled():
        assert not fast.installed()
        assert hooks.argmax is not first_argmax
    assert fast.installed()


def test_the_core_with_the_speed_ups_off_gives_the_same_greedy_tokens():
    """Greedy tokens of the shipped model, batched with mixed lengths, with every speed-up on
    and off (the model built inside each, so its weight layout differs too)."""
    params = mf.SamplingParams(temperature=0, max_new_tokens=24)
    prompts = ["ROMEO:\n", "JULIET: O Romeo, Romeo!", "KING"]

    def run():
        model, tok = mf.load_pretrained("shakespeare")
        return [c.token_ids for c in mf.generate(model, prompts, params, tok, threads=1)]

    on = run()
    with fast.disabled():
        off = run()
        model, _ = mf.load_pretrained("shakespeare")
        assert model.lm_head.weight.is_contiguous()  # torch's own layout
    assert on == off


def test_the_plain_seam_runs_everything_generate_takes():
    model = mf.GPT.from_config("tiny")
    with fast.disabled():
        for kwargs in ({"compile": True}, {"threads": "auto"}, {"threads": 1}, {"use_cache": False}):
            [c] = mf.generate(model, [[1, 2, 3]], mf.SamplingParams(temperature=0, max_new_tokens=4),
                              **kwargs)
            assert len(c.token_ids) == 4


def test_column_major_weights_compute_the_same_function():
    model = mf.GPT.from_config("tiny")
    with fast.disabled():
        plain = mf.GPT.from_config("tiny")
    assert not plain.transformer.h[0].mlp.c_fc.weight.t().is_contiguous()
    assert model.transformer.h[0].mlp.c_fc.weight.t().is_contiguous()
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), plain(ids), rtol=1e-5, atol=1e-5)


def test_the_chunked_argmax_is_the_reference_argmax():
    logits = torch.randn(5, 50_257, generator=torch.Generator().manual_seed(1))
    logits[2, 7] = logits[2, 50_000] = 1e4  # a tie: the first index wins
    assert torch.equal(first_argmax(logits), logits.argmax(-1))
    with fast.disabled():
        assert torch.equal(hooks.argmax(logits), first_argmax(logits))
