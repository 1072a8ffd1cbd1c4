"""Hugging Face configs and weights → `GPTConfig` and `GPT`'s state dict (GPT-2, Llama,
Mistral without a sliding window, Qwen2, Qwen3), on plain dicts, for `GPT.from_hf` and
`minifer.hf_checkpoint`. An option this engine does not compute is a ValueError naming it: a
model is converted exactly or not at all. A config.json is checked field by field first
(`check_hf_config`), so a damaged file fails with the field's name instead of allocating
gigabytes or silently flipping an option ("false" is a true string)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .checks import check_int, check_number
from .config import LLAMA, GPTConfig, RopeScaling

__all__ = ["FAMILIES", "FLOAT_DTYPES", "MAX_PARAMS", "SIZE_LIMITS", "check_hf_config",
           "config_from_hf", "hf_tensor_shapes", "state_from_hf"]

FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "qwen3")
"""The Hugging Face ``model_type`` values computed exactly (Mistral without a sliding window)."""

SIZE_LIMITS = {  # field → largest value accepted (far above any released model's)
    "vocab_size": 2**22, "hidden_size": 2**16, "n_embd": 2**16, "intermediate_size": 2**18,
    "n_inner": 2**18, "num_hidden_layers": 2**10, "n_layer": 2**10,
    "num_attention_heads": 2**10, "n_head": 2**10, "num_key_value_heads": 2**10,
    "head_dim": 2**12, "max_position_embeddings": 2**24, "n_positions": 2**24,
}
"""Size fields, each an integer in [1, limit], checked before any allocation."""

REQUIRED = {"gpt2": ("vocab_size", "n_positions", "n_layer", "n_head", "n_embd"),
            "llama": ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "max_position_embeddings")}
"""The size fields each layout requires (Llama's serves every other family)."""

MAX_PARAMS = 10**12
"""The most parameters a config may imply (no single GPU holds more)."""

FLOAT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
                "F64": torch.float64}
"""The safetensors dtypes a checkpoint's weights may have."""

_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window",
          "scale_attn_weights", "scale_attn_by_inverse_layer_idx", "add_cross_attention",
          "reorder_and_upcast_attn")
_FLOATS = ("rope_theta", "rms_norm_eps", "layer_norm_epsilon")

_GPT2_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def _unsupported(option: str, value, why: str) -> ValueError:
    return ValueError(f"Hugging Face config {option}={value!r} is not supported: {why}")


def config_from_hf(hc: Mapping, dtype: torch.dtype = torch.float32) -> GPTConfig:
    """The `GPTConfig` of config.json dict `hc`, or a ValueError naming the first option not
    reproduced here or malformed field. `dtype`: the weights' (a GPT-2 option needs it)."""
    kind = check_hf_config(hc)
    config = _gpt2_config(hc, dtype) if kind == "gpt2" else _llama_config(hc, kind)
    if config.num_params() > MAX_PARAMS:
        raise ValueError(f"config.json implies {config.num_params():,} parameters, more than "
                         f"the {MAX_PARAMS:,} accepted (check its sizes: hidden_size, "
                         f"intermediate_size, num_hidden_layers, vocab_size, ...)")
    return config


def _eos(hc: Mapping) -> int | None:
    eos = hc.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos  # Llama 3 lists several: the first
    return eos if isinstance(eos, int) and 0 <= eos < hc["vocab_size"] else None


def _gpt2_config(hc: Mapping, dtype: torch.dtype) -> GPTConfig:
    _check_gpt2_options(hc, dtype)
    return _build(vocab_size=hc["vocab_size"], context_length=hc["n_positions"],
                  n_layer=hc["n_layer"], n_head=hc["n_head"], n_embd=hc["n_embd"],
                  tie_embeddings=bool(hc.get("tie_word_embeddings", True)),
                  eos_token_id=_eos(hc), layer_norm_eps=hc.get("layer_norm_epsilon") or 1e-5)


