"""Back-of-the-envelope inference math: how long a decode step or a prefill *must* take.

The roofline model says a step can go no faster than the slower of two things:

* reading every byte it needs from memory (``bytes / bandwidth``), and
* doing every floating-point operation it needs (``FLOPs / peak FLOP/s``).

For a decoder LLM the simple version is (all of it from the course's claims PD-4 ... PD-8):

* FLOPs per token = 2 × parameters (one multiply and one add per weight);
* bytes per decode step = the weights, once, however many sequences share the step
  (plus the KV cache of every sequence, if you ask for it with ``include_kv=True``);
* time per output token (TPOT) = max(read time, compute time).

Everything beyond that (KV-cache reads, attention FLOPs that grow with the context) is *off by
default* so that the claims' round numbers come out exactly; switch it on to see what the simple
model leaves out (claim PD-11).

Units. Bandwidth is in bytes/s, compute in FLOP/s, times in seconds, memory in bytes. When a
number is printed in "GB" it is **decimal** (1 GB = 1e9 bytes, the unit of spec sheets and of
``8B params × 2 bytes = 16 GB``); "GiB"/"KiB" are **binary** (1 GiB = 2**30 bytes, the unit the
KV-cache claims use: 128 KiB per token, 2 GiB per sequence). The constants below name both.

This module is pure arithmetic: it imports neither torch nor plotly, and never measures anything
(`minifer_course.bench.probes` measures this machine and hands it a `Hardware`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from minifer.checks import check_int, check_number
from minifer.config import kv_token_bytes

__all__ = [
    "KB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB",
    "BYTES_PER_VALUE", "HARDWARE", "MODELS",
    "Hardware", "ModelSpec", "DecodeEstimate", "PrefillEstimate",
    "value_bytes", "kv_bytes_per_token", "kv_cache_bytes", "kv_cache_gib", "kv_tokens_fit",
    "kv_crossover_tokens", "weight_bytes", "decode_time", "prefill_time", "roofline_table",
    "ridge_point", "critical_batch", "max_batch", "mbu", "mfu", "e2e_latency",
    "tokens_per_second",
]

# Decimal units (spec sheets, weights: "8B parameters × 2 bytes = 16 GB").
KB, MB, GB, TB = 1e3, 1e6, 1e9, 1e12
# Binary units (memory pages, the KV-cache claims: "128 KiB per token", "2 GiB per sequence").
KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40

BYTES_PER_VALUE: dict[str, float] = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1, "int4": 0.5}
"""Storage bytes of one number in each precision (int4 packs two values per byte)."""

# Weight-only quantization (what `minifer.quantize` does) keeps activations, the KV cache and
# the matmuls themselves in 16-bit: int8/int4 weights are unpacked to bf16 on the fly.
_ACTIVATION_PRECISION = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16",
                         "int8": "bf16", "int4": "bf16"}


# --------------------------------------------------------------------------------------------
# Input checks: every bad input is a ValueError that names the parameter and what is allowed.
# --------------------------------------------------------------------------------------------

def _check_precision(precision: str, name: str = "precision") -> str:
    if precision not in BYTES_PER_VALUE:
        raise ValueError(f"{name} must be one of {list(BYTES_PER_VALUE)}, got {precision!r}")
    return precision


def value_bytes(precision: str | float, name: str = "precision") -> float:
    """Bytes per stored number: a precision name (``"bf16"`` → 2) or a positive number as is."""
    if isinstance(precision, str):
        return BYTES_PER_VALUE[_check_precision(precision, name)]
    if isinstance(precision, bool) or not isinstance(precision, (int, float)):
        raise ValueError(f"{name} must be a precision name {list(BYTES_PER_VALUE)} or a "
                         f"positive number of bytes, got {precision!r}")
    if not (math.isfinite(precision) and precision > 0):
        raise ValueError(f"{name} must be > 0 bytes, got {precision!r}")
    return precision


# --------------------------------------------------------------------------------------------
# Hardware
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Hardware:
    """An accelerator as the roofline sees it: how fast it reads memory and how fast it computes.

    ``bandwidth`` is peak memory bandwidth in bytes/s; ``flops`` maps a precision (``"fp32"``,
    ``"bf16"``, ``"fp16"``, ``"int8"``, ``"int4"``) to peak *dense* FLOP/s (spec sheets often
    print a 2× larger "with sparsity" figure); ``memory_bytes`` is the device memory in bytes.
    """

    name: str
    bandwidth: float
    flops: dict[str, float] = field(hash=False)
    memory_bytes: float

    def __post_init__(self) -> None:
        check_number("Hardware.bandwidth", self.bandwidth, gt=0, finite=True)
        check_number("Hardware.memory_bytes", self.memory_bytes, gt=0, finite=True)
        if not isinstance(self.flops, Mapping) or not self.flops:
            raise ValueError(f"Hardware.flops must be a non-empty dict precision -> FLOP/s, "
                             f"got {self.flops!r}")
        for key, value in self.flops.items():
            _check_precision(key, "Hardware.flops key")
            check_number(f"Hardware.flops[{key!r}]", value, gt=0, finite=True)
        object.__setattr__(self, "flops", dict(self.flops))  # a private copy

    def peak_flops(self, precision: str = "bf16") -> float:
        """Peak dense FLOP/s in ``precision``, falling back when the sheet does not list it.

        Fallback order: the precision itself; its 16-bit twin (bf16 ↔ fp16); for int4 the int8
        rate; then the 16-bit rate, then fp32. So an accelerator described only by a 16-bit figure
        (like the "illustrative" one) answers that figure for every precision. That is optimistic
        for fp32, but it only matters when a step is compute-bound.
        """
        _check_precision(precision)
        order = {
            "fp32": ["fp32", "bf16", "fp16"],
            "bf16": ["bf16", "fp16", "fp32"],
            "fp16": ["fp16", "bf16", "fp32"],
            "int8": ["int8", "bf16", "fp16", "fp32"],
            "int4": ["int4", "int8", "bf16", "fp16", "fp32"],
        }[precision]
        for key in order:
            if key in self.flops:
                return self.flops[key]
        return next(iter(self.flops.values()))  # unreachable with the orders above; be safe

    @classmethod
    def preset(cls, name: str) -> Hardware:
        """A named accelerator from :data:`HARDWARE` (measure this machine with
        `minifer_course.bench.probes.measure_hardware`)."""
        try:
            return HARDWARE[name]
        except KeyError:
            raise ValueError(f"unknown hardware {name!r}; choose one of {list(HARDWARE)} "
                             f"(or pass a Hardware, e.g. minifer_course.bench.this_machine())") from None


HARDWARE: dict[str, Hardware] = {
    # The round-number accelerator of claims PD-5 ... PD-8: 3 TB/s, 1,000 TFLOPS in 16-bit.
    "illustrative": Hardware("illustrative (3 TB/s, 1,000 TFLOPS)", bandwidth=3e12,
                             flops={"bf16": 1e15, "fp16": 1e15}, memory_bytes=80e9),
    # NVIDIA H100 SXM spec sheet: 3.35 TB/s HBM3, 989 TFLOPS dense BF16/FP16 (1,979 is with
    # sparsity), 67 TFLOPS FP32 (no tensor cores), 1,979 TOPS dense INT8. "80 GB".
    "h100": Hardware("H100 SXM", bandwidth=3.35e12,
                     flops={"bf16": 989e12, "fp16": 989e12, "fp32": 67e12, "int8": 1979e12},
                     memory_bytes=80e9),
    # NVIDIA A100 80GB SXM spec sheet: 2,039 GB/s, 312 TFLOPS BF16/FP16, 19.5 FP32, 624 INT8,
    # 1,248 INT4. Memory: the sheet's "80 GB" taken as decimal 80e9 bytes. (The chip really has
    # 80 GiB = 85.9e9 bytes; nvidia-smi shows 81,920 MiB. Decimal is the conservative choice.)
    "a100-80gb": Hardware("A100 80GB SXM", bandwidth=2.039e12,
                          flops={"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12,
                                 "int8": 624e12, "int4": 1248e12},
                          memory_bytes=80e9),
}


def _as_hardware(hw: Hardware | str) -> Hardware:
    if isinstance(hw, Hardware):
        return hw
    if isinstance(hw, str):
        return Hardware.preset(hw)
    raise ValueError(f"hw must be a Hardware or a preset name, got {hw!r}")


# --------------------------------------------------------------------------------------------
# Model shapes
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelSpec:
    """What the roofline needs to know about a decoder: its parameter count and attention shape.

    ``n_kv_head < n_head`` is grouped-query attention (GQA), ``n_kv_head == 1`` multi-query.
    ``params`` is the total parameter count (a float is fine: ``8e9``).
    """

    name: str
    params: float
    n_layer: int
    n_head: int
    n_kv_head: int
    head_dim: int
    d_model: int
    vocab_size: int | None = None
    context_length: int | None = None

    def __post_init__(self) -> None:
        check_number("ModelSpec.params", self.params, gt=0, finite=True)
        for attr in ("n_layer", "n_head", "n_kv_head", "head_dim", "d_model"):
            check_int(f"ModelSpec.{attr}", getattr(self, attr), 1)
        if self.n_kv_head > self.n_head or self.n_head % self.n_kv_head:
            raise ValueError(f"ModelSpec.n_kv_head must divide n_head={self.n_head} and be in "
                             f"[1, {self.n_head}], got {self.n_kv_head}")

    @property
    def gqa_group(self) -> int:
        """Query heads sharing one K/V head (1 = multi-head attention)."""
        return self.n_head // self.n_kv_head

    @classmethod
    def preset(cls, name: str) -> ModelSpec:
        """A named shape from :data:`MODELS`."""
        try:
            return MODELS[name]
        except KeyError:
            raise ValueError(f"unknown model {name!r}; choose one of {list(MODELS)}") from None

    @classmethod
    def from_config(cls, cfg: Any, *, params: float | None = None,
                    name: str | None = None) -> ModelSpec:
        """Build a spec from any config with ``n_layer, n_head, n_embd`` (+ ``n_kv_head``,
        ``vocab_size``, ``context_length``), e.g. :class:`minifer.config.GPTConfig`.

        ``params`` defaults to ``cfg.num_params()`` (or a ``num_params`` attribute).
        ``n_kv_head=None`` means plain multi-head attention.
        """
        try:
            n_layer, n_head, d_model = cfg.n_layer, cfg.n_head, cfg.n_embd
        except AttributeError as err:
            raise ValueError(f"cfg needs n_layer, n_head and n_embd attributes: {err}") from None
        n_kv_head = getattr(cfg, "n_kv_head", None) or n_head
        head_dim = getattr(cfg, "head_dim", None) or d_model // n_head
        if params is None:
            count = getattr(cfg, "num_params", None)
            params = count() if callable(count) else count
            if params is None:
                raise ValueError("params is required: cfg has no num_params")
        return cls(name=name or type(cfg).__name__, params=params, n_layer=n_layer,
                   n_head=n_head, n_kv_head=n_kv_head, head_dim=head_dim, d_model=d_model,
                   vocab_size=getattr(cfg, "vocab_size", None),
                   context_length=getattr(cfg, "context_length", None))


MODELS: dict[str, ModelSpec] = {
    # LLaMA-7B as published: 6.74B parameters, multi-head attention (KV-5).
    "llama-7b": ModelSpec("LLaMA-7B", 6.74e9, n_layer=32, n_head=32, n_kv_head=32,
                          head_dim=128, d_model=4096, vocab_size=32000, context_length=2048),
    # Llama-3-8B, counted as the claims count it: a round 8e9 parameters → 16 GB in 16-bit
    # (PD-5, KV-6). The real checkpoint has 8.03e9. GQA: 8 KV heads for 32 query heads.
    "llama-3-8b": ModelSpec("Llama-3-8B", 8.0e9, n_layer=32, n_head=32, n_kv_head=8,
                            head_dim=128, d_model=4096, vocab_size=128256, context_length=8192),
    # Llama-2-70B (nominal 70e9 parameters; the checkpoint has 69.0e9), GQA 64 → 8 heads (KV-9).
    "llama-2-70b": ModelSpec("Llama-2-70B (GQA)", 70e9, n_layer=80, n_head=64, n_kv_head=8,
                             head_dim=128, d_model=8192, vocab_size=32000, context_length=4096),
    # A counterfactual: Llama-2-70B with plain multi-head attention (64 K/V heads). The parameter
    # count is kept equal so that only the cache differs (real MHA K/V projections would add
    # ~9.4B parameters).
    "llama-2-70b-mha": ModelSpec("Llama-2-70B (MHA, counterfactual)", 70e9, n_layer=80,
                                 n_head=64, n_kv_head=64, head_dim=128, d_model=8192,
                                 vocab_size=32000, context_length=4096),
    # The 6.74B-parameter model of claim PD-4 (LLaMA-7B's shape).
    "6.74b": ModelSpec("6.74B", 6.74e9, n_layer=32, n_head=32, n_kv_head=32, head_dim=128,
                       d_model=4096),
    # Claim KV-8's shape: 80 layers, 8 KV heads of dim 128 (a 70B-class GQA model).
    "80L-8kv": ModelSpec("80 layers, 8 KV heads", 70e9, n_layer=80, n_head=64, n_kv_head=8,
                         head_dim=128, d_model=8192),
    # The course's reference GPT (GPTConfig preset "reference"): 26,792,960 parameters.
    "reference": ModelSpec("reference GPT (26.8M)", 26_792_960, n_layer=8, n_head=8,
                           n_kv_head=8, head_dim=64, d_model=512, vocab_size=1024,
                           context_length=1024),
}


def _as_spec(spec: ModelSpec | str) -> ModelSpec:
    if isinstance(spec, ModelSpec):
        return spec
    if isinstance(spec, str):
        return ModelSpec.preset(spec)
    raise ValueError(f"spec must be a ModelSpec or a preset name, got {spec!r}")


# --------------------------------------------------------------------------------------------
# Memory: weights and KV cache
# --------------------------------------------------------------------------------------------

def weight_bytes(spec: ModelSpec | str, bytes_per_param: str | float = "bf16") -> float:
    """Bytes of the weights: parameters × bytes per parameter (8e9 × 2 = 16e9 = 16 GB)."""
    return _as_spec(spec).params * value_bytes(bytes_per_param, "bytes_per_param")


def kv_bytes_per_token(spec: ModelSpec | str, bytes_per_value: str | float = 2) -> float:
    """KV-cache bytes one token costs: 2 (K and V) × layers × KV heads × head dim × bytes
    (`minifer.config.kv_token_bytes`); by default 16-bit, as a served model's cache is.

    Llama-3-8B in 16-bit: 2 × 32 × 8 × 128 × 2 = 131,072 B = 128 KiB (claim KV-6).
    """
    s = _as_spec(spec)
    return kv_token_bytes(s.n_layer, s.n_kv_head, s.head_dim, _bpv(bytes_per_value))


def _bpv(value: str | float) -> float:
    return value_bytes(value, "bytes_per_value")


def kv_cache_bytes(spec: ModelSpec | str, tokens: int, batch: int = 1,
                   bytes_per_value: str | float = 2) -> float:
    """KV-cache bytes for ``batch`` sequences of ``tokens`` tokens each (linear in both)."""
    check_int("tokens", tokens, 0)
    check_int("batch", batch, 0)
    return kv_bytes_per_token(spec, bytes_per_value) * tokens * batch


def kv_cache_gib(layers: int, kv_heads: int, head_dim: int, tokens: int, batch: int,
                 bytes_per_value: str | float = 2) -> float:
    """KV-cache size in GiB (binary, 2**30 bytes) straight from the shape (claim KV-10).

    ``kv_cache_gib(32, 8, 128, tokens=4096, batch=4)`` = 2.0 GiB.
    """
    check_int("layers", layers, 1)
    check_int("kv_heads", kv_heads, 1)
    check_int("head_dim", head_dim, 1)
    check_int("tokens", tokens, 0)
    check_int("batch", batch, 0)
    return kv_token_bytes(layers, kv_heads, head_dim, _bpv(bytes_per_value)) * tokens * batch / GiB


def kv_tokens_fit(spec: ModelSpec | str, free_bytes: float,
                  bytes_per_value: str | float = 2) -> int:
    """How many tokens of KV cache (summed over all sequences) fit in ``free_bytes``.

    Claim KV-7 in binary units: 64 GiB / 128 KiB per token = 524,288 tokens.
    """
    check_number("free_bytes", free_bytes, ge=0, finite=True)
    return int(free_bytes // kv_bytes_per_token(spec, bytes_per_value))


def kv_crossover_tokens(spec: ModelSpec | str, batch: int = 1, precision: str = "bf16",
                        kv_precision: str | None = None) -> int:
    """The context length from which the KV cache of ``batch`` sequences outweighs the weights.

    Llama-3-8B, 16-bit, batch 1: 16e9 / 131,072 → 122,071 tokens; at batch 32 only 3,815
    (claim KV-11: for long contexts or large batches the cache exceeds the weights).
    """
    check_int("batch", batch, 1)
    kv_precision = _kv_precision(precision, kv_precision)
    per_token = kv_bytes_per_token(spec, kv_precision) * batch
    return math.floor(weight_bytes(spec, precision) / per_token) + 1


def _kv_precision(precision: str, kv_precision: str | None) -> str:
    """The KV cache stays in the activation precision unless told otherwise."""
    _check_precision(precision)
    if kv_precision is None:
        return _ACTIVATION_PRECISION[precision]
    return _check_precision(kv_precision, "kv_precision")


def _compute_precision(precision: str, compute_precision: str | None) -> str:
    _check_precision(precision)
    if compute_precision is None:
        return _ACTIVATION_PRECISION[precision]
    return _check_precision(compute_precision, "compute_precision")


# --------------------------------------------------------------------------------------------
# Time: decode steps and prefills
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DecodeEstimate:
    """One decode step of ``batch`` sequences (each makes one new token), roofline estimate.

    Times in seconds, sizes in bytes. ``tpot_s = max(read_s, compute_s)``.
    """

    model: str
    hardware: str
    batch: int
    context: int
    precision: str  # of the weights
    compute_precision: str  # of the matmuls (bf16 for int8/int4 weight-only quantization)
    kv_precision: str
    weight_bytes: float
    kv_bytes: float
    bytes_read: float
    flops: float
    read_s: float
    compute_s: float
    tpot_s: float
    bound: str  # "memory" or "compute"
    arithmetic_intensity: float  # FLOP per byte read
    tokens_per_s_per_user: float
    tokens_per_s_total: float
    mbu: float  # fraction of peak bandwidth the step uses (read_s / tpot_s)
    mfu: float  # fraction of peak FLOP/s the step uses (compute_s / tpot_s)

    @property
    def tpot_ms(self) -> float:
        return self.tpot_s * 1e3


@dataclass(frozen=True)
class PrefillEstimate:
    """A prefill of ``batch`` prompts of ``prompt_tokens`` tokens each, roofline estimate.

    ``ttft_s = max(read_s, compute_s)`` is the time to first token, queueing excluded.
    """

    model: str
    hardware: str
    batch: int
    prompt_tokens: int
    precision: str
    compute_precision: str
    weight_bytes: float
    bytes_read: float
    flops: float
    read_s: float
    compute_s: float
    ttft_s: float
    bound: str
    arithmetic_intensity: float
    tokens_per_s: float  # prompt tokens processed per second, all prompts together
    mbu: float
    mfu: float

    @property
    def ttft_ms(self) -> float:
        return self.ttft_s * 1e3


def _attention_flops_per_token(spec: ModelSpec, context: int) -> float:
    """FLOPs of attention for one new token over ``context`` cached tokens.

    Per layer and query head: q·K (2 × context × head_dim) and weights·V (the same again).
    """
    return 4 * spec.n_layer * spec.n_head * spec.head_dim * context


def _roof(flops: float, nbytes: float, hw: Hardware, compute_precision: str):
    read_s = nbytes / hw.bandwidth
    compute_s = flops / hw.peak_flops(compute_precision)
    time_s = max(read_s, compute_s)
    bound = "compute" if compute_s > read_s else "memory"
    return read_s, compute_s, time_s, bound, read_s / time_s, compute_s / time_s


def decode_time(spec: ModelSpec | str, hw: Hardware | str, batch: int = 1, context: int = 0,
                precision: str = "bf16", include_kv: bool = False,
                include_attention: bool = False, kv_precision: str | None = None,
                compute_precision: str | None = None) -> DecodeEstimate:
    """Roofline time of one decode step: every sequence in the batch makes one token.

    Bytes read = weights once (shared by the batch) [+ the KV cache of ``batch × context``
    tokens if ``include_kv``]. FLOPs = 2 × params × batch [+ attention over ``context`` tokens
    if ``include_attention``]. ``precision`` is the weights' precision; the KV cache and the
    matmuls default to its activation precision (bf16 for int8/int4 weight-only quantization).

    8B model, 16-bit, 3 TB/s, 1,000 TFLOPS: batch 1 → 5.33 ms, memory-bound, 188 tokens/s;
    batch 512 → 8.19 ms, compute-bound, 62,500 tokens/s (claim PD-8).
    """
    spec, hw = _as_spec(spec), _as_hardware(hw)
    check_int("batch", batch, 1)
    check_int("context", context, 0)
    kv_p = _kv_precision(precision, kv_precision)
    cp = _compute_precision(precision, compute_precision)
    wb = weight_bytes(spec, precision)
    kvb = kv_cache_bytes(spec, context, batch, kv_p) if include_kv else 0.0
    flops = 2 * spec.params * batch
    if include_attention:
        flops += _attention_flops_per_token(spec, context) * batch
    nbytes = wb + kvb
    read_s, compute_s, tpot, bound, mbu_, mfu_ = _roof(flops, nbytes, hw, cp)
    return DecodeEstimate(model=spec.name, hardware=hw.name, batch=batch, context=context,
                      precision=precision, compute_precision=cp, kv_precision=kv_p,
                      weight_bytes=wb, kv_bytes=kvb, bytes_read=nbytes,
                      flops=flops, read_s=read_s, compute_s=compute_s, tpot_s=tpot, bound=bound,
                      arithmetic_intensity=flops / nbytes, tokens_per_s_per_user=1 / tpot,
                      tokens_per_s_total=batch / tpot, mbu=mbu_, mfu=mfu_)


def prefill_time(spec: ModelSpec | str, hw: Hardware | str, prompt_tokens: int, batch: int = 1,
            precision: str = "bf16", include_attention: bool = False,
            compute_precision: str | None = None) -> PrefillEstimate:
    """Roofline time of a prefill: all ``prompt_tokens`` of ``batch`` prompts in one pass.

    Bytes read = the weights once; FLOPs = 2 × params × tokens [+ causal attention: token i
    attends to i tokens, 4 × layers × heads × head_dim × T(T+1)/2 per prompt]. 2,000 tokens on
    the 8B model: 32 TFLOP = 32 ms of compute against 5.3 ms of reading: compute-bound (PD-7).
    """
    spec, hw = _as_spec(spec), _as_hardware(hw)
    check_int("prompt_tokens", prompt_tokens, 1)
    check_int("batch", batch, 1)
    cp = _compute_precision(precision, compute_precision)
    wb = weight_bytes(spec, precision)
    flops = 2 * spec.params * prompt_tokens * batch
    if include_attention:
        pairs = prompt_tokens * (prompt_tokens + 1) / 2
        flops += 4 * spec.n_layer * spec.n_head * spec.head_dim * pairs * batch
    read_s, compute_s, ttft, bound, mbu_, mfu_ = _roof(flops, wb, hw, cp)
    return PrefillEstimate(model=spec.name, hardware=hw.name, batch=batch, prompt_tokens=prompt_tokens,
                   precision=precision, compute_precision=cp, weight_bytes=wb, bytes_read=wb, flops=flops,
                   read_s=read_s, compute_s=compute_s, ttft_s=ttft, bound=bound,
                   arithmetic_intensity=flops / wb,
                   tokens_per_s=prompt_tokens * batch / ttft, mbu=mbu_, mfu=mfu_)


def roofline_table(spec: ModelSpec | str, hw: Hardware | str, batches: Iterable[int],
                   context: int = 0, precision: str = "bf16", include_kv: bool = False,
                   include_attention: bool = False,
                   kv_precision: str | None = None) -> list[DecodeEstimate]:
    """`decode_time` for each batch size: the table of claim PD-8, one row per batch."""
    return [decode_time(spec, hw, batch=b, context=context, precision=precision,
                        include_kv=include_kv, include_attention=include_attention,
                        kv_precision=kv_precision) for b in batches]


def ridge_point(hw: Hardware | str, precision: str = "bf16") -> float:
    """FLOP per byte at which compute time equals read time: peak FLOP/s ÷ bandwidth.

    Below it a step is memory-bound, above it compute-bound. 1e15 / 3e12 ≈ 333 (claim PD-6).
    """
    hw = _as_hardware(hw)
    return hw.peak_flops(_check_precision(precision)) / hw.bandwidth


def critical_batch(spec: ModelSpec | str, hw: Hardware | str, precision: str = "bf16",
                   compute_precision: str | None = None) -> float:
    """The decode batch size at which the simple model turns compute-bound (BATCH-2).

    Decode's arithmetic intensity is 2 × batch / bytes-per-param, so the switch happens at
    ridge × bytes-per-param / 2: ≈ 333 for 16-bit weights on the illustrative accelerator, and
    4× lower for int4 weights (they are read 4× faster but computed at the same 16-bit rate).
    """
    _as_spec(spec)  # validated; the answer depends only on the bytes per parameter
    cp = _compute_precision(precision, compute_precision)
    return ridge_point(hw, cp) * BYTES_PER_VALUE[precision] / 2


def max_batch(spec: ModelSpec | str, hw: Hardware | str, context: int,
              precision: str = "bf16", kv_precision: str | None = None) -> int:
    """How many sequences of ``context`` tokens fit in device memory after the weights.

    floor((memory − weight bytes) / (KV bytes per token × context)); 0 when the weights alone do
    not fit. Activations and fragmentation are ignored, so this is an upper bound.
    Llama-3-8B on an 80 GB (decimal) A100 in 16-bit: 119 sequences at 4,096 tokens (BATCH-3).
    """
    spec, hw = _as_spec(spec), _as_hardware(hw)
    check_int("context", context, 1)
    free = hw.memory_bytes - weight_bytes(spec, precision)
    if free <= 0:
        return 0
    per_seq = kv_cache_bytes(spec, context, 1, _kv_precision(precision, kv_precision))
    return int(free // per_seq)


# --------------------------------------------------------------------------------------------
# Utilisation and latency
# --------------------------------------------------------------------------------------------

def mbu(weight_bytes: float, kv_bytes: float, tpot_s: float, peak_bandwidth: float) -> float:
    """Model bandwidth utilisation: (weight + KV bytes) / TPOT / peak bandwidth, a fraction.

    A 7B model in 16-bit (14 GB) at a TPOT of 14 ms moves 1 TB/s: 0.5 of a 2 TB/s peak (PD-10).
    """
    check_number("weight_bytes", weight_bytes, ge=0, finite=True)
    check_number("kv_bytes", kv_bytes, ge=0, finite=True)
    check_number("tpot_s", tpot_s, gt=0, finite=True)
    check_number("peak_bandwidth", peak_bandwidth, gt=0, finite=True)
    return (weight_bytes + kv_bytes) / tpot_s / peak_bandwidth


def mfu(achieved_flops_per_s: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s ÷ peak FLOP/s, a fraction (compute-bound phases)."""
    check_number("achieved_flops_per_s", achieved_flops_per_s, ge=0, finite=True)
    check_number("peak_flops", peak_flops, gt=0, finite=True)
    return achieved_flops_per_s / peak_flops


