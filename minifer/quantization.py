"""Fewer bits per weight: bf16/fp16 copies and weight-only int8/int4 linear layers.

A decode step reads every weight once to produce one token per sequence, so its time is mostly
the time to move the weights (claim PD-9). Storing them in fewer bits moves fewer bytes.

* ``"fp32"``, ``"bf16"``, ``"fp16"``: the whole model cast to that float type (QUANT-5).
* ``"int8"``: weight-only, symmetric, one scale per output channel (row):
  ``w[n, k] ≈ q[n, k] * scale[n]`` with ``q`` in [-127, 127] (QUANT-1).
* ``"int4"``: weight-only, asymmetric, one scale and one zero per group of ``group_size`` inputs
  of a row: ``w ≈ (q - 8) * scale + zero`` with ``q`` in [0, 15], packed two per byte
  (the convention of torch's int4 kernels and gpt-fast).

Only the linear layers (attention, MLP and the output head) are quantized; they hold almost all
the bytes a decode step reads. Embeddings are a table lookup (a step reads only B rows of them)
and LayerNorms are tiny, so both stay in float. A tied output head (GPT-2) is left in float too,
so that it keeps sharing its matrix with the embedding.

Each quantized layer runs one of two paths, tested against each other:

* ``"fused"``: torch's kernels that read the int8/int4 weights directly
  (``aten._weight_int8pack_mm``, ``aten._weight_int4pack_mm[_for_cpu]``). Their fast versions
  take bf16 activations, so this path rounds the layer's input to bf16 and its output back.
* ``"reference"``: dequantize the weight to the activation dtype, then an ordinary matmul —
  the same numbers, readable, and slower (it rebuilds a float weight at every call).

The fused kernels changed signatures across torch versions, so they are probed once at run time
(called on a small layer and compared with the reference path); where the probe fails, ``"auto"``
falls back to the reference path with a warning — it computes the same quantized model.
"""

from __future__ import annotations

import copy
import functools
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["PRECISIONS", "FLOAT_DTYPES", "QuantizedLinear", "quantize", "quantize_int8",
           "quantize_int4", "pack_int4", "unpack_int4", "dequantize_int4", "fused_available",
           "ModelBytes", "model_bytes"]

PRECISIONS = ("fp32", "bf16", "fp16", "int8", "int4")
FLOAT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
IMPLS = ("auto", "fused", "reference")


