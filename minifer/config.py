"""Model shapes: `GPTConfig` and the named presets the course uses.

A config describes the *shape* of a GPT-2-family decoder and nothing else: no dtype, no device,
no weights. The same config builds a model on a laptop CPU in fp32 or on a GPU in bf16.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .checks import check_int


def kv_token_bytes(n_layer: int, n_kv_head: int, head_dim: int, bytes_per_value: float) -> float:
    """The KV-cache formula, the one every cache and estimate here uses: the bytes one token's
    keys and values take in all layers, 2 (K and V) × layers × KV heads × head dim × bytes."""
    return 2 * n_layer * n_kv_head * head_dim * bytes_per_value


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT-2-family decoder (learned positions, pre-LayerNorm, GELU MLP, fused QKV).

    `n_kv_head` below `n_head` gives grouped-query attention (one K/V head shared by a group of
    query heads); `n_kv_head=1` is multi-query attention; `None` means plain multi-head attention.
    """

    vocab_size: int = 1024
    context_length: int = 1024
    n_layer: int = 8
    n_head: int = 8
    n_embd: int = 512
    n_kv_head: int | None = None
    bias: bool = True  # biases in the linear layers and LayerNorms (GPT-2 has them)
    tie_embeddings: bool = False  # output head shares the token-embedding matrix (GPT-2 does)
    eos_token_id: int | None = None  # the model-native end-of-sequence token, if it has one
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            check_int(f"GPTConfig.{name}", value, 1)
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )
        kv = check_int("GPTConfig.n_kv_head", self.kv_heads, 1, self.n_head,
                       why=f" (a divisor of n_head={self.n_head})")
        if self.n_head % kv:
            raise ValueError(f"GPTConfig.n_kv_head must divide n_head={self.n_head}, got {kv}")
        if self.eos_token_id is not None:
            check_int("GPTConfig.eos_token_id", self.eos_token_id, 0, self.vocab_size - 1,
                      why=" (a token id)")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        """Number of K/V heads actually used (n_head when n_kv_head is None)."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    def num_params(self) -> int:
        """Parameter count from the shape alone (matches `sum(p.numel() for p in GPT(cfg).parameters())`)."""
        d, hd, b = self.n_embd, self.head_dim, int(self.bias)
        qkv_out = (self.n_head + 2 * self.kv_heads) * hd
        ln = 2 * d if self.bias else d
        block = (
            ln  # ln_1
            + d * qkv_out + b * qkv_out  # fused q, k, v
            + d * d + b * d  # attention output projection
            + ln  # ln_2
            + d * 4 * d + b * 4 * d  # MLP up
            + 4 * d * d + b * d  # MLP down
        )
        embeddings = self.vocab_size * d + self.context_length * d
        head = 0 if self.tie_embeddings else d * self.vocab_size
        return embeddings + self.n_layer * block + ln + head

    def kv_bytes_per_token(self, bytes_per_value: float = 4) -> float:
        """KV-cache bytes one token costs (`kv_token_bytes`); the default, 4 bytes, is fp32,
        the dtype minifer builds models in (`minifer.roofline` assumes a 16-bit served model)."""
        return kv_token_bytes(self.n_layer, self.kv_heads, self.head_dim, bytes_per_value)

    def replace(self, **changes) -> GPTConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> GPTConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown GPTConfig field(s) {unknown}; known: {sorted(known)}")
        return cls(**d)

    @classmethod
    def preset(cls, name: str) -> GPTConfig:
        """A named shape: see `PRESETS` for the list."""
        try:
            return PRESETS[name]
        except KeyError:
            raise ValueError(
                f"unknown preset {name!r}; choose one of {sorted(PRESETS)}"
            ) from None


PRESETS: dict[str, GPTConfig] = {
    # The course's reference model: 26,792,960 parameters. Used with random weights for timing
    # lessons (timings do not depend on the weights' values).
    "reference": GPTConfig(
        vocab_size=1024, context_length=1024, n_layer=8, n_head=8, n_embd=512
    ),
    # GPT-2 small (124M): tied embeddings, 50,257-token vocabulary.
    "gpt2": GPTConfig(
        vocab_size=50257, context_length=1024, n_layer=12, n_head=12, n_embd=768,
        tie_embeddings=True, eos_token_id=50256,
    ),
    # A few thousand parameters' worth of model for fast tests (vocab fits ByteTokenizer).
    "tiny": GPTConfig(vocab_size=257, context_length=128, n_layer=2, n_head=4, n_embd=32,
                      eos_token_id=256),
    "tiny-gqa": GPTConfig(vocab_size=257, context_length=128, n_layer=2, n_head=4, n_embd=32,
                          n_kv_head=2, eos_token_id=256),
    # The shipped Shakespeare models (trained by `python -m minifer.training`, loaded with
    # `minifer.load_pretrained`). Same 2048-token BPE tokenizer; <|endoftext|> is its last id.
    # Target: 8,791,040 parameters.
    "shakespeare": GPTConfig(vocab_size=2048, context_length=256, n_layer=6, n_head=5, n_embd=320,
                             eos_token_id=2047),
    # Draft for speculative decoding: 23x fewer parameters (378,624), cheap to run.
    "shakespeare-draft": GPTConfig(vocab_size=2048, context_length=256, n_layer=2, n_head=2,
                                   n_embd=64, eos_token_id=2047),
}