def e2e_latency(ttft_s: float, tpot_s: float, output_tokens: int,
                first_token_in_ttft: bool = False) -> float:
    """End-to-end latency ≈ TTFT + TPOT × output tokens: 0.3 + 0.02 × 500 = 10.3 s (MET-2).

    Strictly the first token arrives at TTFT, so only ``output_tokens − 1`` decode steps follow
    (vLLM's benchmark defines TPOT that way); pass ``first_token_in_ttft=True`` for that count.
    """
    check_number("ttft_s", ttft_s, ge=0, finite=True)
    check_number("tpot_s", tpot_s, ge=0, finite=True)
    check_int("output_tokens", output_tokens, 1 if first_token_in_ttft else 0)
    steps = output_tokens - 1 if first_token_in_ttft else output_tokens
    return ttft_s + tpot_s * steps


def tokens_per_second(tpot_s: float, batch: int = 1) -> float:
    """Tokens per second from a TPOT: ``batch / tpot_s`` (batch 1: per user; 100 ms → 10)."""
    check_number("tpot_s", tpot_s, gt=0, finite=True)
    check_int("batch", batch, 1)
    return batch / tpot_s


# --------------------------------------------------------------------------------------------
# Tensor parallelism: the model split over N devices that all-reduce at every layer (PAR-1/2)
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Interconnect:
    """The link between devices as the ring all-reduce sees it.

    ``bandwidth``: bytes/s one device can send (and at the same time receive) in one direction;
    spec sheets often print the two directions added up. ``latency``: seconds of fixed cost per
    ring step (launch, synchronisation, the wire), the term that dominates the small messages of
    decode.
    """

    name: str
    bandwidth: float
    latency: float = 0.0

    def __post_init__(self) -> None:
        check_number("Interconnect.bandwidth", self.bandwidth, gt=0, finite=True)
        check_number("Interconnect.latency", self.latency, ge=0, finite=True)

    @classmethod
    def preset(cls, name: str) -> Interconnect:
        """A named link from :data:`INTERCONNECTS`."""
        try:
            return INTERCONNECTS[name]
        except KeyError:
            raise ValueError(f"unknown interconnect {name!r}; choose one of "
                             f"{list(INTERCONNECTS)}") from None


