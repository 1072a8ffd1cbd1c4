"""Lesson 09: int8 weights, one scale per output row, and a layer that keeps them.

`swap_linears` returns a copy of a model whose every linear layer (the output head included) is
an `Int8Linear`: the forward pass of `model.py` calls the layers as they are, so it runs them
unchanged. Bit for bit minifer's readable int8 path, ``mf.quantize(model, "int8", impl="reference")``.
"""

from __future__ import annotations

import copy

import torch


def int8_per_row(w):
    """Symmetric int8 with one scale per row (output channel)."""
    scale = w.abs().amax(dim=1) / 127  # each row's largest |weight| maps to ±127
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)  # 1 byte per weight
    return q, scale


class Int8Linear(torch.nn.Module):
    """y = x Wᵀ + b with W kept as int8 codes and one fp32 scale per output row."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        # .contiguous(): the codes row by row, [out, in] (minifer keeps fp32 weights column-major)
        q, scale = int8_per_row(linear.weight.detach().contiguous())
        self.register_buffer("q", q)  # [out, in] int8
        self.register_buffer("scale", scale)  # [out] fp32
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x):
        w = self.q.float() * self.scale[:, None]  # dequantize: [out, in] fp32
        return torch.nn.functional.linear(x, w, self.bias)


def swap_linears(module: torch.nn.Module) -> torch.nn.Module:
    """Replace every nn.Linear inside `module` by an Int8Linear, in place."""
    for name, child in module.named_children():
        if isinstance(child, torch.nn.Linear):
            setattr(module, name, Int8Linear(child))
        else:
            swap_linears(child)
    return module


def quantized(model) -> torch.nn.Module:
    """A copy of `model` with int8 linear layers; the original is untouched."""
    return swap_linears(copy.deepcopy(model)).eval()
