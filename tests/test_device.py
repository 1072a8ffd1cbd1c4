"""`device=` everywhere: a device this machine does not have is a ValueError naming `device`."""

from __future__ import annotations

import pytest
import torch

import minifer as mf
from minifer.device import as_device


@pytest.fixture
def no_gpu(monkeypatch):
    """Pretend to be a CPU-only build, whatever this machine has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)


def test_as_device_accepts_what_exists():
    assert as_device("cpu") == torch.device("cpu")
    assert as_device(torch.device("cpu")) == torch.device("cpu")
    assert as_device("meta").type == "meta"


@pytest.mark.parametrize("bad", ["cuda", "cuda:0", torch.device("cuda"), "mps", 0])
def test_missing_accelerator_is_a_value_error(no_gpu, bad):
    with pytest.raises(ValueError, match=r"device.*not available"):
        as_device(bad)


@pytest.mark.parametrize("bad", ["gpu", "", None, 1.5])
def test_unknown_device_is_a_value_error(bad):
    with pytest.raises(ValueError, match="device must be"):
        as_device(bad)


def test_cuda_index_past_the_last_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert as_device("cuda:0").index == 0
    with pytest.raises(ValueError, match=r"device='cuda:3'.*1 CUDA device"):
        as_device("cuda:3")


def test_entry_points_check_the_device(no_gpu, tiny):
    with pytest.raises(ValueError, match="device"):
        mf.GPT.from_config("tiny", device="cuda")
    with pytest.raises(ValueError, match="device"):
        mf.StaticKVCache(1, 1, 1, 4, 4, device="cuda")
    with pytest.raises(ValueError, match="device"):
        mf.StaticKVCache.for_model(tiny, 1, device="cuda")
    with pytest.raises(ValueError, match="device"):
        mf.load_pretrained("shakespeare-draft", device="cuda")