def _llama_config(hc: Mapping, kind: str) -> GPTConfig:
    _check_llama_options(hc)
    if kind == "mistral":
        _check_mistral_window(hc)
    bias = bool(hc.get("attention_bias", False))
    heads = hc["num_attention_heads"]
    head_dim = hc.get("head_dim") or hc["hidden_size"] // heads
    theta, scaling = _rope(hc)
    return _build(
        vocab_size=hc["vocab_size"], context_length=hc["max_position_embeddings"],
        n_layer=hc["num_hidden_layers"], n_head=heads, n_embd=hc["hidden_size"],
        n_kv_head=hc.get("num_key_value_heads") or heads, rope_theta=theta, rope_scaling=scaling,
        tie_embeddings=bool(hc.get("tie_word_embeddings", False)), eos_token_id=_eos(hc),
        layer_norm_eps=hc.get("rms_norm_eps") or 1e-6, intermediate_size=hc["intermediate_size"],
        head_size=None if head_dim * heads == hc["hidden_size"] else head_dim,
        qkv_bias=kind == "qwen2", qk_norm=kind == "qwen3", **{**LLAMA, "bias": bias})


_OUR_NAMES = ("hidden_size/n_embd → n_embd, num_attention_heads/n_head → n_head, "
              "num_key_value_heads → n_kv_head, head_dim → head_size, max_position_embeddings/"
              "n_positions → context_length, num_hidden_layers/n_layer → n_layer")


def _build(**fields) -> GPTConfig:
    """`GPTConfig(**fields)`; a combination it refuses is a ValueError saying it came from
    config.json and which of its fields are which of ours."""
    try:
        return GPTConfig(**fields)
    except ValueError as err:
        raise ValueError(f"config.json describes no model this engine builds: {err} "
                         f"(config.json's {_OUR_NAMES})") from err


def check_hf_config(hc: Mapping, where: str = "config.json") -> str:
    """The ``model_type`` of config dict `hc` after checking every field this engine reads, or a
    ValueError naming `where`, the field and what is allowed: sizes integers in [1, `SIZE_LIMITS`]
    (the required ones present), booleans JSON booleans (or null), floats finite and positive."""
    if not isinstance(hc, Mapping):
        raise ValueError(f"{where} must be a JSON object, got {type(hc).__name__}")
    kind = hc.get("model_type")
    if kind not in FAMILIES:
        raise _unsupported("model_type", kind, f"the families computed here are {FAMILIES}")
    required = REQUIRED["gpt2" if kind == "gpt2" else "llama"]
    for name in required:
        if hc.get(name) is None:
            raise ValueError(f"{where}: {name} is missing (a {kind} config needs "
                             f"{', '.join(required)})")
    for name, limit in SIZE_LIMITS.items():
        if hc.get(name) is not None:
            check_int(f"{where}: {name}", hc[name], 1, limit)
    for name in _BOOLS:
        if hc.get(name) is not None and not isinstance(hc[name], bool):
            raise ValueError(f"{where}: {name} must be a JSON boolean (true or false), got "
                             f"{hc[name]!r}")
    for name in _FLOATS:
        if hc.get(name) is not None:
            check_number(f"{where}: {name}", hc[name], gt=0, finite=True)
    return kind


def _check_mistral_window(hc: Mapping) -> None:
    """Mistral is Llama-shaped when ``sliding_window`` is null or >= the longest context."""
    window, context = hc.get("sliding_window"), hc["max_position_embeddings"]
    if window is None:
        return
    check_int("config.json: sliding_window", window, 1, why=" (or null)")
    if window < context:
        raise _unsupported("sliding_window", window, f"attention here sees the whole context; "
                           f"a Mistral checkpoint loads when sliding_window is null or >= "
                           f"max_position_embeddings={context}")


