"""Hugging Face checkpoints of the GPT-2, Llama, Qwen2 and Qwen3 families, read without transformers.

A model downloaded from the Hugging Face hub is a folder (the hub cache keeps one per revision
under ``~/.cache/huggingface/hub/models--<org>--<name>/snapshots/<revision>/``):

- ``config.json``: the architecture (`config_from_hf` turns it into a `GPTConfig`);
- ``model.safetensors``, or shards listed in ``model.safetensors.index.json``: the weights,
  one tensor per projection (`state_from_hf` fuses Q/K/V, and gate/up, into our layers);
- ``tokenizer.json`` (the `tokenizers` library's file) and ``tokenizer_config.json`` (the chat
  template and the special tokens; newer files keep the template in ``chat_template.jinja``).

`load_hf_checkpoint(folder)` reads all of it with safetensors, json and tokenizers only: no
``transformers``, no network, no pickle. `GPT.from_hf` uses the same two conversions
(`minifer.hf_convert`) for a `transformers` model already in memory.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .device import as_device
from .model import GPT
from .pretrained import read_safetensors
from .tokenizer import Tokenizer

__all__ = ["load_hf_checkpoint", "read_hf_tensors"]

def read_hf_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder: ``model.safetensors``, or the shards named in
    ``model.safetensors.index.json``. (safetensors only: a ``pytorch_model.bin`` pickle is
    refused, since loading a pickle can run code.)"""
    folder = Path(folder).expanduser()
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    else:
        pickled = " (only pickled weights, which are never loaded here)" if any(
            folder.glob("*.bin")) else ""
        raise FileNotFoundError(f"{folder}: no model.safetensors or "
                                f"model.safetensors.index.json{pickled}")
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors.update(read_safetensors(folder / shard, " (named by the folder's index)"))
    return tensors


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or ``{"content": ...}``."""
    return value.get("content") if isinstance(value, dict) else value


def _bos_id(tokenizer: Tokenizer, tc: dict) -> int | None:
    """The BOS id a plain prompt starts with, as transformers' ``tokenizer(text)`` adds it: the
    one token tokenizer.json's post-processor puts before any text (Llama's), unless
    tokenizer_config.json's ``add_bos_token`` says otherwise."""
    added = tokenizer.hf.encode("", add_special_tokens=True).ids
    bos = added[0] if len(added) == 1 else None
    if "add_bos_token" in tc:  # the flag transformers' Llama tokenizer follows
        text = _token_text(tc.get("bos_token"))
        flagged = tokenizer.hf.token_to_id(text) if text is not None else None
        bos = (bos if bos is not None else flagged) if tc["add_bos_token"] else None
    return bos


def _eos_ids(folder: Path, hc: dict) -> list[int]:
    """Every end-of-sequence id that config.json and generation_config.json list (an id or a
    list of ids: Llama 3.1's instruct models stop at any of three)."""
    ids = []
    for config in (hc, _read_json(folder / "generation_config.json")):
        value = config.get("eos_token_id")
        ids += value if isinstance(value, list) else [value]
    return [i for i in ids if isinstance(i, int) and 0 <= i < hc["vocab_size"]]


def load_hf_checkpoint(folder: str | Path, device: torch.device | str | None = None,
                       dtype: torch.dtype | None = None) -> tuple[GPT, Tokenizer]:
    """A Hugging Face checkpoint folder as ``(model in eval mode, tokenizer)``.

    `folder` holds ``config.json``, the safetensors weights and ``tokenizer.json`` (see the
    module doc). `dtype` defaults to the stored one (bf16 for most current checkpoints; pass
    ``torch.float32`` for the engine's exact fp32 path). The tokenizer's end-of-sequence token is
    ``tokenizer_config.json``'s ``eos_token`` (for chat models the end of a turn); every other
    id that config.json or generation_config.json lists ends a reply too. A plain prompt starts
    with the BOS token where the checkpoint's tokenizer adds one (Llama's), as transformers'
    ``tokenizer(text)`` does. The tokenizer carries the checkpoint's chat template, if any.
    """
    # a device this machine lacks: fail before reading any file
    device = None if device is None else as_device(device)
    folder = Path(folder).expanduser()
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder}: no config.json (a Hugging Face checkpoint folder "
                                f"has config.json, model.safetensors and tokenizer.json)")
    hc = _read_json(folder / "config.json")
    model = GPT.from_hf_state(hc, read_hf_tensors(folder), dtype, device)
    tc = _read_json(folder / "tokenizer_config.json")
    eos = _token_text(tc.get("eos_token"))
    tokenizer = Tokenizer.from_file(folder / "tokenizer.json", eos_token=eos or "<|endoftext|>")
    if tokenizer.eos_token_id is None and model.config.eos_token_id is not None:
        tokenizer.eos_token_id = model.config.eos_token_id
    template = tc.get("chat_template")
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    tokenizer.chat_template = template
    tokenizer.bos_token_id = _bos_id(tokenizer, tc)
    tokenizer.more_eos_token_ids = frozenset(_eos_ids(folder, hc)) - {tokenizer.eos_token_id}
    tokenizer.special_tokens_text = {k: _token_text(tc.get(k)) for k in
                                     ("bos_token", "eos_token", "pad_token", "unk_token")}
    return model, tokenizer
