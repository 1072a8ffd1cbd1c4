"""`GPT.from_hf`: a small random `transformers` GPT-2 imported in memory matches HF exactly."""

from __future__ import annotations

import pytest
import torch

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


def test_from_hf_logits_match(hf):
    m = GPT.from_hf(hf)
    ids = torch.randint(0, 300, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = hf(ids).logits
        ours = m(ids)
    assert ref.std() > 0.5  # not a near-constant output
    assert (ours - ref).abs().max().item() <= 1e-5


def test_from_hf_greedy_tokens_match_hf_generate(hf):
    m = GPT.from_hf(hf)
    prompt = torch.randint(0, 299, (1, 8), generator=torch.Generator().manual_seed(2))
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
