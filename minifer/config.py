"""Model shapes: `GPTConfig` and the named presets the course uses.

A config is the *shape* of a decoder only (no dtype, device or weights). The defaults are GPT-2
(learned positions, LayerNorm, GELU MLP, biases); `LLAMA`'s switches make it Llama;
``qkv_bias=True`` on top makes it Qwen2, ``qk_norm=True`` Qwen3."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .checks import check_int, check_number


def kv_token_bytes(n_layer: int, n_kv_head: int, head_dim: int, bytes_per_value: float) -> float:
    """The bytes one token's keys and values take in all layers (every cache and estimate here)."""
    return 2 * n_layer * n_kv_head * head_dim * bytes_per_value


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's rotary frequency scaling: wavelengths longer than ``original_context_length /
    low_freq_factor`` are stretched by `factor`, shorter than ``original_context_length /
    high_freq_factor`` kept, the band between interpolated."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context_length: int = 8192

    def __post_init__(self) -> None:
        finite = all(math.isfinite(x) for x in (self.factor, self.low_freq_factor,
                                                 self.high_freq_factor))
        if not (finite and self.factor > 0 and 0 < self.low_freq_factor < self.high_freq_factor):
            raise ValueError(f"RopeScaling needs finite factors, factor > 0 and 0 < low_freq_factor < "
                             f"high_freq_factor, got {self}")
        check_int("RopeScaling.original_context_length", self.original_context_length, 1)