INTERCONNECTS: dict[str, Interconnect] = {
    # Bandwidths per direction from the spec sheets (NVLink: H100 SXM 900 GB/s and A100 600 GB/s
    # "total", i.e. both directions; PCIe x16: 4.0 ≈ 32 GB/s, 5.0 ≈ 64 GB/s each way). The
    # latencies are illustrative round numbers of the right order (microseconds per ring step),
    # not measurements: a real all-reduce library's small-message cost depends on its algorithm.
    "nvlink-h100": Interconnect("NVLink 4 (H100 SXM, 450 GB/s per direction)", 450e9, 1e-6),
    "nvlink-a100": Interconnect("NVLink 3 (A100 SXM, 300 GB/s per direction)", 300e9, 1e-6),
    "pcie-5": Interconnect("PCIe 5.0 x16 (64 GB/s per direction)", 64e9, 5e-6),
    "pcie-4": Interconnect("PCIe 4.0 x16 (32 GB/s per direction)", 32e9, 5e-6),
    # Between machines (disaggregated serving sends a prompt's K/V over these, PD-12): line
    # rates in bits/s ÷ 8 (400 Gb/s: an InfiniBand NDR or RoCE NIC); latencies illustrative.
    "ethernet-400g": Interconnect("400 Gb/s network (50 GB/s per direction)", 50e9, 5e-6),
    "ethernet-100g": Interconnect("100 Gb/s Ethernet (12.5 GB/s per direction)", 12.5e9, 10e-6),
}