# ---- the quantizers (plain tensor functions) -----------------------------------------------
def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: returns ``q`` (int8, [N, K]) and ``scale`` (fp32, [N]).

    ``scale[n] = max|w[n]| / 127``, so the largest weight of each row maps to ±127 and every
    weight is off by at most ``scale[n] / 2``.
    """
    w = w.detach().float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)  # [N]
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def _check_group_size(in_features: int, group_size: int) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2 \
            or group_size % 2:
        raise ValueError(f"group_size must be a positive even integer (32, 64 or 128 usually), "
                         f"got {group_size!r}")
    if in_features % group_size:
        divisors = [g for g in (32, 64, 128, 256) if in_features % g == 0]
        raise ValueError(f"group_size={group_size} does not divide in_features={in_features}; "
                         f"sizes that do: {divisors or 'none of 32/64/128/256'}")


def quantize_int4(w: torch.Tensor, group_size: int = 128
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric grouped int4: ``q`` (uint8 values 0..15, [N, K]), ``scale`` and ``zero``
    (fp32, [N, K // group_size]) with ``w ≈ (q - 8) * scale + zero``.

    Each group's minimum maps to 0 and its maximum to 15, so a weight is off by at most
    ``scale / 2`` of its group.
    """
    N, K = w.shape
    _check_group_size(K, group_size)
    wg = w.detach().float().reshape(N, K // group_size, group_size)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)  # [N, G]
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    zero = lo + 8 * scale  # the value q = 8 stands for
    q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return q.reshape(N, K), scale, zero


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(q - 8) * scale + zero`` per group; ``q`` unpacked [N, K] → float [N, K]."""
    N, K = q.shape
    G = scale.shape[1]
    qg = q.reshape(N, G, K // G).to(dtype)
    return ((qg - 8) * scale[..., None].to(dtype) + zero[..., None].to(dtype)).reshape(N, K)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Two 4-bit values per byte: column ``2i`` in the low nibble, ``2i+1`` in the high one."""
    if q.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even number of columns, got {q.shape[-1]}")
    if q.dtype != torch.uint8 or int(q.max()) > 15:
        raise ValueError("pack_int4 expects uint8 values in [0, 15]")
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`: uint8 [N, K/2] → uint8 values 0..15 [N, K]."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)


# ---- fused kernels, probed at run time -----------------------------------------------------
def _aten(name: str):
    return getattr(torch.ops.aten, name, None)


def _int4_convert(q: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Repack int4 values [N, K] into the layout of the device's int4 matmul kernel."""
    if device.type == "cpu":
        op = _aten("_convert_weight_to_int4pack_for_cpu")
        if op is not None:  # torch >= 2.5: int32 values [N, K]
            return op(q.to(torch.int32), 1)
        return _aten("_convert_weight_to_int4pack")(q.to(torch.int32), 1)
    # CUDA (torch >= 2.5): uint8 packed two per byte, high nibble first, [N, K/2]
    packed = (q[:, 0::2] << 4) | q[:, 1::2]
    return _aten("_convert_weight_to_int4pack")(packed.to(torch.uint8), 8)


def _int4_mm(x: torch.Tensor, packed: torch.Tensor, group_size: int,
             scales_zeros: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cpu" and _aten("_weight_int4pack_mm_for_cpu") is not None:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_zeros)
    return torch.ops.aten._weight_int4pack_mm(x, packed, group_size, scales_zeros)


def _int8_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._weight_int8pack_mm(x, q, scale)


@functools.cache
def fused_available(bits: int, device: str = "cpu", compute_dtype: torch.dtype = torch.bfloat16
                    ) -> bool:
    """Does this torch have a working fused int``bits`` matmul on ``device``?

    Calls the kernel on a small random layer and compares it with dequantize-then-matmul;
    any exception or a wrong answer means "no".
    """
    dev = torch.device(device)
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(64, 256, generator=gen) * 0.05
        x = torch.randn(3, 256, generator=gen)
        lin = _linear_from(w).to(dev)
        layer = QuantizedLinear.from_linear(lin, bits, group_size=64, impl="reference")
        fused = QuantizedLinear.from_linear(lin, bits, group_size=64, impl="fused",
                                            compute_dtype=compute_dtype)
        x = x.to(dev)
        ref = layer(x).float()
        out = fused(x).float()
        return bool(torch.allclose(out, ref, atol=0.05, rtol=0.02))
    except Exception:  # noqa: BLE001 — a missing/renamed op or an unsupported dtype/device
        return False


def _linear_from(w: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    return lin


# ---- the module ----------------------------------------------------------------------------
class QuantizedLinear(nn.Module):
    """A linear layer with int8 or int4 weights: ``y = x Wᵀ + b`` with W rebuilt from integers.

    Buffers (what is stored, and what `nbytes` counts):

    * int8: ``qweight`` int8 [N, K], ``scales`` [N];
    * int4: ``qweight`` uint8 [N, K/2] (two values per byte; in the kernel's own layout on the
      fused path), and ``scales`` and ``zeros`` [N, K/group] (fused path: one
      ``scales_zeros`` tensor [K/group, N, 2], as the kernel wants them);
    * ``bias`` in float, when the layer has one.
    """

    def __init__(self, in_features: int, out_features: int, bits: int, *, group_size: int = 128,
                 impl: str = "reference", compute_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size, self.impl = bits, group_size, impl
        self.compute_dtype = compute_dtype

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int, *, group_size: int = 128,
                    impl: str = "reference", compute_dtype: torch.dtype = torch.bfloat16
                    ) -> QuantizedLinear:
        """Quantize an `nn.Linear` (its weight is read, not changed)."""
        if bits not in (8, 4):
            raise ValueError(f"bits must be 8 or 4, got {bits!r}")
        if impl not in ("fused", "reference"):
            raise ValueError(f"impl must be 'fused' or 'reference', got {impl!r}")
        N, K = linear.weight.shape
        if bits == 4:
            _check_group_size(K, group_size)
        self = cls(K, N, bits, group_size=group_size if bits == 4 else K, impl=impl,
                   compute_dtype=compute_dtype)
        w = linear.weight.detach()
        device = w.device
        if bits == 8:
            q, scale = quantize_int8(w)
            self.register_buffer("qweight", q)
            self.register_buffer("scales", scale.to(compute_dtype) if impl == "fused" else scale)
        else:
            q, scale, zero = quantize_int4(w, group_size)
            if impl == "fused":
                self.register_buffer("qweight", _int4_convert(q, device))
                sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [G, N, 2]
                self.register_buffer("scales_zeros", sz.to(compute_dtype))
            else:
                self.register_buffer("qweight", pack_int4(q))
                self.register_buffer("scales", scale)
                self.register_buffer("zeros", zero)
        if linear.bias is not None:
            self.register_buffer("bias", linear.bias.detach().clone())
        else:
            self.bias = None
        return self

    # -- compute --
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.impl == "fused":
            xc = x2.to(self.compute_dtype)
            if self.bits == 8:
                y = _int8_mm(xc, self.qweight, self.scales)
            else:
                y = _int4_mm(xc, self.qweight, self.group_size, self.scales_zeros)
            y = y.to(x.dtype)
            if self.bias is not None:
                y = y + self.bias.to(x.dtype)
        else:
            y = F.linear(x2, self.dequantize(x.dtype),
                         None if self.bias is None else self.bias.to(x.dtype))
        return y.reshape(*shape[:-1], self.out_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [N, K] this layer stands for."""
        if self.impl == "reference":
            if self.bits == 8:
                return self.qweight.to(dtype) * self.scales.to(dtype)[:, None]
            return dequantize_int4(unpack_int4(self.qweight), self.scales, self.zeros, dtype)
        # fused layouts are the kernel's own business: read the weight out through the kernel
        eye = torch.eye(self.in_features, dtype=self.compute_dtype, device=self.qweight.device)
        if self.bits == 8:
            w_t = _int8_mm(eye, self.qweight, self.scales)
        else:
            w_t = _int4_mm(eye, self.qweight, self.group_size, self.scales_zeros)
        return w_t.t().to(dtype)

    # -- bytes --
    @property
    def weight_nbytes(self) -> int:
        return _nbytes(self.qweight)

    @property
    def scale_nbytes(self) -> int:
        names = ("scales_zeros",) if hasattr(self, "scales_zeros") else ("scales", "zeros")
        return sum(_nbytes(getattr(self, n)) for n in names if hasattr(self, n))

    @property
    def bias_nbytes(self) -> int:
        return 0 if self.bias is None else _nbytes(self.bias)

    @property
    def nbytes(self) -> int:
        """All bytes this layer stores: integer weights + scales (and zeros) + bias."""
        return self.weight_nbytes + self.scale_nbytes + self.bias_nbytes

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.bits == 4 else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int{self.bits}{group}, impl={self.impl}, nbytes={self.nbytes:,}")


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


# ---- whole models --------------------------------------------------------------------------
def quantize(model: nn.Module, precision: str, *, group_size: int = 128, impl: str = "auto",
             compute_dtype: torch.dtype = torch.bfloat16, include_lm_head: bool = True
             ) -> nn.Module:
    """A new model in ``precision`` (``"fp32" | "bf16" | "fp16" | "int8" | "int4"``).

    The input model is not changed (it is deep-copied, then the copy's layers are swapped).

    * float precisions cast the whole copy (weights, norms, embeddings) to that dtype;
    * ``"int8"``/``"int4"`` replace every `nn.Linear` by a `QuantizedLinear` (weight-only; the
      activations stay in the model's dtype). ``group_size`` is the int4 group (32/64/128; it
      must divide every layer's ``in_features``). ``impl``: ``"fused"`` (torch's kernels; error
      if they do not work here), ``"reference"`` (dequantize-then-matmul), or ``"auto"`` (fused
      where the probe succeeds, else reference with a warning). ``compute_dtype`` is the
      activation dtype of the fused kernels. ``include_lm_head=False`` keeps the output head in
      float (a tied head is always kept, to keep the tie).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {list(PRECISIONS)}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {list(IMPLS)}, got {impl!r}")
    new = copy.deepcopy(model)
    if precision in FLOAT_DTYPES:
        return new.to(FLOAT_DTYPES[precision]).eval()
    bits = 8 if precision == "int8" else 4
    targets = _linear_targets(new, include_lm_head)
    if bits == 4:  # check every layer before changing any, so the error names the first bad one
        for name, lin in targets:
            try:
                _check_group_size(lin.in_features, group_size)
            except ValueError as e:
                raise ValueError(f"int4 layer {name}: {e}") from None
    if impl == "auto" or impl == "fused":
        device = next(model.parameters()).device
        ok = fused_available(bits, str(device), compute_dtype)
        if not ok and impl == "fused":
            raise RuntimeError(
                f"no working fused int{bits} kernel in torch {torch.__version__} on {device} "
                f"with {compute_dtype} activations; use impl='reference' (dequantize-then-matmul)")
        if not ok:
            warnings.warn(f"fused int{bits} kernel unavailable in torch {torch.__version__} on "
                          f"{device}; using the dequantize-then-matmul reference path "
                          f"(same quantized weights, slower)", RuntimeWarning, stacklevel=2)
        impl = "fused" if ok else "reference"
    unfused = []
    for name, lin in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = new.get_submodule(parent_name) if parent_name else new
        try:
            layer = QuantizedLinear.from_linear(lin, bits, group_size=group_size, impl=impl,
                                                compute_dtype=compute_dtype)
        except RuntimeError:  # the kernel rejects this shape (e.g. int4 on CPU needs N % 16 == 0)
            layer = QuantizedLinear.from_linear(lin, bits, group_size=group_size,
                                                impl="reference")
            unfused.append(f"{name} {tuple(lin.weight.shape)}")
        setattr(parent, attr, layer)
    if unfused:
        warnings.warn(f"the fused int{bits} kernel rejects the shape of {', '.join(unfused)}; "
                      f"those layers use the dequantize-then-matmul reference path",
                      RuntimeWarning, stacklevel=2)
    return new.eval()


def _linear_targets(model: nn.Module, include_lm_head: bool) -> list[tuple[str, nn.Linear]]:
    """The `nn.Linear` layers to quantize: all of them, less a head tied to an embedding."""
    embedding_ptrs = {m.weight.data_ptr() for m in model.modules() if isinstance(m, nn.Embedding)}
    out = []
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear):
            continue
        if m.weight.data_ptr() in embedding_ptrs:
            continue  # tied to the embedding: keep the one shared float matrix
        if name.split(".")[-1] == "lm_head" and not include_lm_head:
            continue
        out.append((name, m))
    return out


# ---- byte accounting -----------------------------------------------------------------------
@dataclass(frozen=True)
class ModelBytes:
    """Bytes a model stores, by kind. ``linear`` = linear weights + their scales/zeros."""

    embeddings: int
    linear_weights: int
    scales: int
    norms: int
    biases: int
    other: int = 0

    @property
    def linear(self) -> int:
        return self.linear_weights + self.scales

    @property
    def total(self) -> int:
        return (self.embeddings + self.linear_weights + self.scales + self.norms + self.biases
                + self.other)

    def as_dict(self) -> dict[str, int]:
        return {"embeddings": self.embeddings, "linear weights": self.linear_weights,
                "scales/zeros": self.scales, "norms": self.norms, "biases": self.biases,
                "other": self.other, "total": self.total}


def model_bytes(model: nn.Module) -> ModelBytes:
    """Count every stored tensor once (tied weights once), by the kind of layer holding it."""
    seen: set[int] = set()
    acc = dict(embeddings=0, linear_weights=0, scales=0, norms=0, biases=0, other=0)

    def add(kind: str, t: torch.Tensor | None) -> None:
        if t is None:
            return
        key = t.data_ptr()
        if key in seen:
            return
        seen.add(key)
        acc[kind] += _nbytes(t)

    modules = list(model.modules())
    for m in modules:  # embeddings first, so a tied head counts as the embedding it is
        if isinstance(m, nn.Embedding):
            add("embeddings", m.weight)
    for m in modules:
        if isinstance(m, nn.Linear):
            add("linear_weights", m.weight)
            add("biases", m.bias)
        elif isinstance(m, QuantizedLinear):
            add("linear_weights", m.qweight)
            for n in ("scales", "zeros", "scales_zeros"):
                add("scales", getattr(m, n, None))
            add("biases", m.bias)
        elif isinstance(m, nn.LayerNorm):
            add("norms", m.weight)
            add("norms", m.bias)
    for t in list(model.parameters()) + list(model.buffers()):
        add("other", t)
    return ModelBytes(**acc)
