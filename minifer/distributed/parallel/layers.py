"""Megatron-style tensor parallelism for `minifer.model.GPT`: which rank holds which slice.

Each block's two pairs of matrices are split the same way (Shoeybi et al. 2019, section 3):

- **column-parallel** first: the fused QKV projection and the MLP's up projection are cut by
  *output* rows; rank r computes its heads (or hidden units) from the full input, alone.
- **row-parallel** second: the output and down projections are cut by *input* columns; each
  rank's product is a partial sum, and one **all-reduce** completes it (the bias added after).

So a block costs two all-reduces of a ``(B, T, n_embd)`` activation, and every rank reads 1/N of
the weights and keeps 1/N of the KV cache (whole heads; a K/V head with its query heads). The
gate|up matrix is cut so a rank keeps both rows of its hidden units; embeddings, norms and the
output head are replicated."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from ...cache import AttentionInputs
from ...checks import check_int
from ...config import GPTConfig
from ...model import MLP, CausalSelfAttention, GatedMLP

AllReduce = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ShardPlan:
    """What rank `rank` of `world_size` holds: K/V heads ``kv_heads[0]:kv_heads[1]`` (and their
    query heads ``q_heads``), and MLP hidden units ``mlp[0]:mlp[1]``."""

    rank: int
    world_size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    mlp: tuple[int, int]

    @property
    def n_q(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def n_kv(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]


def _split(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rank's contiguous share of ``n`` items; the first ``n % world`` ranks get one more."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def shard_plan(config: GPTConfig, world_size: int, rank: int, *,
               allow_uneven: bool = False) -> ShardPlan:
    """The slice of `config`'s heads and MLP units that `rank` holds, or a ValueError; even
    unless ``allow_uneven=True`` (the first ranks get one more)."""
    check_int("world_size", world_size, 1)
    check_int("rank", rank, 0, world_size - 1, allowed=f"lie in [0, {world_size})")
    nh, nkv, hidden = config.n_head, config.kv_heads, config.mlp_hidden
    if world_size > nkv:
        which = f"n_head={nh}" if nkv == nh else f"n_kv_head={nkv}"
        raise ValueError(
            f"world_size={world_size} is larger than the model's {which}: tensor parallelism "
            f"splits whole heads, so use at most {nkv} ranks")
    for name, n in (("n_head", nh), ("n_kv_head", nkv), ("mlp_hidden", hidden)):
        if n % world_size and not allow_uneven:
            raise ValueError(f"{name}={n} is not divisible by world_size={world_size}; use a "
                             f"world size that divides it, or allow_uneven=True")
    group = nh // nkv  # query heads per K/V head
    kv = _split(nkv, world_size, rank)
    return ShardPlan(rank, world_size, q_heads=(kv[0] * group, kv[1] * group), kv_heads=kv,
                     mlp=_split(hidden, world_size, rank))


def _linear_from(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An `nn.Linear` holding (a copy of) exactly these tensors."""
    out_f, in_f = weight.shape
    lin = nn.Linear(in_f, out_f, bias=bias is not None, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(weight)
        if bias is not None:
            lin.bias.copy_(bias)
    return lin


class TPAttention(CausalSelfAttention):
    """This rank's heads of a `CausalSelfAttention`: QKV column-parallel, attention the model's
    own (`attend`), output row-parallel (a partial sum, all-reduced, the bias added once)."""

    def __init__(self, attn: CausalSelfAttention, plan: ShardPlan, all_reduce: AllReduce) -> None:
        nn.Module.__init__(self)
        hd, nh, nkv = attn.head_dim, attn.n_head, attn.n_kv_head
        self.layer_idx, self.head_dim, self.impl = attn.layer_idx, hd, attn.impl
        self.q_norm, self.k_norm = attn.q_norm, attn.k_norm  # per head
        self.n_head, self.n_kv_head = plan.n_q, plan.n_kv  # this rank's heads only
        self.all_reduce = all_reduce
        q0, q1 = plan.q_heads
        k0, k1 = plan.kv_heads
        # c_attn's output rows are [q heads | k heads | v heads], each head hd rows.
        rows = torch.cat([
            torch.arange(q0 * hd, q1 * hd),
            nh * hd + torch.arange(k0 * hd, k1 * hd),
            (nh + nkv) * hd + torch.arange(k0 * hd, k1 * hd),
        ]).to(attn.c_attn.weight.device)
        b = attn.c_attn.bias
        self.c_attn = _linear_from(attn.c_attn.weight[rows], None if b is None else b[rows])
        # c_proj's input columns are the concatenated heads: keep this rank's, bias kept whole
        # and added once after the all-reduce.
        self.c_proj = _linear_from(attn.c_proj.weight[:, q0 * hd:q1 * hd], None)
        self.proj_bias = None if attn.c_proj.bias is None else nn.Parameter(
            attn.c_proj.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        y = self.all_reduce(self.c_proj(self.attend(x, inputs)))
        return y if self.proj_bias is None else y + self.proj_bias


class TPMLP(MLP):
    """This rank's hidden units of an `MLP` or `GatedMLP`: up column-, down row-parallel."""

    def __init__(self, mlp: MLP, plan: ShardPlan, all_reduce: AllReduce) -> None:
        nn.Module.__init__(self)
        h0, h1 = plan.mlp
        self.gated = isinstance(mlp, GatedMLP)
        rows = torch.arange(h0, h1, device=mlp.c_fc.weight.device)
        if self.gated:  # c_fc's rows are [gate | up]: this rank's units of both
            rows = torch.cat([rows, mlp.c_proj.weight.shape[1] + rows])
        b = mlp.c_fc.bias
        self.c_fc = _linear_from(mlp.c_fc.weight[rows], None if b is None else b[rows])
        self.c_proj = _linear_from(mlp.c_proj.weight[:, h0:h1], None)
        self.proj_bias = None if mlp.c_proj.bias is None else nn.Parameter(
            mlp.c_proj.bias.detach().clone(), requires_grad=False)
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = GatedMLP.forward(self, x) if self.gated else super().forward(x)
        y = self.all_reduce(local)  # the model's MLP on this rank's units, summed over ranks
        return y if self.proj_bias is None else y + self.proj_bias


def shard_gpt(model: nn.Module, plan: ShardPlan, all_reduce: AllReduce) -> nn.Module:
    """Replace every block's attention and MLP of `model` by this rank's slices, in place, and
    return it. The rest is replicated, so ``model(ids, cache=...)`` runs as before with a cache
    of this rank's K/V heads (`rank_cache`), in the block's attention implementation."""
    for block in model.transformer.h:
        block.attn = TPAttention(block.attn, plan, all_reduce)
        block.mlp = TPMLP(block.mlp, plan, all_reduce)
    model.tp_plan = plan
    return model


def sharded_parameter_names(model: nn.Module) -> list[str]:
    """Names of the parameters split across ranks; everything else is replicated."""
    return [n for n, _ in model.named_parameters()
            if n.startswith("transformer.h.") and (".c_attn." in n or ".c_fc." in n
                                                  or n.endswith("c_proj.weight"))]


def rank_weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes this rank's parameters hold: ``{"sharded", "replicated", "total"}`` (tied tensors
    once). (`minifer_course.roofline.weight_bytes` estimates a model's weights from its size instead.)"""
    sharded = set(sharded_parameter_names(model))
    out = {"sharded": 0, "replicated": 0}
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        out["sharded" if name in sharded else "replicated"] += p.numel() * p.element_size()
    out["total"] = out["sharded"] + out["replicated"]
    return out


weight_bytes = rank_weight_bytes  # the older name, kept for code written against it