CHOICES = {"positions": ("learned", "rope"), "norm": ("layer", "rms"), "mlp": ("gelu", "swiglu")}
"""The family switches with a closed set of values (the first is GPT-2's)."""


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a pre-norm decoder with a fused QKV projection: GPT-2 by default, Llama or Qwen
    through the family switches below. `n_kv_head` below `n_head`: grouped-query attention
    (1: multi-query; None: multi-head)."""

    vocab_size: int = 1024
    context_length: int = 1024
    n_layer: int = 8
    n_head: int = 8
    n_embd: int = 512
    n_kv_head: int | None = None
    bias: bool = True  # biases in the linear layers and LayerNorms (GPT-2 has them)
    tie_embeddings: bool = False  # output head shares the token-embedding matrix (GPT-2 does)
    eos_token_id: int | None = None  # the model-native end-of-sequence token, if it has one
    layer_norm_eps: float = 1e-5  # the norm's epsilon (LayerNorm's or RMSNorm's)
    # ---- the family switches (defaults: GPT-2) ----
    positions: str = "learned"  # "learned" (a position embedding) or "rope" (rotary: Llama, Qwen)
    rope_theta: float = 10000.0  # rotary base: the longest wavelength is ~2π·rope_theta tokens
    rope_scaling: RopeScaling | None = None  # Llama 3's frequency scaling, or none
    norm: str = "layer"  # "layer" (LayerNorm) or "rms" (RMSNorm: Llama, Qwen)
    mlp: str = "gelu"  # "gelu" (GPT-2's) or "swiglu" (gated SiLU: Llama, Qwen)
    intermediate_size: int | None = None  # the MLP's hidden width; None: 4 × n_embd
    qkv_bias: bool = False  # biases on the Q/K/V projection even with bias=False (Qwen2)
    qk_norm: bool = False  # an RMSNorm on each head's query and key before rotation (Qwen3)
    head_size: int | None = None  # per-head width; None: n_embd // n_head (Qwen3 sets its own)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "n_layer", "n_head", "n_embd"):
            check_int(f"GPTConfig.{name}", getattr(self, name), 1)
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"GPTConfig.{name} must be one of {allowed}, got "
                                 f"{getattr(self, name)!r}")
        for name in ("intermediate_size", "head_size"):
            if getattr(self, name) is not None:
                check_int(f"GPTConfig.{name}", getattr(self, name), 1)
        if self.head_size is None and self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head "
                             f"({self.n_head})")
        check_number("GPTConfig.rope_theta", self.rope_theta, gt=0, finite=True)
        if self.positions == "rope" and self.head_dim % 2:
            raise ValueError(f"GPTConfig: rotary positions rotate pairs of dimensions, so the "
                             f"head dim must be even, got {self.head_dim}")
        if self.positions != "rope" and (self.rope_scaling is not None or self.qk_norm):
            which = "rope_scaling" if self.rope_scaling is not None else "qk_norm"
            raise ValueError(f"GPTConfig.{which} goes with positions='rope' (it acts on the "
                             f"rotary queries and keys), got positions={self.positions!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"GPTConfig.rope_scaling must be a RopeScaling or None, got "
                             f"{self.rope_scaling!r}")
        kv = check_int("GPTConfig.n_kv_head", self.kv_heads, 1, self.n_head,
                       why=f" (a divisor of n_head={self.n_head})")
        if self.n_head % kv:
            raise ValueError(f"GPTConfig.n_kv_head must divide n_head={self.n_head}, got {kv}")
        if self.eos_token_id is not None:
            check_int("GPTConfig.eos_token_id", self.eos_token_id, 0, self.vocab_size - 1,
                      why=" (a token id)")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head if self.head_size is None else self.head_size

    @property
    def mlp_hidden(self) -> int:
        """The MLP's hidden width (each of gate and up for ``mlp="swiglu"``)."""
        return 4 * self.n_embd if self.intermediate_size is None else self.intermediate_size

    @property
    def kv_heads(self) -> int:
        """Number of K/V heads actually used (n_head when n_kv_head is None)."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    def num_params(self) -> int:
        """Parameter count from the shape alone (matches `sum(p.numel() for p in GPT(cfg).parameters())`)."""
        d, hd, b, h = self.n_embd, self.head_dim, int(self.bias), self.mlp_hidden
        qkv_out = (self.n_head + 2 * self.kv_heads) * hd
        ln = 2 * d if self.bias and self.norm == "layer" else d
        up = 2 * h if self.mlp == "swiglu" else h  # gate and up, fused
        block = (
            ln  # ln_1
            + d * qkv_out + int(self.bias or self.qkv_bias) * qkv_out  # fused q, k, v
            + (2 * hd if self.qk_norm else 0)  # q_norm, k_norm
            + self.n_head * hd * d + b * d  # attention output projection
            + ln  # ln_2
            + d * up + b * up  # MLP up (and gate)
            + h * d + b * d  # MLP down
        )
        positions = self.context_length * d if self.positions == "learned" else 0
        embeddings = self.vocab_size * d + positions
        head = 0 if self.tie_embeddings else d * self.vocab_size
        return embeddings + self.n_layer * block + ln + head

    def kv_bytes_per_token(self, bytes_per_value: float = 4) -> float:
        """KV-cache bytes one token costs (`kv_token_bytes`); the default, 4 bytes, is fp32,
        the dtype minifer builds models in (`minifer_course.roofline` assumes a 16-bit served model)."""
        return kv_token_bytes(self.n_layer, self.kv_heads, self.head_dim, bytes_per_value)

    def replace(self, **changes) -> GPTConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> GPTConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(d) - known):
            raise ValueError(f"unknown GPTConfig field(s) {unknown}; known: {sorted(known)}")
        if isinstance(d.get("rope_scaling"), dict):  # as JSON stores it
            d = {**d, "rope_scaling": RopeScaling(**d["rope_scaling"])}
        return cls(**d)

    @classmethod
    def preset(cls, name: str) -> GPTConfig:
        """A named shape: see `PRESETS` for the list."""
        try:
            return PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None


PRESETS: dict[str, GPTConfig] = {
    # the course's reference model, with random weights for timing lessons
    "reference": GPTConfig(vocab_size=1024, context_length=1024, n_layer=8, n_head=8, n_embd=512),
    # GPT-2 small: tied embeddings
    "gpt2": GPTConfig(vocab_size=50257, context_length=1024, n_layer=12, n_head=12, n_embd=768,
                      tie_embeddings=True, eos_token_id=50256),
    # fast tests (the vocabulary fits ByteTokenizer)
    "tiny": GPTConfig(vocab_size=257, context_length=128, n_layer=2, n_head=4, n_embd=32,
                      eos_token_id=256),
    "tiny-gqa": GPTConfig(vocab_size=257, context_length=128, n_layer=2, n_head=4, n_embd=32,
                          n_kv_head=2, eos_token_id=256),
    # the shipped Shakespeare models (`minifer.load_pretrained`), one BPE tokenizer: the target
    "shakespeare": GPTConfig(vocab_size=2048, context_length=256, n_layer=6, n_head=5, n_embd=320,
                             eos_token_id=2047),
    # ... and its draft for speculative decoding
    "shakespeare-draft": GPTConfig(vocab_size=2048, context_length=256, n_layer=2, n_head=2,
                                   n_embd=64, eos_token_id=2047),
}

LLAMA = dict(positions="rope", norm="rms", mlp="swiglu", bias=False)
"""The switches that make a GPTConfig Llama-style (add ``qkv_bias=True`` for Qwen2,
``qk_norm=True`` for Qwen3)."""

PRESETS.update({
    # the reference, Llama-style; the MLP is ⅔ × 4 × n_embd wide (rounded up to a multiple of
    # 32), so its three matrices hold about GPT-2's two matrices' parameters
    "llama-reference": GPTConfig(vocab_size=1024, context_length=1024, n_layer=8, n_head=8,
                                 n_embd=512, intermediate_size=1376, **LLAMA),
    # its tiny twin for fast tests, grouped-query
    "tiny-llama": GPTConfig(vocab_size=257, context_length=128, n_layer=2, n_head=4, n_embd=32,
                            n_kv_head=2, intermediate_size=64, eos_token_id=256, **LLAMA),
})
