"""Fewer bits per weight: bf16/fp16 copies, int8/int4 linear layers.

A decode step reads every weight once per token, so its time is mostly the time to move the
weights; storing them in fewer bits moves fewer bytes.

* ``"fp32"``, ``"bf16"``, ``"fp16"``: the whole model cast to that float type.
* ``"int8"``: symmetric, one scale per output row: ``w[n, k] ≈ q[n, k] * scale[n]``,
  ``q`` in [-127, 127]. Weight-only, or with the activations quantized too (W8A8).
* ``"int4"``: weight-only, asymmetric, one scale and one zero per group of ``group_size``
  inputs of a row: ``w ≈ (q - 8) * scale + zero``, ``q`` in [0, 15], packed two per byte
  (the convention of torch's int4 kernels and gpt-fast).

Only the linear layers are quantized: they hold almost all the bytes a step reads (a step
reads B rows of the embedding). A head tied to the token embedding (GPT-2) is quantized as a
*copy*: the lookup keeps the float matrix, the output projection (every row, every step) reads
the integer copy.

Each quantized layer runs one of three paths, tested against each other:

* ``"fused"``: torch's kernels that read int8/int4 weights directly
  (``aten._weight_int8pack_mm``, ``aten._weight_int4pack_mm[_for_cpu]``); their fast versions
  take bf16 activations, so the layer's input is rounded to bf16 and its output back.
* ``"reference"``: dequantize the weight to the activation dtype, then an ordinary matmul:
  readable, and slower (it rebuilds a float weight at every call).
* ``"integer"`` (int8 only, CPU, W8A8): each activation row quantized to int8 with its own
  scale, products summed exactly in int32 (`w8a8_reference`): int8 dot-product instructions
  (VNNI, AMX) do 4× more per instruction than widening weights to float, and a row's result
  depends on that row alone, so a request's tokens do not depend on its batch.

The fused kernels changed across torch versions and take only some shapes, so `fused_problem`
probes each layer shape at run time against the reference path; a shape that fails runs on the
reference path, with a warning: the same quantized model, slower."""

from __future__ import annotations

import copy
import functools
import math
import warnings
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import hooks
from .device import cpu_flags

__all__ = ["PRECISIONS", "FLOAT_DTYPES", "KERNEL_GROUP_SIZES", "QuantizedLinear", "quantize",
           "quantize_int8", "quantize_int4", "default_group_size", "pack_int4", "unpack_int4",
           "dequantize_int4", "fused_available", "fused_problem", "integer_problem", "Int8Choice",
           "int8_choice", "quantization_summary", "ModelBytes", "model_bytes"]

PRECISIONS = ("fp32", "bf16", "fp16", "int8", "int4")
FLOAT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
IMPLS = ("auto", "fused", "reference", "integer")


# ---- the quantizers (plain tensor functions) -----------------------------------------------
def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: returns ``q`` (int8, [N, K]) and ``scale`` (fp32, [N]).

    ``scale[n] = max|w[n]| / 127``, so the largest weight of each row maps to ±127 and every
    weight is off by at most ``scale[n] / 2``."""
    w = w.detach().float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)  # [N]
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


KERNEL_GROUP_SIZES = (32, 64, 128, 256)  # the only int4 groups torch's fused kernels take
DEFAULT_GROUP_SIZES = (128, 64, 32)  # the default: the largest of these that fits every layer


def _even_divisors(n: int, lo: int = 8, hi: int = 256) -> list[int]:
    return [g for g in range(lo, min(n, hi) + 1) if g % 2 == 0 and n % g == 0]


def _check_group_size(in_features: int, group_size: int) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2 \
            or group_size % 2:
        raise ValueError(f"group_size must be a positive even integer (32, 64 or 128 usually), "
                         f"got {group_size!r}")
    if in_features % group_size:
        sizes = ", ".join(map(str, _even_divisors(in_features))) or "none from 8 to 256"
        raise ValueError(f"group_size={group_size} does not divide in_features={in_features}; "
                         f"even sizes that do: {sizes} (the fused kernel takes 32, 64, 128 or "
                         f"256; any other size runs on the reference path)")


def default_group_size(in_features: list[int] | tuple[int, ...]) -> int:
    """The int4 group size used when none is given: the largest of 128, 64 and 32 that divides
    every layer's ``in_features``, so the fused kernel can take it. Raises a ValueError that
    lists the sizes that would work when none of the three divides all."""
    widths = sorted(set(in_features))
    for g in DEFAULT_GROUP_SIZES:
        if all(k % g == 0 for k in widths):
            return g
    common = math.gcd(*widths)
    sizes = ", ".join(map(str, _even_divisors(common, lo=2))) or "none (an odd width)"
    raise ValueError(
        f"no int4 group_size the fused kernel takes (32, 64 or 128) divides every layer's "
        f"in_features {widths}; pass group_size= one that divides them all: {sizes} "
        f"(those run on the dequantize-then-matmul reference path)")


def quantize_int4(w: torch.Tensor, group_size: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric grouped int4: ``q`` (uint8 values 0..15, [N, K]), ``scale`` and ``zero``
    (fp32, [N, K // group_size]) with ``w ≈ (q - 8) * scale + zero``.

    Each group's minimum maps to 0 and its maximum to 15, so a weight is off by at most
    ``scale / 2`` of its group. ``group_size=None``: `default_group_size` of ``K``."""
    N, K = w.shape
    group_size = default_group_size([K]) if group_size is None else group_size
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
    # CUDA (torch >= 2.5): uint8 packed two per byte, high nibble first, [N, K/2]; the kernel
    # tiles K by 16 × inner_k_tiles (2, 4 or 8), so take the largest tiling that divides K
    packed = (q[:, 0::2] << 4) | q[:, 1::2]
    K = q.shape[1]
    inner_k_tiles = next((t for t in (8, 4, 2) if K % (16 * t) == 0), 8)
    return _aten("_convert_weight_to_int4pack")(packed.to(torch.uint8), inner_k_tiles)


