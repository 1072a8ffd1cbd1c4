"""Hugging Face checkpoint folders (GPT-2, Llama, Mistral without a sliding window, Qwen2,
Qwen3) read with safetensors, json and tokenizers only: no transformers, no pickle.

A folder (the hub cache keeps one per revision, ``models--<org>--<name>/snapshots/<rev>/``)
holds ``config.json`` (→ `GPTConfig` by `config_from_hf`), ``model.safetensors`` or the shards
of ``model.safetensors.index.json`` (→ our layers by `state_from_hf`), ``tokenizer.json`` and
``tokenizer_config.json`` (special tokens and chat template, or ``chat_template.jinja``)."""

from __future__ import annotations

import json
import re
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch

from .device import as_device
from .hf_convert import (
    FLOAT_DTYPES,
    check_hf_config,
    check_hf_tensor,
    config_from_hf,
    hf_name,
    hf_tensor_shapes,
)
from .model import GPT
from .tokenizer import Tokenizer

__all__ = ["HUB_FILES", "is_hub_id", "load_hf_checkpoint", "read_hf_tensors",
           "read_safetensors", "resolve_checkpoint"]

HUB_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "chat_template.jinja", "model.safetensors", "model.safetensors.index.json",
             "model-*.safetensors"]
"""What `resolve_checkpoint` fetches of a hub repository (pickled weights never)."""

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def is_hub_id(name: str | Path) -> bool:
    """Whether `name` reads as a Hugging Face hub id (``"org/name"``, e.g. ``"Qwen/Qwen3-0.6B"``)
    rather than a folder: a string of two plain parts, naming no existing path."""
    return (isinstance(name, str) and _HUB_ID.fullmatch(name) is not None
            and ".." not in name and not Path(name).expanduser().exists())


def resolve_checkpoint(name: str | Path) -> Path:
    """The checkpoint folder `name` names: an existing folder, or a hub id's snapshot in the
    Hugging Face cache (downloaded when online); else a FileNotFoundError."""
    folder = Path(name).expanduser()
    if folder.is_dir():
        return folder
    if is_hub_id(name):
        return _from_hub(str(name))
    raise FileNotFoundError(f"{folder}: no config.json (a Hugging Face checkpoint folder has "
                            f"config.json, model.safetensors and tokenizer.json; or give a "
                            f"hub id such as Qwen/Qwen3-0.6B)")


def _from_hub(repo_id: str) -> Path:
    """`repo_id`'s snapshot folder from ``$HF_HUB_CACHE``, downloading `HUB_FILES` when online;
    offline and not cached is a FileNotFoundError naming the cache path and how to download."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.utils import HfHubHTTPError, LocalEntryNotFoundError

    cache = Path(constants.HF_HUB_CACHE)
    looked = cache / ("models--" + repo_id.replace("/", "--"))
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES, cache_dir=cache,
                                      local_files_only=bool(constants.HF_HUB_OFFLINE)))
    except LocalEntryNotFoundError as err:
        why = "HF_HUB_OFFLINE=1 is set" if constants.HF_HUB_OFFLINE else "the hub is unreachable"
        raise FileNotFoundError(
            f"{repo_id}: no such folder, and as a hub id not in the Hugging Face cache (looked "
            f"in {looked}) and {why}; download it once while online (`hf download {repo_id}`, "
            f"or this same call without HF_HUB_OFFLINE), or pass a checkpoint folder") from err
    except HfHubHTTPError as err:  # no such repository, a gated one without a token, ...
        raise FileNotFoundError(f"{repo_id}: no such folder, and the Hugging Face hub did not "
                                f"give it as a hub id (not cached in {looked}): {err}") from err


def _root(folder: Path) -> Path:
    """Where the files of `folder` may really be: inside it, or, for a hub cache snapshot (whose
    files link to ``../../blobs/``), inside its repository's cache folder."""
    real = folder.resolve()
    if real.parent.name == "snapshots" and (real.parent.parent / "blobs").is_dir():
        return real.parent.parent
    return real