def _as_link(link: Interconnect | str) -> Interconnect:
    if isinstance(link, Interconnect):
        return link
    if isinstance(link, str):
        return Interconnect.preset(link)
    raise ValueError(f"link must be an Interconnect or a preset name, got {link!r}")


def allreduce_time(nbytes: float, world: int, bandwidth: float, latency: float = 0.0) -> float:
    """Seconds for a ring all-reduce of ``nbytes`` (the size of the tensor) over ``world`` devices.

    The ring algorithm is a reduce-scatter followed by an all-gather: ``2(N-1)`` steps, in each
    of which every device sends ``nbytes / N`` to its neighbour. With the usual latency-bandwidth
    cost model (Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication
    Operations in MPICH", 2005; Patarasuk & Yuan, "Bandwidth Optimal All-reduce Algorithms for
    Clusters of Workstations", 2009):

        T = 2(N-1) · latency + 2(N-1)/N · nbytes / bandwidth

    The bandwidth term barely grows with N (it tends to 2 · nbytes / bandwidth), the latency
    term grows linearly. One device needs no all-reduce: 0 s. NCCL's "bus bandwidth" is the
    same 2(N-1)/N factor applied to measured times.
    """
    check_number("nbytes", nbytes, ge=0, finite=True)
    check_int("world", world, 1)
    check_number("bandwidth", bandwidth, gt=0, finite=True)
    check_number("latency", latency, ge=0, finite=True)
    if world == 1:
        return 0.0
    steps = 2 * (world - 1)
    return steps * latency + steps / world * nbytes / bandwidth


