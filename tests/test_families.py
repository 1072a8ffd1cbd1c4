"""The Llama, Qwen2 and Qwen3 families: tiny random `transformers` models imported with
`GPT.from_hf` (or read from a checkpoint folder) compute what transformers computes, and every
engine path (cache, batching with mixed lengths) gives the same greedy tokens."""

from __future__ import annotations

import pytest
import torch

from conftest import logits_atol, on_device
from minifer import GPT, GPTConfig, SamplingParams, generate

transformers = pytest.importorskip("transformers")

VOCAB = 300
FAMILIES = ("llama", "qwen2", "qwen3", "llama3-scaled")


def hf_model(family: str, **overrides):
    """A tiny random `transformers` model of `family` (GQA: 4 query heads, 2 K/V heads)."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                  initializer_range=0.2)  # lively logits: clear argmaxes, varied greedy text
    if family == "llama":
        cfg = transformers.LlamaConfig(**{**common, **overrides})
        cls = transformers.LlamaForCausalLM
    elif family == "llama3-scaled":  # Llama 3.1's RoPE scaling, a base of 500000
        cfg = transformers.LlamaConfig(**{**common, "rope_parameters": dict(
            rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
            high_freq_factor=4.0, original_max_position_embeddings=32), **overrides})
        cls = transformers.LlamaForCausalLM
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(**{**common, "tie_word_embeddings": True, **overrides})
        cls = transformers.Qwen2ForCausalLM
    else:  # qwen3: q/k norms, a head dim of its own (32 here, not 64 / 4)
        cfg = transformers.Qwen3Config(**{**common, "head_dim": 32, **overrides})
        cls = transformers.Qwen3ForCausalLM
    torch.manual_seed(0)
    m = cls(cfg).eval()
    with torch.no_grad():  # RMSNorm weights start at 1: make them count in the comparison
        for name, p in m.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    return m


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request):
    hf = hf_model(request.param)
    return hf, GPT.from_hf(hf)


def test_config_switches():
    cfg = GPT.from_hf(hf_model("qwen3")).config
    assert (cfg.positions, cfg.norm, cfg.mlp, cfg.bias, cfg.qk_norm, cfg.head_dim) == (
        "rope", "rms", "swiglu", False, True, 32)
    q2 = GPT.from_hf(hf_model("qwen2")).config
    assert q2.qkv_bias and not q2.bias and q2.tie_embeddings and not q2.qk_norm
    ll = GPT.from_hf(hf_model("llama3-scaled")).config
    assert ll.rope_theta == 500000.0 and ll.rope_scaling.factor == 8.0
    assert ll.kv_heads == 2 and ll.intermediate_size == 96 and ll.eos_token_id == 2
    assert GPTConfig.from_dict(ll.to_dict()) == ll  # JSON round trip, the scaling included


def test_param_count_matches_hf(pair):
    hf, m = pair
    assert m.num_params() == sum(p.numel() for p in hf.parameters()) == m.config.num_params()


def test_logits_match_transformers(pair, device):
    hf, m = pair
    m, hf = on_device(m, device), on_device(hf, device)
    ids = torch.randint(0, VOCAB, (3, 100), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.inference_mode():
        ref = hf(ids).logits
        ours = m(ids)
    assert ref.std() > 0.5  # not a near-constant output
    assert (ours - ref).abs().max().item() <= logits_atol(device)


def test_greedy_tokens_match_transformers_generate(pair):
    hf, m = pair
    prompt = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20,
                          min_new_tokens=20, do_sample=False, pad_token_id=0)
    ref = out[0, 8:].tolist()
    params = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    assert generate(m, prompt, params)[0].token_ids == ref
    assert generate(m, prompt, params, use_cache=False)[0].token_ids == ref
    assert len(set(ref)) > 3


def test_batched_mixed_lengths_equal_one_at_a_time(pair):
    _, m = pair
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (3, 11, 7)]
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    alone = [generate(m, [p], params)[0].token_ids for p in prompts]
    assert [c.token_ids for c in generate(m, prompts, params)] == alone


def test_rotated_keys_are_cached():
    """The cache holds keys already rotated: the key of a token at position p is its unrotated
    key turned by p's angles, so the same token at two positions has two different entries."""
    m = GPT.from_config("tiny-llama")
    from minifer import StaticKVCache

    cache = StaticKVCache.for_model(m, batch_size=1, max_len=8)
    with torch.inference_mode():
        m(torch.tensor([[5, 5]]), cache=cache)
    k = cache.k[0][0, :, :2]  # (nkv, 2, hd): the same token at positions 0 and 1
    assert not torch.allclose(k[:, 0], k[:, 1])
    assert torch.allclose(k[:, 0].norm(dim=-1), k[:, 1].norm(dim=-1), atol=1e-5)  # a rotation


@pytest.mark.parametrize("option, value", [
    ("hidden_act", "gelu"),
    ("use_sliding_window", True),
    ("attention_bias", True),
])
def test_unsupported_options_name_themselves(option, value):
    hf = hf_model("qwen2" if option == "use_sliding_window" else "llama", **{option: value})
    with pytest.raises(ValueError, match=option):
        GPT.from_hf(hf)


def test_other_rope_scalings_are_refused():
    hf = hf_model("llama", rope_parameters=dict(rope_type="linear", rope_theta=10000.0,
                                                factor=2.0))
    with pytest.raises(ValueError, match="rope_scaling"):
        GPT.from_hf(hf)


def test_moe_model_types_are_refused():
    from minifer.hf_convert import config_from_hf

    with pytest.raises(ValueError, match="model_type"):
        config_from_hf({"model_type": "mixtral", "vocab_size": 10})
    with pytest.raises(ValueError, match="num_experts"):
        config_from_hf({**hf_model("qwen2").config.to_dict(), "num_experts": 8})