def _inside(folder: Path, name: str, where: str | None = None) -> Path:
    """``folder / name``, refused (a ValueError naming `where`, by default that path) unless
    `name` is a plain relative path and the file, links followed, is inside the checkpoint
    (`_root`): never ``/etc/passwd`` through an index entry or a symlink."""
    where = where or str(folder / name)
    if not isinstance(name, str) or not name or PurePosixPath(name).is_absolute() or \
            PureWindowsPath(name).is_absolute() or ".." in re.split(r"[/\\]", name):
        raise ValueError(f"{where}: file name {name!r} must be a path relative to the "
                         f"checkpoint folder, without '..'")
    path = folder / name
    real = path.resolve()
    if not real.is_relative_to(_root(folder)):
        raise ValueError(f"{where}: {name} is a link to {real}, outside the checkpoint folder "
                         f"{folder}; only files inside it are read")
    return path


def _read_json(folder: Path, name: str, required: bool = False) -> dict:
    """The JSON object in `folder`'s file `name` ({} if absent and not `required`), else a
    ValueError naming it."""
    path = _inside(folder, name)
    if not path.is_file():
        if required:
            raise FileNotFoundError(f"{folder}: no {name} (a Hugging Face checkpoint folder has "
                                    f"config.json, model.safetensors and tokenizer.json)")
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON: {err}") from err
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def _weight_files(folder: Path) -> list[Path]:
    """``model.safetensors`` of `folder`, or the shards ``model.safetensors.index.json`` names."""
    index = folder / "model.safetensors.index.json"
    if _inside(folder, index.name).is_file():
        weight_map = _read_json(folder, index.name).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: weight_map must be a non-empty JSON object (tensor name "
                             f"→ shard file name), got {weight_map!r}")
        shards = sorted(set(weight_map.values()), key=str)
        return [_inside(folder, shard, f"{index} (weight_map)") for shard in shards]
    if _inside(folder, "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    pickled = " (only pickled weights, which are never loaded here)" if any(
        folder.glob("*.bin")) or any(folder.glob("*.pt")) else ""
    raise FileNotFoundError(f"{folder}: no model.safetensors or "
                            f"model.safetensors.index.json{pickled}")


def _headers(files: list[Path]) -> dict[str, tuple[tuple[int, ...], str, Path]]:
    """``name → (shape, safetensors dtype, file)`` of every tensor of `files`, from the headers."""
    from safetensors import SafetensorError, safe_open

    headers: dict[str, tuple[tuple[int, ...], str, Path]] = {}
    for path in files:
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint weights not found: {path} (named by the "
                                    f"folder's index)")
        try:
            with safe_open(str(path), framework="pt") as f:
                pieces = {name: f.get_slice(name) for name in f.keys()}
                found = {name: (tuple(p.get_shape()), p.get_dtype(), path)
                         for name, p in pieces.items()}
        except (SafetensorError, OSError, ValueError) as err:
            raise ValueError(f"corrupt checkpoint weights {path}: {err}") from err
        for name in found.keys() & headers.keys():
            raise ValueError(f"{path}: tensor {name!r} is also in {headers[name][2].name}; "
                             f"each tensor must be in one shard only")
        headers.update(found)
    return headers


