"""Mistral without a sliding window (``sliding_window`` null, or at least the context) is
Llama-shaped: a tiny random `MistralForCausalLM`, in memory or as a checkpoint folder, computes
what transformers computes; a real sliding window is refused, naming the option."""

from __future__ import annotations

import shutil

import pytest
import torch

from minifer import GPT, load_hf_checkpoint
from minifer.pretrained import model_files

transformers = pytest.importorskip("transformers")


def mistral(sliding_window):
    """A tiny random Mistral (GQA 4 → 2 heads, 16 wide each) with lively norm weights."""
    cfg = transformers.MistralConfig(
        vocab_size=2048, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        sliding_window=sliding_window, rms_norm_eps=1e-6, eos_token_id=2047,
        tie_word_embeddings=False, initializer_range=0.2)
    torch.manual_seed(0)
    m = transformers.MistralForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return m


@pytest.mark.parametrize("window", [None, 128, 4096])
def test_mistral_without_a_window_matches_transformers(tmp_path, window):
    hf = mistral(window)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    shutil.copy(model_files("shakespeare")[2], tmp_path / "tokenizer.json")
    model, _ = load_hf_checkpoint(tmp_path)
    ids = torch.randint(0, 2048, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ours, ref = model(ids), hf(ids).logits
        assert torch.equal(ours, GPT.from_hf(hf)(ids))
    assert (ours - ref).abs().max().item() <= 1e-5


def test_a_real_sliding_window_is_refused(tmp_path):
    hf = mistral(16)
    with pytest.raises(ValueError, match=r"sliding_window=16 is not supported.*null or >= "
                                         r"max_position_embeddings=128"):
        GPT.from_hf(hf)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    with pytest.raises(ValueError, match="sliding_window=16"):
        load_hf_checkpoint(tmp_path)
