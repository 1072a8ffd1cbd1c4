"""`GPT.from_hf`: a small random `transformers` GPT-2 imported in memory matches HF exactly."""

from __future__ import annotations

import pytest
import torch

from conftest import logits_atol, on_device
from minifer import GPT, SamplingParams, generate

transformers = pytest.importorskip("transformers")


def _hf_gpt2(**overrides):
    cfg = transformers.GPT2Config(
        n_layer=2, n_head=4, n_embd=64, vocab_size=300, n_positions=64,
        bos_token_id=299, eos_token_id=299,
        initializer_range=0.2,  # livelier than GPT-2's 0.02: varied greedy text, clear argmax
        **overrides,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


@pytest.fixture(scope="module")
def hf():
    return _hf_gpt2()


def test_from_hf_config(hf):
    m = GPT.from_hf(hf)
    cfg = m.config
    assert (cfg.vocab_size, cfg.context_length, cfg.n_layer, cfg.n_head, cfg.n_embd) == (
        300, 64, 2, 4, 64)
    assert cfg.tie_embeddings and m.lm_head.weight is m.transformer.wte.weight
    assert cfg.eos_token_id == 299 and not m.training
    assert m.num_params() == sum(p.numel() for p in hf.parameters()) == cfg.num_params()


def test_from_hf_logits_match(hf, device):
    m = GPT.from_hf(hf).to(device)
    hf = on_device(hf, device)
    ids = torch.randint(0, 300, (3, 40), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.inference_mode():
        ref = hf(ids).logits
        ours = m(ids)
    assert ref.std() > 0.5  # not a near-constant output
    assert (ours - ref).abs().max().item() <= logits_atol(device)


def test_from_hf_greedy_tokens_match_hf_generate(hf, device):
    m = GPT.from_hf(hf).to(device)
    hf = on_device(hf, device)
    prompt = torch.randint(0, 299, (1, 8), generator=torch.Generator().manual_seed(2)).to(device)
    with torch.inference_mode():
        out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20,
                          min_new_tokens=20, do_sample=False, pad_token_id=0)
    ref = out[0, 8:].tolist()
    params = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    [c] = generate(m, prompt, params)
    assert c.token_ids == ref
    assert len(set(ref)) > 3
    # and the recompute path agrees too
    assert generate(m, prompt, params, use_cache=False)[0].token_ids == ref


def test_from_hf_untied_head():
    hf = _hf_gpt2(tie_word_embeddings=False)
    assert hf.lm_head.weight.data_ptr() != hf.transformer.wte.weight.data_ptr()
    m = GPT.from_hf(hf)
    assert not m.config.tie_embeddings
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        assert (m(ids) - hf(ids).logits).abs().max().item() <= 1e-5


def test_from_hf_rejects_other_activations():
    hf = _hf_gpt2(activation_function="relu")
    with pytest.raises(ValueError, match="relu"):
        GPT.from_hf(hf)


# ---- GPT-2 options the engine does not model: rejected by name, never converted silently --------
@pytest.mark.parametrize("option,value", [
    ("scale_attn_by_inverse_layer_idx", True),  # logits were off by 0.77
    ("scale_attn_weights", False),  # logits were off by 3.9
    ("add_cross_attention", True),
    ("n_inner", 100),  # an MLP width other than 4 × n_embd
])
def test_from_hf_rejects_unsupported_options(option, value):
    hf = _hf_gpt2(**{option: value})
    with pytest.raises(ValueError, match=f"{option}={value}"):
        GPT.from_hf(hf)


def _logits_match(hf, tol=1e-5):
    m = GPT.from_hf(hf)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        ref = hf(ids).logits
        assert (m(ids) - ref).abs().max().item() <= tol
    return m


@pytest.mark.parametrize("overrides", [
    dict(n_inner=256),  # = 4 × n_embd: the usual width, spelled out
    dict(layer_norm_epsilon=1e-2),  # carried over as GPTConfig.layer_norm_eps
    dict(reorder_and_upcast_attn=True, attn_implementation="eager"),  # fp32: same arithmetic
])
def test_from_hf_supported_options_match(overrides):
    m = _logits_match(_hf_gpt2(**overrides))
    if "layer_norm_epsilon" in overrides:
        assert m.config.layer_norm_eps == 1e-2


def test_from_hf_upcast_attention_needs_fp32():
    hf = _hf_gpt2(reorder_and_upcast_attn=True).to(torch.bfloat16)
    with pytest.raises(ValueError, match="reorder_and_upcast_attn=True.*float32"):
        GPT.from_hf(hf)


def test_from_hf_rejects_other_models():
    with pytest.raises(TypeError, match="GPT2LMHeadModel"):
        GPT.from_hf(transformers.GPT2Model(transformers.GPT2Config(
            n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=16)))
    with pytest.raises(TypeError, match="hf_model"):
        GPT.from_hf("gpt2")