def read_safetensors(path: Path, missing: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file (never a pickle). A missing file is a
    FileNotFoundError (`missing` says what to do), a damaged one a ValueError naming the file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise FileNotFoundError(f"checkpoint weights not found: {path}{missing}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"corrupt checkpoint weights {path}: {err}") from err


def read_hf_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder's safetensors files (never a pickle: it runs code)."""
    tensors: dict[str, torch.Tensor] = {}
    for path in _weight_files(Path(folder).expanduser()):
        tensors.update(read_safetensors(path, " (named by the folder's index)"))
    return tensors


def _check_weights(hc: dict, headers: dict, dtype: torch.dtype | None) -> None:
    """Every tensor's dtype and shape, from the headers, against config.json `hc`: a ValueError
    naming the file, the tensor and what the config implies."""
    for name, (_, kind, path) in headers.items():
        if kind not in FLOAT_DTYPES:
            check_hf_tensor(name, (), kind, {}, str(path))  # raises, naming the dtype
    stored = FLOAT_DTYPES[next(iter(headers.values()))[1]] if headers else torch.float32
    config = config_from_hf(hc, dtype or stored)
    expected = hf_tensor_shapes(config, hc["model_type"])
    present = set()
    for name, (shape, kind, path) in headers.items():
        if (ours := hf_name(name, hc["model_type"])) is not None:
            check_hf_tensor(ours, shape, kind, expected, str(path))
            present.add(ours)
    optional = {"lm_head.weight"} if config.tie_embeddings else set()
    if missing := sorted(set(expected) - present - optional):
        raise ValueError(f"Hugging Face checkpoint: tensor(s) config.json implies but no "
                         f"safetensors file holds: {missing[:8]}{' ...' * (len(missing) > 8)}")


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it (a string or ``{"content": ...}``)."""
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) else None


def _bos_id(tokenizer: Tokenizer, tc: dict) -> int | None:
    """The BOS id transformers' ``tokenizer(text)`` starts a prompt with: the one token
    tokenizer.json's post-processor adds (Llama's), unless ``add_bos_token`` says otherwise."""
    added = tokenizer.hf.encode("", add_special_tokens=True).ids
    bos = added[0] if len(added) == 1 else None
    if "add_bos_token" in tc:  # the flag transformers' Llama tokenizer follows
        text = _token_text(tc.get("bos_token"))
        flagged = tokenizer.hf.token_to_id(text) if text is not None else None
        bos = (bos if bos is not None else flagged) if tc["add_bos_token"] else None
    return bos


def _eos_ids(folder: Path, hc: dict) -> list[int]:
    """Every end-of-sequence id config.json and generation_config.json list (an id or a list)."""
    ids = []
    for config in (hc, _read_json(folder, "generation_config.json")):
        value = config.get("eos_token_id")
        ids += value if isinstance(value, list) else [value]
    return [i for i in ids if isinstance(i, int) and 0 <= i < hc["vocab_size"]]


def load_hf_checkpoint(folder: str | Path, device: torch.device | str | None = None,
                       dtype: torch.dtype | None = None) -> tuple[GPT, Tokenizer]:
    """A Hugging Face checkpoint folder, or hub id, as ``(model in eval mode, tokenizer)``.

    Every file is checked before the weights are read (config.json field by field, tensors'
    dtypes and shapes from the headers, names and links confined to the folder). `dtype`
    defaults to the stored one. EOS is tokenizer_config.json's ``eos_token``; other ids the
    configs list end a reply too. BOS and the chat template are the checkpoint's."""
    device = None if device is None else as_device(device)  # a missing device: fail first
    folder = resolve_checkpoint(folder)
    hc = _read_json(folder, "config.json", required=True)
    files = _weight_files(folder)  # (no weights, or pickled ones only: said first)
    check_hf_config(hc, str(folder / "config.json"))
    _check_weights(hc, _headers(files), dtype)
    tc = _read_json(folder, "tokenizer_config.json")
    if not isinstance(tc.get("add_bos_token", False), bool):
        raise ValueError(f"{folder / 'tokenizer_config.json'}: add_bos_token must be a JSON "
                         f"boolean (true or false), got {tc['add_bos_token']!r}")
    tok_path = _inside(folder, "tokenizer.json")
    template = _chat_template(folder, tc)
    model = GPT.from_hf_state(hc, read_hf_tensors(folder), dtype, device)
    eos = _token_text(tc.get("eos_token"))
    tokenizer = Tokenizer.from_file(tok_path, eos_token=eos or "<|endoftext|>")
    if tokenizer.eos_token_id is None and model.config.eos_token_id is not None:
        tokenizer.eos_token_id = model.config.eos_token_id
    tokenizer.chat_template = template
    tokenizer.checkpoint_folder = folder  # (a checkpoint's tokenizer: no play-form fallback)
    tokenizer.bos_token_id = _bos_id(tokenizer, tc)
    tokenizer.more_eos_token_ids = frozenset(_eos_ids(folder, hc)) - {tokenizer.eos_token_id}
    tokenizer.special_tokens_text = {k: _token_text(tc.get(k)) for k in
                                     ("bos_token", "eos_token", "pad_token", "unk_token")}
    return model, tokenizer


def _chat_template(folder: Path, tc: dict) -> str | None:
    """The checkpoint's chat template: ``chat_template.jinja``, else tokenizer_config.json's
    ``chat_template`` (a string, or a list of named ones, of which the ``"default"``), else
    None. Anything else is a ValueError naming the file and field."""
    jinja = _inside(folder, "chat_template.jinja")
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tc.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use"...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{folder / 'tokenizer_config.json'}: chat_template must be a string or "
                         f"a list of {{name, template}} with a 'default', got {template!r:.80}")
    return template
