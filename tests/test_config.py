"""GPTConfig: presets, parameter counts, KV bytes and validation."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from minifer import GPT, PRESETS, GPTConfig


def _build_on_meta(cfg: GPTConfig) -> GPT:
    """The real module tree with shape-only tensors: no memory, no init time (GPT-2 is 124M).

    (Embedding's default init has no fast meta kernel, so it is skipped: values don't matter.)
    """
    with mock.patch.object(torch.nn.Embedding, "reset_parameters", lambda self: None):
        with torch.device("meta"):
            return GPT(cfg)


def _count_on_meta(cfg: GPTConfig) -> int:
    return _build_on_meta(cfg).num_params()


def test_reference_preset_has_exactly_26_792_960_parameters():
    cfg = GPTConfig.preset("reference")
    assert (cfg.vocab_size, cfg.context_length, cfg.n_embd, cfg.n_layer, cfg.n_head) == (
        1024, 1024, 512, 8, 8)
    assert cfg.bias and not cfg.tie_embeddings
    assert cfg.num_params() == 26_792_960
    model = _build_on_meta(cfg)
    assert model.num_params() == 26_792_960
    assert sum(p.numel() for p in model.parameters()) == 26_792_960
    assert model.lm_head.bias is None


def test_gpt2_preset_is_gpt2_small_with_tied_embeddings():
    cfg = GPTConfig.preset("gpt2")
    assert cfg.num_params() == 124_439_808
    model = _build_on_meta(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.num_params() == 124_439_808


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_num_params_matches_built_model_for_every_preset(name):
    cfg = GPTConfig.preset(name)
    assert cfg.num_params() == _count_on_meta(cfg)


@pytest.mark.parametrize("changes", [
    dict(n_kv_head=1),  # multi-query
    dict(n_kv_head=2),  # grouped-query
    dict(n_kv_head=4),  # = n_head: plain multi-head
    dict(bias=False),
    dict(tie_embeddings=True),
    dict(bias=False, tie_embeddings=True, n_kv_head=2),
])
def test_num_params_formula_matches_model_for_variants(changes):
    cfg = GPTConfig.preset("tiny").replace(**changes)
    assert cfg.num_params() == _count_on_meta(cfg)


def test_gqa_shrinks_only_the_kv_projection():
    mha = GPTConfig.preset("tiny")
    gqa = GPTConfig.preset("tiny-gqa")
    d, hd = mha.n_embd, mha.head_dim
    removed_kv_cols = 2 * (mha.kv_heads - gqa.kv_heads) * hd
    assert mha.num_params() - gqa.num_params() == mha.n_layer * removed_kv_cols * (d + 1)


def test_kv_bytes_per_token():
    ref = GPTConfig.preset("reference")
    assert ref.kv_bytes_per_token() == 32_768  # 2 × 8 layers × 8 heads × 64 dims × 4 bytes
    assert ref.kv_bytes_per_token(2) == 16_384
    gqa = GPTConfig.preset("tiny-gqa")
    assert gqa.kv_heads == 2 and gqa.head_dim == 8
    assert gqa.kv_bytes_per_token() == 2 * 2 * 2 * 8 * 4
    assert GPTConfig.preset("tiny").kv_bytes_per_token() == 2 * gqa.kv_bytes_per_token()


def test_head_dim_and_kv_heads():
    cfg = GPTConfig(n_embd=64, n_head=4)
    assert cfg.head_dim == 16 and cfg.kv_heads == 4
    assert cfg.replace(n_kv_head=1).kv_heads == 1


def test_n_embd_must_divide_by_n_head():
    with pytest.raises(ValueError, match="n_embd.*n_head"):
        GPTConfig(n_embd=30, n_head=4)


@pytest.mark.parametrize("n_kv_head", [0, 3, 8, -1, 2.0, True])
def test_n_kv_head_must_divide_n_head(n_kv_head):
    with pytest.raises(ValueError, match="n_kv_head"):
        GPTConfig(n_embd=32, n_head=4, n_kv_head=n_kv_head)


@pytest.mark.parametrize("field", ["vocab_size", "context_length", "n_layer", "n_head", "n_embd"])
@pytest.mark.parametrize("value", [0, -3, 2.0, True, "8"])
def test_sizes_must_be_positive_integers(field, value):
    with pytest.raises(ValueError, match=field):
        GPTConfig.preset("tiny").replace(**{field: value})


def test_eos_token_must_lie_in_vocab():
    with pytest.raises(ValueError, match="eos_token_id"):
        GPTConfig(vocab_size=10, n_embd=8, n_head=2, eos_token_id=10)
    with pytest.raises(ValueError, match="eos_token_id"):
        GPTConfig(vocab_size=10, n_embd=8, n_head=2, eos_token_id=-1)


def test_unknown_preset_lists_the_names():
    with pytest.raises(ValueError, match="nope") as err:
        GPTConfig.preset("nope")
    for name in PRESETS:
        assert repr(name) in str(err.value)


def test_dict_round_trip_and_unknown_fields():
    cfg = GPTConfig.preset("tiny-gqa")
    assert GPTConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="n_heads"):
        GPTConfig.from_dict({**cfg.to_dict(), "n_heads": 4})


def test_config_is_immutable_and_replace_revalidates():
    cfg = GPTConfig.preset("tiny")
    with pytest.raises(AttributeError):
        cfg.n_layer = 3
    assert cfg.replace(n_layer=3).n_layer == 3 and cfg.n_layer == 2
    with pytest.raises(ValueError):
        cfg.replace(n_head=5)
