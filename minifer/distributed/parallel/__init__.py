"""Tensor parallelism over `torch.distributed`: one model split across N processes or GPUs.

- :mod:`.layers`: which slice of every weight matrix a rank keeps (Megatron-style).
- :mod:`.runtime`: one rank's program: join, check, shard, generate in lockstep (rank 0 samples).
- :mod:`.launch`: :func:`run_local` starts N local CPU processes and always ends them;
  ``python -m minifer.distributed.parallel`` is the same program for `torchrun`."""

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