def _check_gpt2_options(hc: Mapping, dtype: torch.dtype) -> None:
    """Raise a ValueError naming the first GPT-2 config option `GPT` cannot reproduce."""
    act = hc.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise _unsupported("activation_function", act, "the MLP here uses GPT-2's tanh GELU")
    ours = {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "add_cross_attention": False}  # scores scaled by √head_dim only; decoder-only
    for option, computed in ours.items():
        value = hc.get(option, computed)
        if bool(value) != computed:
            raise _unsupported(option, value, f"this engine computes {option}={computed}")
    n_inner = hc.get("n_inner")
    if n_inner is not None and n_inner != 4 * hc["n_embd"]:
        raise _unsupported("n_inner", n_inner, f"the MLP width here is 4 × n_embd = "
                           f"{4 * hc['n_embd']}")
    if hc.get("reorder_and_upcast_attn", False) and dtype != torch.float32:
        raise _unsupported("reorder_and_upcast_attn", True, f"it computes attention in float32; "
                           f"this engine matches it only for a float32 model, got {dtype} "
                           f"(convert the model with .float() first)")


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
    """``(rope_theta, rope_scaling)`` from ``rope_scaling`` or ``rope_parameters``."""
    params = _rope_params(hc)
    theta = float(check_number("config.json: rope_theta", params.get("rope_theta", 10000.0),
                               gt=0, finite=True))
    kind = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", hc.get("partial_rotary_factor", 1.0)) != 1.0:
        raise _unsupported("partial_rotary_factor", params.get("partial_rotary_factor"),
                           "every head dim is rotated here")
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise _unsupported("rope_scaling", kind, "the only RoPE scaling computed here is "
                           "Llama 3's ('llama3')")
    number = {k: float(check_number(f"config.json: rope_scaling.{k}", params.get(k), gt=0,
                                    finite=True)) for k in ("factor", "low_freq_factor", "high_freq_factor")}
    return theta, RopeScaling(**number, original_context_length=check_int(
        "config.json: rope_scaling.original_max_position_embeddings",
        params.get("original_max_position_embeddings"), 1, SIZE_LIMITS["n_positions"]))


def _rope_params(hc: Mapping) -> dict:
    """The RoPE fields of `hc` as one dict (``rope_theta``, ``rope_type``, ...), merged from
    ``rope_parameters``, ``rope_scaling`` and the top-level ``rope_theta``; a field two of them
    give differently is a ValueError naming both."""
    merged: dict = {}
    sources = {"rope_parameters": hc.get("rope_parameters"), "rope_scaling": hc.get("rope_scaling"),
               "": {"rope_theta": hc.get("rope_theta")}}
    for source, fields in sources.items():
        if fields is not None and not isinstance(fields, Mapping):
            raise ValueError(f"config.json: {source} must be a JSON object or null, got {fields!r}")
        for key, value in (fields or {}).items():
            key = "rope_type" if key == "type" else key
            if value is None:
                continue
            if key in merged and merged[key][0] != value:
                first, other = merged[key][1], f"{source}.{key}" if source else key
                raise ValueError(f"config.json: {first}={merged[key][0]!r} and {other}="
                                 f"{value!r} disagree (give the RoPE settings once, or the "
                                 f"same in both)")
            merged.setdefault(key, (value, f"{source}.{key}" if source else key))
    return {k: v for k, (v, _) in merged.items()}


