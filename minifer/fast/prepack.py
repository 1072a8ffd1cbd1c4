"""Linear layers whose weights are prepacked once for oneDNN: faster CPU decode, same math.

`F.linear` hands torch's CPU matmul the weight in its stored layout, ``(out, in)`` row-major,
and the kernel re-blocks it for its vector registers on every call: at decode, a large part of
the step. Prepacking is what `torch.compile`'s CPU "freezing" does to a graph's weights;
`prepack` does it in eager mode, layer by layer, with oneDNN's own ops (``torch.ops.mkldnn``).

Reference: `F.linear`, equal to float rounding. The pack (``batch_size=0``: the weight itself) sits
beside the ``weight`` parameter (`state_dict`, `model_bytes`, tied embeddings keep working; rebuilt
after `.to()`, a loaded state dict or an in-place change). CPU only, float32 and bfloat16; with
gradients, and inside `torch.compile`, a layer computes with `F.linear`. A bf16 row, and a few
fp32 rows on the weight itself, run minifer's own kernels where they beat oneDNN (`_own_kernel`).

`prepare_bf16` (`hooks.prepare_bf16`) packs a new bf16 model by default (`minifer.fast`: why)."""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from .avx2 import AVX2
from .bf16_gemv import GEMV as BF16_GEMV

__all__ = ["PackedLinear", "prepack", "prepack_problem", "prepare_bf16"]

DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def prepack_problem(dtype: torch.dtype = torch.float32) -> str | None:
    """Why this torch cannot run prepacked linears in `dtype` here (None: it can). oneDNN packs
    bf16 only on CPUs with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT: not on an AVX2-only CPU, nor
    where ``ONEDNN_MAX_CPU_ISA`` caps it there."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (torch.backends.mkldnn.is_available() is False)"
    if dtype not in DTYPES:
        return f"prepacked linears run in float32 or bfloat16, not {dtype}"
    try:
        w, x = (torch.randn(n, 16, device="cpu").to(dtype) for n in (8, 2))  # not on meta
        y = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, 2),
                                               None, "none", [], "")
        if not torch.allclose(y.float(), (x @ w.T).float(), atol=1e-4 if dtype == torch.float32
                              else 5e-2):
            return f"oneDNN's packed linear gave a wrong result in {dtype} on this machine"
    except (RuntimeError, AttributeError, NotImplementedError) as exc:
        return (f"oneDNN's packed linear ops are missing or failed in {dtype} "
                f"({type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]})")
    return None


def _stamp(w: torch.Tensor) -> tuple[int, int]:
    """Which weight a pack was made from: its memory and in-place version (0 for an inference
    tensor, which can change in place only inside ``torch.inference_mode``)."""
    return w.data_ptr(), (0 if w.is_inference() else w._version)


def _layer_problem(w: torch.Tensor) -> str | None:
    """Why a linear layer with weight `w` cannot be packed (None: it can)."""
    if w.device.type != "cpu" or w.dtype not in DTYPES:
        return (f"prepacked linears run on the CPU in float32 or bfloat16; the layer is "
                f"{w.dtype} on {w.device}")
    return prepack_problem(w.dtype)


class PackedLinear(nn.Linear):
    """An `nn.Linear` that multiplies by its weight prepacked for oneDNN (see the module doc);
    ``batch_size`` is the number of rows the pack is tuned for (any number of rows works)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 batch_size: int = 1, device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.batch_size = batch_size
        self._packed: torch.Tensor | None = None  # not a buffer: rebuilt from `weight`
        self._rows: torch.Tensor | None = None  # bf16 weight row-major, for one-row calls
        self._stamp: tuple[int, int] | None = None  # `_stamp` of the weight packed

    @classmethod
    def from_linear(cls, linear: nn.Linear, batch_size: int = 1, *,
                    pack: bool = True) -> PackedLinear:
        """A packed layer sharing `linear`'s parameters (a tied weight stays tied); packed now,
        or with ``pack=False`` at its first call (a layer whose weights are still to come)."""
        if pack and batch_size and (problem := _layer_problem(linear.weight)) is not None:
            raise ValueError(problem)
        self = cls(linear.in_features, linear.out_features, linear.bias is not None,
                   batch_size=batch_size, device="meta")
        self.weight, self.bias = linear.weight, linear.bias
        if pack:
            self.pack()
        return self

    def pack(self) -> None:
        """The weight in oneDNN's layout for `batch_size` rows; ``batch_size=0``: the row-major
        weight itself, no second copy (`fast.layout`: oneDNN's own layout for one fp32 row)."""
        with torch.no_grad():
            w = self.weight.detach().contiguous()
            self._packed = w if self.batch_size == 0 else \
                torch.ops.mkldnn._reorder_linear_weight(w, self.batch_size)
        self._rows, self._stamp = None, _stamp(self.weight)

    def _apply(self, fn, *args, **kwargs):  # .to(), .float(), ...: repack on next use
        self._packed = self._rows = None
        return super()._apply(fn, *args, **kwargs)

    def _load_from_state_dict(self, *args, **kwargs):
        self._packed = self._rows = None
        return super()._load_from_state_dict(*args, **kwargs)

    def __getstate__(self):  # deepcopy/pickle: the pack is rebuilt, never copied
        return {**self.__dict__, "_packed": None, "_rows": None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (w.device.type != "cpu" or w.dtype not in DTYPES or x.dtype != w.dtype
                or (torch.is_grad_enabled() and w.requires_grad)
                or torch.compiler.is_compiling()):  # inductor's freezing packs weights itself
            return F.linear(x, w, self.bias)
        b = None if self.bias is None else self.bias.detach()
        if (y := self._own_kernel(x, b)) is not None:
            return y
        if prepack_problem(w.dtype) is not None:
            return F.linear(x, w, self.bias)
        if self._packed is None or _stamp(w) != self._stamp:  # new, moved or changed in place
            self.pack()
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, b, "none", [], "")

    def _own_kernel(self, x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor | None:
        """minifer's kernels where they beat oneDNN: one bf16 row (`bf16_gemv`); on AVX2, bf16
        rows where oneDNN packs no bf16 and a few fp32 rows on `layout`'s weights. None: neither."""
        rows = x.reshape(-1, self.in_features)  # [M, K]
        if self.weight.dtype == torch.float32:  # `fast.layout`'s layers: batch_size 0
            if self.batch_size or rows.shape[0] > AVX2.f32_rows or not AVX2.available():
                return None
            y = AVX2.f32(rows, self.weight.detach(), b)
        elif rows.shape[0] == 1 and BF16_GEMV.available():
            if self._rows is None:  # the kernel reads the weight row by row (row-major: itself)
                self._rows = self.weight.detach().contiguous()
            y = BF16_GEMV(rows, self._rows, b)
        elif prepack_problem(torch.bfloat16) is not None and AVX2.available():
            y = AVX2.bf16(rows, self.weight.detach(), b)
        else:
            return None
        return y.reshape(*x.shape[:-1], self.out_features)


def _pack_linears(model: nn.Module, batch_size: int) -> None:
    """Swap every `nn.Linear` of `model` for a `PackedLinear` on its parameters, in place; bf16
    weights are stored row-major first (the one-row kernel then reads the weight itself)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear) and m.weight.dtype == torch.bfloat16:
                m.weight.data = m.weight.data.contiguous()  # a tied embedding's lookups too
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):  # a PackedLinear already (`fast.layout`): repacked
                setattr(parent, name, PackedLinear.from_linear(child, batch_size))


def prepack(model: nn.Module, *, batch_size: int = 1) -> nn.Module:
    """A copy of `model` whose `nn.Linear` layers (the output layer included) are `PackedLinear`.

    The model must be on the CPU in float32 or bfloat16; int8/int4 models (`quantize`) have
    their own kernels and no `nn.Linear` left to pack, and ``quantize(model, "bf16")`` is
    packed already where oneDNN packs bf16 (`prepare_bf16`)."""
    problem = prepack_problem()  # oneDNN at all; each layer's dtype is checked below
    if problem is not None:
        raise RuntimeError(f"prepack: {problem}")
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError("prepack: the model has no nn.Linear layers (quantized to int8/int4, "
                         "whose layers have their own kernels)")
    for m in linears:  # every layer checked before anything is copied
        if (problem := _layer_problem(m.weight)) is not None:
            raise ValueError(f"prepack: {problem}")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"prepack: batch_size must be an integer >= 1, got {batch_size!r}")
    new = copy.deepcopy(model)
    _pack_linears(new, batch_size)
    return new


def prepare_bf16(model: nn.Module) -> None:
    """`minifer.hooks.prepare_bf16`'s speed-up: a new bf16 model's linears (plain, or
    `fast.layout`'s with ``batch_size=0``) prepacked in place where oneDNN packs bf16, else on
    their own weight for `fast.avx2`; as they are elsewhere, on a CPU with neither, or not bf16."""
    linears = [m for m in model.modules()
               if type(m) in (nn.Linear, PackedLinear) and getattr(m, "batch_size", 0) == 0]
    onednn = prepack_problem(torch.bfloat16) is None  # else bf16 on AVX2: `fast.avx2`, no pack
    if linears and (onednn or AVX2.available()) and all(
            m.weight.device.type == "cpu" and m.weight.dtype == torch.bfloat16 for m in linears):
        _pack_linears(model, 1 if onednn else 0)
