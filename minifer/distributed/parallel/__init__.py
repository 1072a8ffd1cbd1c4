"""Tensor parallelism over `torch.distributed`: one model split across N processes or GPUs.

- :mod:`.layers`: which slice of every weight matrix a rank keeps (Megatron-style column- and
  row-parallel linears, heads split across ranks) and the sharded attention/MLP modules.
- :mod:`.runtime`: one rank's program: join the group, check every rank loaded the same model,
  shard, generate in lockstep (rank 0 samples and broadcasts), and account for bytes and time.
- :mod:`.launch`: :func:`run_local` starts N local CPU processes (gloo on 127.0.0.1) from Python
  or a notebook and always ends them.
- ``python -m minifer.distributed.parallel``: the same program for `torchrun` (gloo on CPU, NCCL on GPUs).

The analytic side (how the split pays off on real hardware) is in
:func:`minifer_course.roofline.tp_decode`, pure arithmetic.
"""

from .launch import TPResult, WorkerError, Workers, free_port, launch, run_local, running
from .layers import (
    TPMLP,
    ShardPlan,
    TPAttention,
    rank_weight_bytes,
    shard_gpt,
    shard_plan,
    weight_bytes,
)
from .runtime import Comm, RankReport, check_same_config, config_digest, generate_tp, rank_cache

__all__ = [
    "Comm", "RankReport", "ShardPlan", "TPAttention", "TPMLP", "TPResult", "WorkerError", "Workers",
    "check_same_config", "config_digest", "free_port", "generate_tp", "launch", "rank_cache",
    "rank_weight_bytes", "run_local", "running", "shard_gpt", "shard_plan", "weight_bytes",
]
