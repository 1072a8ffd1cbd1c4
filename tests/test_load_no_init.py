"""Loading a checkpoint builds the model without a random init (on the meta device, the file's
tensors then assigned): no weight is ever initialised on a real device, and the logits are
bit-identical to a model built the old way (random init, then the same tensors copied in)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from minifer import GPT, GPTConfig, load_pretrained
from minifer.pretrained import load_checkpoint, model_files, read_safetensors, save_checkpoint


@pytest.fixture
def init_devices(monkeypatch):
    """The device of every weight that `reset_parameters` (the random init) ran on."""
    seen = []
    for cls in (nn.Linear, nn.Embedding, nn.LayerNorm):
        original = cls.reset_parameters

        def spy(self, original=original):
            seen.append(self.weight.device.type)
            return original(self)

        monkeypatch.setattr(cls, "reset_parameters", spy)
    return seen


def test_load_pretrained_never_initialises_real_weights(init_devices):
    model, _ = load_pretrained("shakespeare")
    assert init_devices and set(init_devices) == {"meta"}
    weights, _, _ = model_files("shakespeare")
    old = GPT(model.config)  # the old way: a random init on the CPU, then the file's tensors
    old.load_state_dict(read_safetensors(weights))
    old.eval()
    ids = torch.randint(0, 2048, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(model(ids), old(ids))


@pytest.mark.parametrize("config", [GPTConfig.preset("tiny-llama"),
                                    GPTConfig.preset("tiny-llama").replace(tie_embeddings=True),
                                    GPTConfig.preset("tiny")])
def test_round_trip_is_exact_without_init(tmp_path, init_devices, config):
    src = GPT.from_config(config, seed=3)
    path = save_checkpoint(src, tmp_path / "m.safetensors")
    init_devices.clear()
    model, _ = load_checkpoint(path)
    assert set(init_devices) == {"meta"}
    assert model.lm_head.weight.device.type == "cpu"
    if config.tie_embeddings:
        assert model.lm_head.weight is model.transformer.wte.weight
    ids = torch.randint(0, config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert torch.equal(model(ids), src(ids))