def hf_tensor_shapes(config: GPTConfig, model_type: str) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of `config` holds, by its name there (q, k and v
    apart; a tied ``lm_head.weight`` too, a file may keep it), and the shape `config` implies."""
    d, hd, h, v = config.n_embd, config.head_dim, config.mlp_hidden, config.vocab_size
    q, kv = config.n_head * hd, config.kv_heads * hd
    if model_type == "gpt2":
        shapes = {"transformer.wte.weight": (v, d), "lm_head.weight": (v, d),
                  "transformer.wpe.weight": (config.context_length, d),
                  "transformer.ln_f.weight": (d,), "transformer.ln_f.bias": (d,)}
        layer = {"ln_1.weight": (d,), "ln_1.bias": (d,), "ln_2.weight": (d,), "ln_2.bias": (d,),
                 "attn.c_attn.weight": (d, 3 * d), "attn.c_attn.bias": (3 * d,),  # Conv1D: in, out
                 "attn.c_proj.weight": (d, d), "attn.c_proj.bias": (d,),
                 "mlp.c_fc.weight": (d, h), "mlp.c_fc.bias": (h,),
                 "mlp.c_proj.weight": (h, d), "mlp.c_proj.bias": (d,)}
        prefix = "transformer.h.{}."
    else:
        shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,),
                  "lm_head.weight": (v, d)}
        layer = {"input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
                 "self_attn.q_proj.weight": (q, d), "self_attn.k_proj.weight": (kv, d),
                 "self_attn.v_proj.weight": (kv, d), "self_attn.o_proj.weight": (d, q),
                 "mlp.gate_proj.weight": (h, d), "mlp.up_proj.weight": (h, d),
                 "mlp.down_proj.weight": (d, h)}
        if config.bias or config.qkv_bias:
            layer |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                      "self_attn.v_proj.bias": (kv,)}
        if config.bias:
            layer |= {"self_attn.o_proj.bias": (d,), "mlp.gate_proj.bias": (h,),
                      "mlp.up_proj.bias": (h,), "mlp.down_proj.bias": (d,)}
        if config.qk_norm:
            layer |= {"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)}
        prefix = "model.layers.{}."
    for i in range(config.n_layer):
        shapes |= {prefix.format(i) + name: shape for name, shape in layer.items()}
    return shapes


def check_hf_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype | str | None,
                    expected: Mapping[str, tuple[int, ...]], where: str = "checkpoint") -> None:
    """A ValueError naming `where` (the file), tensor `name` and what is allowed, unless `shape`
    is `expected`'s and `dtype` (torch's, or a safetensors name) a float one."""
    floats = (*FLOAT_DTYPES, *FLOAT_DTYPES.values())
    if dtype is not None and dtype not in floats:
        raise ValueError(f"{where}: tensor {name!r} has dtype {dtype}; the weights must be "
                         f"float16, bfloat16, float32 or float64 (quantized or integer "
                         f"checkpoints are not read here: load a float one and call "
                         f"minifer.quantize)")
    if name not in expected:
        raise ValueError(f"{where}: tensor {name!r} has no place in this model (config.json's "
                         f"num_hidden_layers, model_type or bias options do not imply it)")
    if tuple(shape) != expected[name]:
        raise ValueError(f"{where}: tensor {name!r} has shape {tuple(shape)}, but config.json "
                         f"implies {expected[name]} ({_shape_fields(name)})")


def _shape_fields(name: str) -> str:
    """The config.json fields a tensor's shape follows from, for an error message."""
    fields = {("q_proj", "o_proj"): "num_attention_heads × head_dim, hidden_size",
              ("k_proj", "v_proj"): "num_key_value_heads × head_dim, hidden_size",
              ("q_norm", "k_norm"): "head_dim", ("embed", "wte", "lm_head"): "vocab_size, "
              "hidden_size", ("_proj.", "mlp."): "intermediate_size, hidden_size",
              ("wpe",): "n_positions, n_embd", ("attn.",): "n_embd"}
    for parts, what in fields.items():
        if any(part in name for part in parts):
            return what
    return "hidden_size"


def hf_name(name: str, model_type: str) -> str | None:
    """A file's tensor name as `hf_tensor_shapes` lists it (older GPT-2 files lack the
    ``transformer.`` prefix), or None for recomputed buffers (causal masks, ``inv_freq``)."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if model_type != "gpt2":
        return name
    if name.endswith((".attn.bias", ".attn.masked_bias")):
        return None
    return name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name


def state_from_hf(tensors: Mapping[str, torch.Tensor], config: GPTConfig, model_type: str
                  ) -> dict[str, torch.Tensor]:
    """`GPT`'s state dict from a Hugging Face one: Q, K, V concatenated into ``c_attn``, gate and
    up into ``c_fc``, GPT-2's `Conv1D` weights transposed, a tied head left out. Each tensor is
    checked first (`check_hf_tensor`); unused or missing ones are a ValueError naming them."""
    expected = hf_tensor_shapes(config, model_type)
    src = {}
    for name, t in tensors.items():
        if (ours := hf_name(name, model_type)) is not None:
            check_hf_tensor(name, t.shape, t.dtype, expected)
            src[ours] = t
    if model_type == "gpt2":
        out = {name: t.t() if name.endswith(_GPT2_CONV1D) else t for name, t in src.items()}
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
    if left := sorted(src):
        raise ValueError(f"Hugging Face checkpoint: tensor(s) this model has no place for: "
                         f"{left[:8]}{' ...' if len(left) > 8 else ''}")
    return out