def _int4_mm(x: torch.Tensor, packed: torch.Tensor, group_size: int,
             scales_zeros: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cpu" and _aten("_weight_int4pack_mm_for_cpu") is not None:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_zeros)
    return torch.ops.aten._weight_int4pack_mm(x, packed, group_size, scales_zeros)


def _int8_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._weight_int8pack_mm(x, q, scale)


def _static_problem(bits: int, in_features: int, group_size: int | None) -> str | None:
    """What rules a layer out of the fused kernel before calling it (calling it could crash)."""
    if bits == 8 and in_features % 16:
        # past this, _weight_int8pack_mm reads out of bounds: garbage logits, then a segfault
        return (f"in_features={in_features} is not a multiple of 16 (the int8 kernel reads "
                f"16 inputs at a time)")
    if bits == 4 and group_size not in KERNEL_GROUP_SIZES:
        return f"group_size={group_size} is not one the int4 kernel takes (32, 64, 128 or 256)"
    return None


@functools.cache
def fused_problem(bits: int, out_features: int, in_features: int, group_size: int | None = None,
                  device: str = "cpu", compute_dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why the fused int``bits`` kernel cannot run a layer of this shape here (None: it can).

    First the rules known to crash the kernel (`_static_problem`), then a probe on this very
    shape: a random layer run through the kernel on 1, 3 and 17 rows and compared with the
    reference path; an exception or an error over 2% of the output's scale is a problem."""
    static = _static_problem(bits, in_features, group_size)
    if static is not None:
        return static
    dev = torch.device(device)
    try:
        gen = torch.Generator().manual_seed(0)
        lin = _linear_from(torch.randn(out_features, in_features, generator=gen) * 0.05).to(dev)
        ref = QuantizedLinear.from_linear(lin, bits, group_size=group_size, impl="reference")
        fused = QuantizedLinear.from_linear(lin, bits, group_size=group_size, impl="fused",
                                            compute_dtype=compute_dtype)
        for rows in (1, 3, 17):
            # inputs the compute dtype represents exactly, so only the kernel can differ
            x = torch.randn(rows, in_features, generator=gen).to(compute_dtype).float().to(dev)
            want, got = ref(x), fused(x).float()
            err = (got - want).abs().max().item()
            if not err <= 0.02 * want.abs().max().item() + 1e-3:  # also catches NaN
                return (f"the kernel's output differs from dequantize-then-matmul by {err:.3g} "
                        f"on {rows} row(s)")
    except Exception as e:  # noqa: BLE001 — a missing/renamed op, an unsupported shape/dtype/device
        first = (str(e).strip().splitlines() or [""])[0][:120]
        return f"the kernel raised {type(e).__name__}: {first}"
    return None


@functools.cache
def fused_available(bits: int, device: str = "cpu", compute_dtype: torch.dtype = torch.bfloat16
                    ) -> bool:
    """Does this torch have a working fused int``bits`` matmul on ``device``? Probes a typical
    layer (64 × 256) with `fused_problem`; `quantize` still probes each layer shape."""
    return fused_problem(bits, 64, 256, 64 if bits == 4 else None, str(device),
                         compute_dtype) is None


# ---- W8A8: int8 activations too, one scale per row ----------------------------------------------
def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``x`` [M, K] to int8 with its own scale: ``x ≈ q * s[:, None]``,
    ``s = max|row| / 127`` (1 for a row of zeros), rounded half to even."""
    x = x.float()
    s = x.abs().amax(-1) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    return torch.round(x * (1 / s)[:, None]).to(torch.int8), s


def w8a8_reference(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (w * scales[:, None])ᵀ + bias`` with ``x`` [M, K] quantized per row: int8 × int8
    products summed in int32 (exact), then the two scales. ``w`` int8 [N, K], ``scales`` [N]."""
    q, s = quantize_rows(x)
    # float64 holds every integer below 2^53, so its matmul sums the products exactly (and
    # runs faster than an int32 one)
    acc = q.double() @ w.double().t()  # (M, N)
    y = acc.float() * s[:, None] * scales.float()
    return y if bias is None else y + bias.float()


def integer_problem(out_features: int = 64, in_features: int = 256,
                    device: str = "cpu") -> str | None:
    """Why the W8A8 path (``impl="integer"``) cannot run a layer here (None: it can). It runs
    on the CPU; the shape does not matter."""
    if torch.device(device).type != "cpu":
        return f"the integer path runs on the CPU only (got device {device!r})"
    return None


def int8_dot_products() -> str | None:
    """The CPU's instructions that multiply int8 pairs and add them in int32 (x86 AVX-512 VNNI,
    AVX-VNNI, AMX; Arm's dot product), named as /proc/cpuinfo names them; else AVX2, whose
    ``vpmaddwd`` adds pairs of int16 products in int32 (int8 widened); None without."""
    found = sorted(cpu_flags() & {"avx512_vnni", "avx_vnni", "amx_int8", "asimddp"})
    return ", ".join(found) or ("avx2" if "avx2" in cpu_flags() else None)


# ---- int8 "auto": one kernel per layer shape, chosen by what the machine has ------------------
@dataclass(frozen=True)
class Int8Choice:
    """The kernel ``quantize(model, "int8")`` picked for one layer shape, and why."""

    shape: tuple[int, int]  # (out_features, in_features)
    impl: str  # "integer", "fused" or "reference"
    reason: str

    def __str__(self) -> str:
        return f"{self.shape[0]} × {self.shape[1]}: {IMPL_NAMES[self.impl]}, {self.reason}"


IMPL_NAMES = {"integer": "integer (W8A8)", "fused": "fused (weight-only)",
              "reference": "reference (dequantize-then-matmul)"}


def int8_choice(out_features: int, in_features: int, device: str = "cpu",
                compute_dtype: torch.dtype = torch.bfloat16) -> Int8Choice:
    """The int8 kernel ``quantize(model, "int8")`` gives a layer of this shape: W8A8 where the
    CPU has int8 dot-product instructions (`int8_dot_products`), else the fused weight-only
    kernel, else the reference path. The choice depends on the machine, never on a timing or
    on the batch."""
    shape = (out_features, in_features)
    dots = int8_dot_products() if integer_problem(*shape, device) is None else None
    if dots is not None:
        return Int8Choice(shape, "integer", f"this CPU adds int8 products in int32 ({dots})")
    fused = fused_problem(8, out_features, in_features, None, device, compute_dtype)
    if fused is None:
        return Int8Choice(shape, "fused", "no int8 dot-product instructions here")
    return Int8Choice(shape, "reference", f"no kernel takes it (fused: {fused}; no int8 "
                                          f"dot-product instructions)")


def quantization_summary(model: nn.Module) -> str:
    """Which kernel each quantized layer of ``model`` runs: a count per kernel, then, after
    ``quantize(model, "int8")``, each layer shape's `int8_choice`."""
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    counts, bits = Counter(m.impl for m in layers), {m.bits for m in layers}
    if not counts:
        return "no quantized layers"
    head = ", ".join(f"{n} {IMPL_NAMES[impl]}" for impl, n in sorted(counts.items()))
    lines = [f"int{'/'.join(str(b) for b in sorted(bits))} layers: {head}"]
    choices: dict[str, Int8Choice] = getattr(model, "int8_choices", {})
    seen = Counter(c.shape for c in choices.values())
    first: dict[tuple[int, int], Int8Choice] = {}
    for c in choices.values():
        first.setdefault(c.shape, c)
    lines += [f"  {c} [{seen[shape]} layer(s)]" for shape, c in first.items()]
    return "\n".join(lines)


def _linear_from(w: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    return lin


# ---- the module ----------------------------------------------------------------------------
class QuantizedLinear(nn.Module):
    """A linear layer with int8 or int4 weights: ``y = x Wᵀ + b`` with W rebuilt from integers.

    Buffers (what is stored, and what `nbytes` counts): int8: ``qweight`` int8 [N, K], ``scales``
    [N]; int4: ``qweight`` uint8 [N, K/2] (two values per byte; the kernel's layout on the fused
    path), ``scales`` and ``zeros`` [N, K/group] (fused: one ``scales_zeros`` [K/group, N, 2]);
    ``bias`` in float, if any. The integer path also keeps each weight row's sum for the one-row
    kernel (not a buffer: rebuilt when missing, e.g. after loading a state dict)."""

    def __init__(self, in_features: int, out_features: int, bits: int, *,
                 group_size: int | None = None,
                 impl: str = "reference", compute_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size, self.impl = bits, group_size, impl
        self.compute_dtype = compute_dtype
        self._rowsum = None  # impl="integer": each weight row's sum, for the batch-1 kernel

    def _apply(self, fn, *args, **kwargs):  # .to(), .float(), ...: repack from the buffers
        self._rowsum = None
        return super()._apply(fn, *args, **kwargs)

    def _load_from_state_dict(self, *args, **kwargs):  # new buffers: repack them
        self._rowsum = None
        return super()._load_from_state_dict(*args, **kwargs)

    def __getstate__(self):  # deepcopy/pickle: the pack is rebuilt, never copied
        state = super().__getstate__() if hasattr(super(), "__getstate__") else dict(self.__dict__)
        return {**state, "_rowsum": None}

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int, *, group_size: int | None = None,
                    impl: str = "reference", compute_dtype: torch.dtype = torch.bfloat16
                    ) -> QuantizedLinear:
        """Quantize an `nn.Linear` (its weight is read, not changed).

        ``group_size`` (int4): None picks `default_group_size` of this layer. ``impl="fused"``
        raises a ValueError for a shape `_static_problem` rules out; `quantize` instead falls
        back per layer."""
        if bits not in (8, 4):
            raise ValueError(f"bits must be 8 or 4, got {bits!r}")
        if impl not in ("fused", "reference", "integer"):
            raise ValueError(f"impl must be 'fused', 'reference' or 'integer', got {impl!r}")
        if impl == "integer" and bits != 8:
            raise ValueError(f"impl='integer' (W8A8) takes bits=8, got bits={bits}")
        if impl == "integer" and linear.weight.device.type != "cpu":
            raise ValueError(f"impl='integer' runs on the CPU only; the layer is on "
                             f"{linear.weight.device}")
        N, K = linear.weight.shape
        if bits == 4:
            group_size = default_group_size([K]) if group_size is None else group_size
            _check_group_size(K, group_size)
        if impl == "fused":
            problem = _static_problem(bits, K, group_size)
            if problem is not None:
                raise ValueError(f"the fused int{bits} kernel cannot take this layer "
                                 f"({N} × {K}): {problem}; use impl='reference'")
        self = cls(K, N, bits, group_size=group_size if bits == 4 else K, impl=impl,
                   compute_dtype=compute_dtype)
        w = linear.weight.detach().contiguous()  # the kernels read (out, in) rows
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
        if self.impl == "integer":
            y = self._integer_forward(x2).to(x.dtype)
        elif self.impl == "fused":
            xc = x2.to(self.compute_dtype)
            y = (_int8_mm(xc, self.qweight, self.scales) if self.bits == 8
                 else _int4_mm(xc, self.qweight, self.group_size, self.scales_zeros))
            y = y.to(x.dtype) if self.bias is None else y.to(x.dtype) + self.bias.to(x.dtype)
        else:
            y = F.linear(x2, self.dequantize(x.dtype),
                         None if self.bias is None else self.bias.to(x.dtype))
        return y.reshape(*shape[:-1], self.out_features)

    def _integer_forward(self, x2: torch.Tensor) -> torch.Tensor:
        """W8A8 of ``x2`` [M, K]: `w8a8_reference`, or the same numbers from a faster kernel
        (the speed-up seam: minifer's VNNI kernels, else ``torch._int_mm``)."""
        bias = None if self.bias is None else self.bias.float()
        if self._rowsum is None:  # set on the first (eager) call, before a compiled step reads it
            self._rowsum = self.qweight.sum(1, dtype=torch.int32)
        fast = hooks.int8_matmul(x2, self.qweight, self.scales, self._rowsum, bias)
        return w8a8_reference(x2, self.qweight, self.scales, bias) if fast is None else fast

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [N, K] this layer stands for."""
        if self.impl in ("reference", "integer"):
            if self.bits == 8:
                return self.qweight.to(dtype) * self.scales.to(dtype)[:, None]
            return dequantize_int4(unpack_int4(self.qweight), self.scales, self.zeros, dtype)
        # fused layouts are the kernel's own business: read the weight out through the kernel
        eye = torch.eye(self.in_features, dtype=self.compute_dtype, device=self.qweight.device)
        w_t = (_int8_mm(eye, self.qweight, self.scales) if self.bits == 8
               else _int4_mm(eye, self.qweight, self.group_size, self.scales_zeros))
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
def quantize(model: nn.Module, precision: str, *, group_size: int | None = None,
             impl: str = "auto", compute_dtype: torch.dtype = torch.bfloat16,
             include_lm_head: bool = True) -> nn.Module:
    """A new model in ``precision`` (``"fp32" | "bf16" | "fp16" | "int8" | "int4"``); the
    input model is deep-copied, not changed.

    * float precisions cast the whole copy (bf16: then `hooks.prepare_bf16`'s prepacked layers);
    * ``"int8"``/``"int4"`` replace every `nn.Linear` by a `QuantizedLinear`; ``group_size``
      (int4; None: `default_group_size`) must divide every layer's ``in_features``.

    ``impl``: ``"fused"`` (an error if torch's kernels do not work here at all),
    ``"reference"``, ``"integer"`` (int8 W8A8, CPU only; larger error: activations rounded to
    8 bits) or ``"auto"``: for int8, `int8_choice`'s kernel per layer shape (kept in the new
    model's ``int8_choices``, printed by `quantization_summary`); for int4, fused where it
    works. With ``"fused"`` and ``"auto"``, a layer shape `fused_problem` rejects runs on the
    reference path, with a warning that names it. ``compute_dtype`` is the fused kernels'
    activation dtype. ``include_lm_head=False`` keeps the output head in float (and a tied
    head tied); with True a tied head is quantized as a copy (module doc), unless only the
    reference path could run it under ``"auto"``: then it stays float and tied, since
    rebuilding it at every step costs more than reading it.

    Exactness: the reference path computes exactly ``x @ dequantize()ᵀ``; the fused path's
    logits differ in the low digits (module doc), and are not bit-identical across CPUs."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {list(PRECISIONS)}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {list(IMPLS)}, got {impl!r}")
    new = copy.deepcopy(model)
    if precision in FLOAT_DTYPES:
        new = new.to(FLOAT_DTYPES[precision]).eval()
        if precision == "bf16":
            hooks.prepare_bf16(new)  # the speed-ups' bf16 layers where this CPU has them
        return new
    bits = 8 if precision == "int8" else 4
    targets = _linear_targets(new, include_lm_head)
    group_size = _int4_group(targets, group_size) if bits == 4 else None
    device = next(model.parameters()).device
    model_impl = _model_impl(bits, impl, device, compute_dtype)
    _swap_linears(new, targets, bits, model_impl, impl == "reference", group_size, compute_dtype)
    return new.eval()


def _swap_linears(new: nn.Module, targets: list[tuple[str, nn.Linear]], bits: int, impl: str,
                  reference_asked: bool, group_size: int | None, compute_dtype: torch.dtype) -> None:
    """Replace each target `nn.Linear` of `new` by its `QuantizedLinear` on the path `impl`
    gives it; warn once about every layer that fell back to the reference path."""
    unfused: dict[str, list[str]] = {}  # reason -> layers
    choices: dict[str, Int8Choice] = {}  # impl="auto", int8: layer -> the kernel picked
    tied = {m.weight.data_ptr() for m in new.modules() if isinstance(m, nn.Embedding)}
    for name, lin in targets:
        is_tied = lin.weight.data_ptr() in tied
        layer_impl, problem = _layer_impl(lin, bits, impl, group_size, compute_dtype)
        if impl == "auto":
            choices[name] = Int8Choice(tuple(lin.weight.shape), layer_impl, problem)
            problem = problem if layer_impl == "reference" else None
        if problem is not None and not is_tied:
            unfused.setdefault(problem, []).append(f"{name} {tuple(lin.weight.shape)}")
        if is_tied and layer_impl == "reference" and not reference_asked:
            continue  # the float, tied head (`quantize` says why)
        parent_name, _, attr = name.rpartition(".")
        setattr(new.get_submodule(parent_name) if parent_name else new, attr,
                QuantizedLinear.from_linear(lin, bits, group_size=group_size, impl=layer_impl,
                                            compute_dtype=compute_dtype))
    if choices:
        new.int8_choices = choices
    if unfused:
        _warn_unfused(unfused, impl, bits)


def _int4_group(targets: list[tuple[str, nn.Linear]], group_size: int | None) -> int | None:
    """The int4 group size for `targets` (None: `default_group_size`), checked against every
    layer before any is changed: the error names the first bad one."""
    if not targets:
        return group_size
    if group_size is None:
        group_size = default_group_size([lin.in_features for _, lin in targets])
    for name, lin in targets:
        try:
            _check_group_size(lin.in_features, group_size)
        except ValueError as e:
            raise ValueError(f"int4 layer {name}: {e}") from None
    return group_size


def _model_impl(bits: int, impl: str, device: torch.device, compute_dtype: torch.dtype) -> str:
    """The path asked of every layer: ``"auto"`` stays for int8 (`int8_choice` per shape),
    else becomes ``"fused"`` where torch's kernel works here, ``"reference"`` (warned) where
    not; ``"fused"`` and ``"integer"`` that cannot run here at all are errors."""
    if impl == "integer":
        if bits != 8:
            raise ValueError(f"impl='integer' (W8A8 on integer units) is for int8, not int{bits}")
        problem = integer_problem(64, 256, str(device))
        if problem is not None:
            raise RuntimeError(f"the W8A8 integer path cannot run here: {problem}; use "
                               f"impl='fused' (weight-only) or 'auto'")
        return impl
    if impl == "reference" or (impl == "auto" and bits == 8):
        return impl
    if fused_available(bits, str(device), compute_dtype):
        return "fused"
    if impl == "fused":
        raise RuntimeError(
            f"no working fused int{bits} kernel in torch {torch.__version__} on {device} "
            f"with {compute_dtype} activations; use impl='reference' (dequantize-then-matmul)")
    warnings.warn(f"fused int{bits} kernel unavailable in torch {torch.__version__} on "
                  f"{device}; using the dequantize-then-matmul reference path "
                  f"(same quantized weights, slower)", RuntimeWarning, stacklevel=3)
    return "reference"


def _layer_impl(lin: nn.Linear, bits: int, impl: str, group_size: int | None,
                compute_dtype: torch.dtype) -> tuple[str, str | None]:
    """The path one layer runs for the model's `impl`, and why another was not taken (with
    ``"auto"``: why this one was)."""
    (N, K), device = lin.weight.shape, str(lin.weight.device)
    if impl == "auto":
        choice = int8_choice(N, K, device, compute_dtype)
        return choice.impl, choice.reason
    if impl == "fused":
        problem = fused_problem(bits, N, K, group_size, device, compute_dtype)
    elif impl == "integer":
        problem = integer_problem(N, K, device)
    else:
        return impl, None
    return (impl, None) if problem is None else ("reference", problem)


def _warn_unfused(unfused: dict[str, list[str]], impl: str, bits: int) -> None:
    """One warning naming every layer that fell back to the reference path, and why."""
    detail = "; ".join(f"{', '.join(names)}: {reason}" for reason, names in unfused.items())
    kernel = {"integer": "W8A8 integer path", "auto": "int8 kernels"}.get(
        impl, f"fused int{bits} kernel")
    verb = "reject" if impl == "auto" else "rejects"
    warnings.warn(f"the {kernel} {verb} the shape of {detail}; those layers "
                  f"use the dequantize-then-matmul reference path", RuntimeWarning, stacklevel=4)


def _linear_targets(model: nn.Module, include_lm_head: bool) -> list[tuple[str, nn.Linear]]:
    """The `nn.Linear` layers to quantize: all of them, or all but the output head (a tied
    head included: quantizing it replaces only the linear module, the embedding keeps the
    float matrix)."""
    embedding_ptrs = {m.weight.data_ptr() for m in model.modules() if isinstance(m, nn.Embedding)}
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear) and (
        include_lm_head or not (name.split(".")[-1] == "lm_head" or m.weight.data_ptr() in embedding_ptrs))]


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
        if t is None or t.data_ptr() in seen:
            return
        seen.add(t.data_ptr())
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
