"""Hugging Face model configs and weights → `GPTConfig` and `GPT`'s state dict (GPT-2, Llama,
Qwen2, Qwen3), on plain dicts: no transformers, no torch model.

Used by `GPT.from_hf` (a transformers model in memory) and `minifer.hf_checkpoint` (a checkpoint
folder on disk). Options this engine does not compute (sliding-window attention, RoPE scalings
other than Llama 3's, partial rotary dims, mixture-of-experts, bias layouts other than none, all
or Q/K/V only) are a ValueError naming the option: a model is converted exactly or not at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace

import torch

from .config import LLAMA, GPTConfig, RopeScaling

__all__ = ["FAMILIES", "config_from_hf", "state_from_hf"]

FAMILIES = ("gpt2", "llama", "qwen2", "qwen3")
"""The Hugging Face ``model_type`` values this engine computes exactly."""

_GPT2_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def _unsupported(option: str, value, why: str) -> ValueError:
    return ValueError(f"Hugging Face config {option}={value!r} is not supported: {why}")


def config_from_hf(hc: Mapping, dtype: torch.dtype = torch.float32) -> GPTConfig:
    """The `GPTConfig` of a Hugging Face ``config.json`` (a dict), or a ValueError naming the
    first option this engine would not reproduce. `dtype`: the weights' (GPT-2's fp32-only
    option needs it)."""
    kind = hc.get("model_type")
    if kind not in FAMILIES:
        raise _unsupported("model_type", kind, f"the families computed here are {FAMILIES}")
    eos = hc.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos  # Llama 3 lists several: the first
    eos = eos if isinstance(eos, int) and 0 <= eos < hc["vocab_size"] else None
    if kind == "gpt2":
        _check_gpt2_options(SimpleNamespace(**hc), dtype)
        return GPTConfig(vocab_size=hc["vocab_size"], context_length=hc["n_positions"],
                         n_layer=hc["n_layer"], n_head=hc["n_head"], n_embd=hc["n_embd"],
                         tie_embeddings=bool(hc.get("tie_word_embeddings", True)),
                         eos_token_id=eos, layer_norm_eps=hc.get("layer_norm_epsilon", 1e-5))
    _check_llama_options(hc)
    bias = bool(hc.get("attention_bias", False))
    heads = hc["num_attention_heads"]
    head_dim = hc.get("head_dim") or hc["hidden_size"] // heads
    theta, scaling = _rope(hc)
    return GPTConfig(
        vocab_size=hc["vocab_size"], context_length=hc["max_position_embeddings"],
        n_layer=hc["num_hidden_layers"], n_head=heads, n_embd=hc["hidden_size"],
        n_kv_head=hc.get("num_key_value_heads") or heads,
        tie_embeddings=bool(hc.get("tie_word_embeddings", False)), eos_token_id=eos,
        layer_norm_eps=hc.get("rms_norm_eps", 1e-6), intermediate_size=hc["intermediate_size"],
        rope_theta=float(theta), rope_scaling=scaling,
        head_size=None if head_dim * heads == hc["hidden_size"] else head_dim,
        qkv_bias=kind == "qwen2", qk_norm=kind == "qwen3", **{**LLAMA, "bias": bias},
    )


def _check_gpt2_options(hc, dtype: torch.dtype) -> None:
    """Raise a ValueError naming the first GPT-2 config option `GPT` cannot reproduce."""
    act = getattr(hc, "activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"from_hf supports GPT-2's tanh GELU, got activation {act!r}")
    unsupported = [  # (option, value that this engine computes)
        ("scale_attn_weights", True),  # attention scores divided by √head_dim
        ("scale_attn_by_inverse_layer_idx", False),  # ... and not also by the layer number
        ("add_cross_attention", False),  # a decoder-only model
    ]
    for option, ours in unsupported:
        value = getattr(hc, option, ours)
        if bool(value) != ours:
            raise ValueError(f"from_hf: GPT-2 config {option}={value!r} is not supported "
                             f"(this engine computes {option}={ours})")
    n_inner = getattr(hc, "n_inner", None)
    if n_inner is not None and n_inner != 4 * hc.n_embd:
        raise ValueError(f"from_hf: GPT-2 config n_inner={n_inner!r} is not supported (the MLP "
                         f"width here is 4 × n_embd = {4 * hc.n_embd})")
    if getattr(hc, "reorder_and_upcast_attn", False) and dtype != torch.float32:
        raise ValueError(f"from_hf: GPT-2 config reorder_and_upcast_attn=True computes attention "
                         f"in float32; this engine matches it only for a float32 model, got "
                         f"{dtype} (convert the model with .float() first)")


def _check_llama_options(hc: Mapping) -> None:
    """A ValueError naming the first Llama/Qwen option `GPT` does not compute."""
    if hc.get("hidden_act", "silu") != "silu":
        raise _unsupported("hidden_act", hc["hidden_act"], "the gated MLP here uses SiLU")
    for moe in ("num_experts", "num_local_experts", "n_routed_experts"):
        if hc.get(moe):
            raise _unsupported(moe, hc[moe], "mixture-of-experts MLPs are not computed here")
    if hc.get("use_sliding_window"):
        raise _unsupported("use_sliding_window", True, "attention here sees the whole context")
    layer_types = set(hc.get("layer_types") or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise _unsupported("layer_types", sorted(layer_types), "every layer here is "
                           "full attention (no sliding_window layers)")
    if hc.get("pretraining_tp", 1) not in (1, None):
        raise _unsupported("pretraining_tp", hc["pretraining_tp"], "the linear layers here "
                           "are whole")
    attention_bias, mlp_bias = bool(hc.get("attention_bias")), bool(hc.get("mlp_bias"))
    if hc["model_type"] == "qwen2" and (attention_bias or mlp_bias):
        raise _unsupported("attention_bias" if attention_bias else "mlp_bias", True,
                           "Qwen2's biases here are on Q/K/V only")
    if attention_bias != mlp_bias:
        raise _unsupported("attention_bias", attention_bias, f"with mlp_bias={mlp_bias}: "
                           "biases here are on every linear layer or none (or Q/K/V only)")


def _rope(hc: Mapping) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, rope_scaling)`` from either spelling: ``rope_theta`` + ``rope_scaling``
    (config.json) or ``rope_parameters`` (transformers 5)."""
    params = dict(hc.get("rope_parameters") or hc.get("rope_scaling") or {})
    theta = params.get("rope_theta", hc.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", hc.get("partial_rotary_factor", 1.0)) != 1.0:
        raise _unsupported("partial_rotary_factor", params.get("partial_rotary_factor"),
                           "every head dim is rotated here")
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise _unsupported("rope_scaling", kind, "the only RoPE scaling computed here is "
                           "Llama 3's ('llama3')")
    return theta, RopeScaling(
        factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_context_length=int(params["original_max_position_embeddings"]))


def state_from_hf(tensors: Mapping[str, torch.Tensor], config: GPTConfig, model_type: str
                  ) -> dict[str, torch.Tensor]:
    """`GPT`'s state dict from a Hugging Face one (names as in the safetensors files or in
    ``model.state_dict()``). Q, K, V are concatenated into ``c_attn``, gate and up into
    ``c_fc``; GPT-2's `Conv1D` weights are transposed. A tied output head is left out (the
    embedding is it). Unused tensors are a ValueError naming them."""
    src = dict(tensors)
    if model_type == "gpt2":
        out = {}
        for name, t in src.items():
            if name.endswith((".attn.bias", ".attn.masked_bias")):
                continue  # GPT-2's causal-mask buffers in older files: not weights
            name = name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name
            out[name] = t.t() if name.endswith(_GPT2_CONV1D) else t
        if config.tie_embeddings:
            out.pop("lm_head.weight", None)
        return out

    def take(name: str) -> torch.Tensor:
        if name not in src:
            raise ValueError(f"Hugging Face checkpoint: tensor {name!r} is missing")
        return src.pop(name)

    out = {"transformer.wte.weight": take("model.embed_tokens.weight"),
           "transformer.ln_f.weight": take("model.norm.weight")}
    for i in range(config.n_layer):
        hf, ours = f"model.layers.{i}.", f"transformer.h.{i}."
        out[ours + "ln_1.weight"] = take(hf + "input_layernorm.weight")
        out[ours + "ln_2.weight"] = take(hf + "post_attention_layernorm.weight")
        for kind in ("weight", "bias"):
            if kind == "weight" or config.bias or config.qkv_bias:  # (B) q | k | v rows
                out[ours + f"attn.c_attn.{kind}"] = torch.cat(
                    [take(hf + f"self_attn.{p}_proj.{kind}") for p in "qkv"])
            if kind == "weight" or config.bias:
                out[ours + f"attn.c_proj.{kind}"] = take(hf + f"self_attn.o_proj.{kind}")
                out[ours + f"mlp.c_fc.{kind}"] = torch.cat(  # gate rows, then up rows
                    [take(hf + f"mlp.{p}_proj.{kind}") for p in ("gate", "up")])
                out[ours + f"mlp.c_proj.{kind}"] = take(hf + f"mlp.down_proj.{kind}")
        if config.qk_norm:
            out[ours + "attn.q_norm.weight"] = take(hf + "self_attn.q_norm.weight")
            out[ours + "attn.k_norm.weight"] = take(hf + "self_attn.k_norm.weight")
    head = src.pop("lm_head.weight", None)
    if not config.tie_embeddings:
        out["lm_head.weight"] = head if head is not None else take("lm_head.weight")
    left = sorted(n for n in src if not n.endswith("rotary_emb.inv_freq"))  # (recomputed here)
    if left:
        raise ValueError(f"Hugging Face checkpoint: tensor(s) this model has no place for: "
                         f"{left[:8]}{' ...' if len(left) > 8 else ''}")
    return out