@dataclass(frozen=True)
class TPDecode:
    """One decode step of a model split over ``degree`` devices by tensor parallelism.

    Per device: 1/degree of the weights and of the K/V heads (K/V heads are copied when there
    are fewer of them than devices), 1/degree of the FLOPs, and two all-reduces of
    ``batch × d_model`` activations per layer on the critical path (not overlapped).
    ``tpot_s = max(read_s, compute_s) + comm_s``. Bytes and seconds.
    """

    model: str
    hardware: str
    interconnect: str
    degree: int
    batch: int
    context: int
    precision: str
    weight_bytes_per_device: float
    kv_bytes_per_device: float
    memory_per_device: float  # weights + KV cache
    fits: bool  # memory_per_device <= the device's memory
    allreduces_per_step: int
    allreduce_bytes: float  # size of one all-reduced activation tensor
    read_s: float
    compute_s: float
    comm_s: float
    tpot_s: float
    tokens_per_s: float  # this group of devices: batch / tpot
    tokens_per_s_per_device: float

    @property
    def tpot_ms(self) -> float:
        return self.tpot_s * 1e3

    @property
    def comm_fraction(self) -> float:
        """Share of the step spent all-reducing."""
        return self.comm_s / self.tpot_s


def tp_decode(spec: ModelSpec | str, hw: Hardware | str, degree: int,
              link: Interconnect | str = "nvlink-h100", batch: int = 1, context: int = 0,
              precision: str = "bf16", kv_precision: str | None = None) -> TPDecode:
    """Roofline time of a decode step with tensor parallelism of ``degree`` (claims PAR-1, PAR-2).

    Each device reads its 1/degree of the weights (and of the KV cache of ``batch × context``
    tokens) and does 1/degree of the FLOPs, then waits for ``2 × n_layer`` ring all-reduces of
    ``batch × d_model`` activations (:func:`allreduce_time`). Everything is assumed split
    evenly, embeddings included (Megatron splits them too); ``degree`` must divide ``n_head``.
    Llama-2-70B in 16-bit on H100s: degree 1 does not fit in 80 GB; degree 8 over NVLink reads
    17.5 GB per device per step.
    """
    spec, hw, link = _as_spec(spec), _as_hardware(hw), _as_link(link)
    check_int("degree", degree, 1)
    if spec.n_head % degree:
        raise ValueError(f"degree must divide n_head={spec.n_head} (whole heads per device), "
                         f"got {degree}")
    check_int("batch", batch, 1)
    check_int("context", context, 0)
    kv_p = _kv_precision(precision, kv_precision)
    act = BYTES_PER_VALUE[_ACTIVATION_PRECISION[precision]]
    wb = weight_bytes(spec, precision) / degree
    kv_heads_here = math.ceil(spec.n_kv_head / degree)  # copies when degree > n_kv_head
    kvb = kv_cache_bytes(spec, context, batch, kv_p) * kv_heads_here / spec.n_kv_head
    flops = 2 * spec.params * batch / degree
    read_s = (wb + kvb) / hw.bandwidth
    compute_s = flops / hw.peak_flops(_compute_precision(precision, None))
    n_ar = 2 * spec.n_layer
    ar_bytes = batch * spec.d_model * act
    comm_s = n_ar * allreduce_time(ar_bytes, degree, link.bandwidth, link.latency)
    tpot = max(read_s, compute_s) + comm_s
    return TPDecode(model=spec.name, hardware=hw.name, interconnect=link.name, degree=degree,
                    batch=batch, context=context, precision=precision,
                    weight_bytes_per_device=wb, kv_bytes_per_device=kvb,
                    memory_per_device=wb + kvb, fits=wb + kvb <= hw.memory_bytes,
                    allreduces_per_step=n_ar if degree > 1 else 0, allreduce_bytes=ar_bytes,
                    read_s=read_s, compute_s=compute_s, comm_s=comm_s, tpot_s=tpot,
                    tokens_per_s=batch / tpot, tokens_per_s_per_device=batch / tpot / degree)


