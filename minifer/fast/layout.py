"""Column-major linear weights: the same model, a layout torch's CPU GEMM is faster at.

Reference: torch's default layout, which `minifer.hooks.lay_out_weights` leaves in place.
`F.linear` multiplies by the weight's transpose; stored column-major (still ``(out, in)``) that
transpose is a plain row-major matrix, the case torch's CPU GEMM is fastest at. Only the order
of the sums changes (fp32 logits agree to rounding, greedy tokens are identical); a tied
embedding's lookup then reads a strided column. Parameters keep their layout through
`load_state_dict`, `.to()` and `deepcopy`; checkpoints are saved contiguous.
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["column_major_linears"]


def column_major_linears(module: nn.Module) -> nn.Module:
    """Store every linear weight of `module` column-major, in place, with no second copy."""
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.Linear) and m.weight.dim() == 2:
                m.weight.data = m.weight.data.t().contiguous().t()
    return module
