"""Linear weights in the layout this CPU multiplies fastest: column-major, or read by oneDNN.

Reference: torch's default layout, which `minifer.hooks.lay_out_weights` leaves in place.
`F.linear` multiplies by the weight's transpose; stored column-major (still ``(out, in)``) that
transpose is a plain row-major matrix, the case torch's CPU GEMM is fastest at. Only the order
of the sums changes (fp32 logits agree to rounding, greedy tokens are identical); a tied
embedding's lookup then reads a strided column. Parameters keep their layout through
`load_state_dict`, `.to()` and `deepcopy`; checkpoints are saved contiguous.

Where torch's fp32 GEMM is MKL's on a CPU not Intel's (`mkl_generic`), MKL runs generic code, not
its AVX-512 kernels (``MKL_VERBOSE=1``: "Intel(R) Architecture processors"): there fp32 layers
become `PackedLinear`s on the row-major weight itself (``batch_size=0``: no second copy), which
oneDNN multiplies, or for a few rows minifer's own kernel (`fast.avx2`'s ``f32``)."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import torch
import torch.nn as nn

from .prepack import PackedLinear, prepack_problem

__all__ = ["column_major_linears", "lay_out_weights", "mkl_generic"]


@functools.cache
def mkl_generic() -> bool:
    """Is the fp32 GEMM MKL's on an x86 CPU not Intel's, and can oneDNN take a row-major weight?"""
    info = Path("/proc/cpuinfo")
    vendor = re.search(r"^vendor_id\s*:\s*(\S+)", info.read_text() if info.exists() else "", re.M)
    if not (vendor and vendor[1] != "GenuineIntel" and torch.backends.mkl.is_available()):
        return False
    try:  # probed on the CPU even while a model is built on the meta device
        w, x = (torch.randn(n, 16, device="cpu") for n in (8, 2))
        y = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        return torch.allclose(y, x @ w.T, atol=1e-4)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def column_major_linears(module: nn.Module) -> nn.Module:
    """Store every linear weight of `module` column-major, in place, with no second copy."""
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.Linear) and m.weight.dim() == 2:
                m.weight.data = m.weight.data.t().contiguous().t()
    return module


def lay_out_weights(module: nn.Module) -> nn.Module:
    """`minifer.hooks.lay_out_weights`'s speed-up: every fp32 `nn.Linear` of `module` a
    `PackedLinear` on its own weight where `mkl_generic` (and oneDNN runs here), else column-major
    weights."""
    if not mkl_generic() or prepack_problem(torch.float32) is not None:
        return column_major_linears(module)
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.float32:
                setattr(parent, name, PackedLinear.from_linear(child, 0, pack=False))
    return module
