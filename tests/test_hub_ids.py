"""A Hugging Face hub id ("org/name") loads from the local Hugging Face cache, without network:
a fake cache laid out as huggingface_hub writes it (``models--org--name/refs/main``, the
snapshot's files linked to ``blobs/``) in a temporary folder, with HF_HUB_OFFLINE=1. An id that
is not cached is a FileNotFoundError naming the cache path it looked in and how to download."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

import minifer as mf
from minifer import load_hf_checkpoint
from minifer.hf_checkpoint import is_hub_id

pytest.importorskip("transformers")
hub = pytest.importorskip("huggingface_hub")
from test_hf_checkpoint import write_checkpoint  # noqa: E402  (after the importorskips)

REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An offline Hugging Face cache in `tmp_path` holding ``tiny-org/tiny-qwen``: its files in
    ``blobs/`` by content hash, the snapshot's names linking to them, ``refs/main`` its hash."""
    from huggingface_hub import constants

    root = tmp_path / "hub"
    repo = root / "models--tiny-org--tiny-qwen"
    source = tmp_path / "source"
    source.mkdir()
    hf = write_checkpoint(source, "qwen2")
    (source / "pytorch_model.bin").write_bytes(b"a pickle: never read")
    snapshot, blobs = repo / "snapshots" / REVISION, repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for path in source.iterdir():
        blob = blobs / hashlib.sha256(path.read_bytes()).hexdigest()
        blob.write_bytes(path.read_bytes())
        os.symlink(os.path.relpath(blob, snapshot), snapshot / path.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    for name, value in (("HF_HUB_CACHE", str(root)), ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))  # (read when imported)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return root, hf


def test_a_cached_hub_id_loads_offline(cache, monkeypatch):
    root, hf = cache
    monkeypatch.chdir(root.parent)  # (no folder of that name here either)
    model, tok = load_hf_checkpoint("tiny-org/tiny-qwen")
    ids = torch.randint(0, 2048, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(model(ids), mf.GPT.from_hf(hf)(ids))
    assert tok.vocab_size == 2048 and tok.chat_template
    model2, _ = mf.load_pretrained("tiny-org/tiny-qwen")  # load_pretrained routes there
    assert model2.config == model.config


def test_an_uncached_hub_id_names_the_cache_and_how_to_download(cache):
    root, _ = cache
    with pytest.raises(FileNotFoundError) as err:
        load_hf_checkpoint("nobody/not-cached")
    message = str(err.value)
    assert str(root / "models--nobody--not-cached") in message
    assert "HF_HUB_OFFLINE=1" in message and "hf download nobody/not-cached" in message


def test_a_snapshot_link_outside_its_cache_folder_is_refused(cache, tmp_path):
    root, _ = cache
    snapshot = root / "models--tiny-org--tiny-qwen" / "snapshots" / REVISION
    outside = tmp_path / "elsewhere.json"
    outside.write_text((snapshot / "config.json").read_text())
    (snapshot / "config.json").unlink()
    os.symlink(outside, snapshot / "config.json")
    with pytest.raises(ValueError, match="config.json is a link to .*, outside the checkpoint"):
        load_hf_checkpoint("tiny-org/tiny-qwen")


def test_what_reads_as_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("Qwen/Qwen3-0.6B") and is_hub_id("meta-llama/Llama-3.2-1B-Instruct")
    (tmp_path / "org" / "folder").mkdir(parents=True)
    for name in ("org/folder", "../x", "/abs/path", "a/b/c", "shakespeare", "a/..", "./b"):
        assert not is_hub_id(name), name


def test_the_server_takes_a_hub_id(cache, monkeypatch):
    """``python -m minifer.serve --model org/name`` loads the cached snapshot (README, "Serve
    your own model"); the test runs without a network, as CI does."""
    from minifer.serve.__main__ import load_model

    root, hf = cache
    monkeypatch.chdir(root.parent)
    model, tok = load_model("tiny-org/tiny-qwen", "cpu")
    assert model.config == mf.GPT.from_hf(hf).config and tok.chat_template
    with pytest.raises(SystemExit, match="hub id"):
        load_model("not a model", "cpu")


def test_the_server_loads_in_the_dtype_and_quantization_asked(cache, monkeypatch):
    from minifer.serve.__main__ import build_parser, load_model

    root, _ = cache
    monkeypatch.chdir(root.parent)
    model, _ = load_model("tiny-org/tiny-qwen", "cpu", torch.float32)
    assert next(model.parameters()).dtype == torch.float32
    tiny, _ = load_model("tiny", "cpu", torch.bfloat16)
    assert next(tiny.parameters()).dtype == torch.bfloat16
    args = build_parser().parse_args(["--dtype", "bfloat16", "--quantization", "int8",
                                      "--kv-cache-memory", "2GiB", "--max-model-len", "4096"])
    assert (args.dtype, args.quantization, args.kv_cache_memory, args.max_model_len) == (
        "bfloat16", "int8", 2 * 2**30, 4096)
    assert build_parser().parse_args(["--kv-cache-memory", "0.25"]).kv_cache_memory == 0.25
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--kv-cache-memory", "lots"])
