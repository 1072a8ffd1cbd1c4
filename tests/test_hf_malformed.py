"""A malformed Hugging Face checkpoint folder is refused, before any tensor is read, with a
ValueError naming the file and the field: per-projection shapes, JSON booleans, finite
numbers, conflicting RoPE settings, integer weights, huge sizes, files that are not JSON
objects, an empty vocabulary, and file names or links that lead outside the folder."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file  # (bound before `no_reads` patches them)

from minifer import load_hf_checkpoint

pytest.importorskip("transformers")
from test_hf_checkpoint import write_checkpoint  # noqa: E402  (after the importorskip)


@pytest.fixture
def folder(tmp_path):
    """A tiny random Llama checkpoint (64 wide, 4 query heads and 2 K/V heads of 16)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    write_checkpoint(ckpt, "llama")
    return ckpt


@pytest.fixture
def no_reads(monkeypatch):
    """Reading any tensor data fails the test: the checks come first."""
    import safetensors.torch

    def refuse(*args, **kwargs):
        raise AssertionError("tensor data read before the folder was checked")

    monkeypatch.setattr(safetensors.torch, "load_file", refuse)


def edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def edit_weights(folder, change):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_each_projection_is_checked_before_concatenation(folder, no_reads):
    def shift_rows(t):  # q 64 → 48 rows and k 32 → 48: the same 128 rows once concatenated
        q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
        t[k] = torch.cat([t[k], t[q][48:]])
        t[q] = t[q][:48].contiguous()

    edit_weights(folder, shift_rows)
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'model\.layers\.0\.self_attn"
                                         r"\.k_proj\.weight' has shape \(48, 64\), but config\.json "
                                         r"implies \(32, 64\) \(num_key_value_heads × head_dim"):
        load_hf_checkpoint(folder)


@pytest.mark.parametrize("field", ["tie_word_embeddings", "attention_bias"])
def test_booleans_must_be_json_booleans(folder, no_reads, field):
    edit_config(folder, **{field: "false"})
    with pytest.raises(ValueError, match=f"config.json: {field} must be a JSON boolean"):
        load_hf_checkpoint(folder)


@pytest.mark.parametrize("field, value", [("rope_theta", float("inf")), ("rope_theta", -1.0),
                                          ("rms_norm_eps", float("nan"))])
def test_numbers_must_be_finite_and_positive(folder, no_reads, field, value):
    edit_config(folder, rope_parameters=None, **{field: value})
    with pytest.raises(ValueError, match=f"config.json: {field} must be a positive finite number"):
        load_hf_checkpoint(folder)


def test_conflicting_rope_settings_are_refused(folder, no_reads):
    edit_config(folder, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    with pytest.raises(ValueError, match="rope_parameters.rope_type='default' and "
                                         "rope_scaling.rope_type='llama3' disagree"):
        load_hf_checkpoint(folder)
    edit_config(folder, rope_scaling=None, rope_theta=500000.0)
    with pytest.raises(ValueError, match="rope_theta.* disagree"):
        load_hf_checkpoint(folder)


def test_the_same_rope_settings_in_both_spellings_load(folder):
    edit_config(folder, rope_scaling={"type": "default"}, rope_theta=10000.0)
    model, _ = load_hf_checkpoint(folder)
    assert model.config.rope_theta == 10000.0


def test_integer_weights_are_refused_naming_tensor_and_dtype(folder, no_reads):
    def to_int8(t):
        t["model.layers.1.mlp.up_proj.weight"] = t["model.layers.1.mlp.up_proj.weight"].to(
            torch.int8)

    edit_weights(folder, to_int8)
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'model\.layers\.1\.mlp\."
                                         r"up_proj\.weight' has dtype I8; the weights must be"):
        load_hf_checkpoint(folder)


@pytest.mark.parametrize("field, value", [("head_dim", 10**9), ("hidden_size", 2**40),
                                          ("num_hidden_layers", 10**6), ("head_dim", 1e9),
                                          ("vocab_size", 0)])
def test_huge_sizes_are_refused_before_anything_is_allocated(folder, no_reads, field, value):
    edit_config(folder, **{field: value})
    with pytest.raises(ValueError, match=f"config.json: {field} must be an integer in"):
        load_hf_checkpoint(folder)