def tp_table(spec: ModelSpec | str, hw: Hardware | str, degrees: Iterable[int] = (1, 2, 4, 8),
             link: Interconnect | str = "nvlink-h100", batch: int = 1, context: int = 0,
             precision: str = "bf16", kv_precision: str | None = None) -> list[TPDecode]:
    """:func:`tp_decode` for each degree: latency falls with the degree, throughput per device
    falls too once all-reduces take a visible share of the step (PAR-2)."""
    return [tp_decode(spec, hw, d, link, batch, context, precision, kv_precision)
            for d in degrees]


__all__ += ["Interconnect", "INTERCONNECTS", "TPDecode", "allreduce_time", "tp_decode",
            "tp_table"]


# --------------------------------------------------------------------------------------------
# Disaggregated serving: a prompt's K/V sent from the prefill device to the decode device (PD-12)
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KVTransfer:
    """One prompt's K/V moved over a link: bytes and seconds (latency + bytes / bandwidth)."""

    model: str
    interconnect: str
    prompt_tokens: int
    kv_precision: str
    nbytes: float  # kv_bytes_per_token × prompt_tokens
    seconds: float

    @property
    def ms(self) -> float:
        return self.seconds * 1e3


def kv_transfer(spec: ModelSpec | str, prompt_tokens: int, link: Interconnect | str = "nvlink-h100",
                kv_precision: str = "bf16") -> KVTransfer:
    """What handing one prompt from a prefill device to a decode device costs (claim PD-12).

    The decode device needs the prompt's whole K/V: ``kv_bytes_per_token × prompt_tokens``
    bytes, sent once, in one message: ``latency + bytes / bandwidth`` (no ring: one sender,
    one receiver). Llama-3-8B, 16-bit, 4,096 tokens: 536,870,912 B (512 MiB), 1.19 ms over
    NVLink 4, 8.4 ms over PCIe 5.0, 43 ms over 100 Gb/s Ethernet. Real systems send layer by
    layer while the prefill runs, hiding most of it; this is the cost before any overlap.
    """
    spec, link = _as_spec(spec), _as_link(link)
    check_int("prompt_tokens", prompt_tokens, 1)
    nbytes = kv_bytes_per_token(spec, kv_precision) * prompt_tokens
    return KVTransfer(model=spec.name, interconnect=link.name, prompt_tokens=prompt_tokens,
                      kv_precision=kv_precision, nbytes=nbytes,
                      seconds=link.latency + nbytes / link.bandwidth)


__all__ += ["KVTransfer", "kv_transfer"]