def test_a_config_implying_too_many_parameters_is_refused(folder, no_reads):
    edit_config(folder, vocab_size=2**22, hidden_size=2**16, num_hidden_layers=1024,
                intermediate_size=2**18, head_dim=None, num_attention_heads=128,
                num_key_value_heads=128)
    with pytest.raises(ValueError, match="config.json implies .* parameters"):
        load_hf_checkpoint(folder)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json",
                                  "tokenizer_config.json", "generation_config.json"])
def test_json_files_must_hold_objects(folder, name):
    (folder / name).write_text("[1, 2]")
    with pytest.raises(ValueError, match=f"{name} must hold a JSON object, got list"):
        load_hf_checkpoint(folder)


def test_a_missing_vocab_size_is_named(folder, no_reads):
    edit_config(folder, vocab_size=None)
    with pytest.raises(ValueError, match="config.json: vocab_size is missing"):
        load_hf_checkpoint(folder)


def test_an_empty_tokenizer_vocabulary_is_named(folder):
    path = folder / "tokenizer.json"
    tok = json.loads(path.read_text())
    tok["model"]["vocab"], tok["model"]["merges"], tok["added_tokens"] = {}, [], []
    path.write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="tokenizer.json: the tokenizer's vocabulary .* is empty"):
        load_hf_checkpoint(folder)


@pytest.mark.parametrize("shard", ["/etc/passwd", "../outside.safetensors",
                                   "sub/../../outside.safetensors"])
def test_index_entries_must_stay_in_the_folder(folder, no_reads, shard):
    (folder / "model.safetensors").rename(folder.parent / "outside.safetensors")
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": shard}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"index\.json \(weight_map\): file name .* must be a "
                                         r"path relative to the checkpoint folder"):
        load_hf_checkpoint(folder)


def test_a_weights_link_outside_the_folder_is_refused(folder, no_reads):
    outside = folder.parent / "elsewhere.safetensors"
    (folder / "model.safetensors").rename(outside)
    os.symlink(outside, folder / "model.safetensors")
    with pytest.raises(ValueError, match="model.safetensors is a link to .*, outside the "
                                         "checkpoint folder"):
        load_hf_checkpoint(folder)


def test_a_template_link_outside_the_folder_is_refused(folder, no_reads):
    secret = folder.parent / "secret.txt"
    secret.write_text("not a template")
    os.symlink(secret, folder / "chat_template.jinja")
    with pytest.raises(ValueError, match="chat_template.jinja is a link to .*, outside"):
        load_hf_checkpoint(folder)


def test_links_inside_the_folder_are_followed(folder):
    (folder / "weights").mkdir()
    (folder / "model.safetensors").rename(folder / "weights" / "real.safetensors")
    os.symlink("weights/real.safetensors", folder / "model.safetensors")
    model, _ = load_hf_checkpoint(folder)
    assert model.config.n_layer == 2


def test_config_combinations_the_engine_refuses_say_they_come_from_config_json(folder, no_reads):
    edit_config(folder, num_key_value_heads=3)  # 4 query heads: 3 K/V heads cannot share them
    with pytest.raises(ValueError, match=r"config.json describes no model this engine builds: "
                                         r"GPTConfig.n_kv_head .*num_key_value_heads → n_kv_head"):
        load_hf_checkpoint(folder)


def test_add_bos_token_must_be_a_json_boolean(folder, no_reads):
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": "no"}))
    with pytest.raises(ValueError, match="tokenizer_config.json: add_bos_token must be a JSON "
                                         "boolean"):
        load_hf_checkpoint(folder)


def test_a_tensor_in_two_shards_is_refused(tmp_path, no_reads):
    write_checkpoint(tmp_path, "llama", shard=True)
    first, second = sorted(tmp_path.glob("model-*.safetensors"))[:2]
    extra = load_file(first)
    save_file({**load_file(second), **dict([next(iter(extra.items()))])}, second,
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"{second.name}: tensor .* is also in {first.name}"):
        load_hf_checkpoint(tmp_path)
