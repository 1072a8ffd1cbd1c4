"""One rank's side of tensor-parallel generation: join the group, shard, generate, account.

Every rank runs the same program (SPMD) and holds the same logits after the last all-reduce;
**rank 0 samples** the next token and **broadcasts** it, which keeps the ranks in lockstep even
if their logits differed in the last bit, for one tiny message per step."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from ...cache import StaticKVCache
from ...device import as_device, sync
from ...generation import Sampler, run_batch
from ...sampling import SamplingParams
from ...sequence import Prepared, Sequence
from .layers import ShardPlan, rank_weight_bytes, shard_gpt, shard_plan

PARENT_ENV = "MINIFER_TP_PARENT_PID"
"""Set by `run_local`: a worker whose launching process dies exits instead of lingering."""


class Comm:
    """The process group's all-reduce and broadcast, timed and counted: each call syncs the
    device (GPU work is asynchronous), and the time includes waiting for the slowest rank."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.group, self.device = group, device
        self.world_size = dist.get_world_size(group)
        self.reset()

    def reset(self) -> None:
        self.calls, self.bytes, self.seconds = 0, 0, 0.0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return self._timed(t, lambda: dist.all_reduce(t, group=self.group))

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        return self._timed(t, lambda: dist.broadcast(t, src=src, group=self.group))

    def _timed(self, t: torch.Tensor, collective) -> torch.Tensor:
        """`collective()` on `t` between two device syncs, its time and bytes counted."""
        if self.world_size == 1:
            return t
        sync(self.device)
        t0 = time.perf_counter()
        collective()
        sync(self.device)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        self.bytes += t.numel() * t.element_size()
        return t


def config_digest(config, plan_args: dict) -> int:
    """A 63-bit hash of the model config and the sharding options, equal on every rank that
    agrees (JSON with sorted keys, so field order and Python's hash seed do not matter)."""
    text = json.dumps({"config": config.to_dict(), **plan_args}, sort_keys=True)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


def check_same_config(config, plan_args: dict, comm: Comm) -> None:
    """Raise ValueError on every rank if the ranks disagree on the model or the split."""
    mine = torch.tensor([config_digest(config, plan_args)], dtype=torch.int64, device=comm.device)
    everyone = [torch.zeros_like(mine) for _ in range(comm.world_size)]
    dist.all_gather(everyone, mine, group=comm.group)
    digests = [int(t.item()) for t in everyone]
    if len(set(digests)) > 1:
        groups: dict[int, list[int]] = {}
        for r, d in enumerate(digests):
            groups.setdefault(d, []).append(r)
        raise ValueError(f"ranks disagree on the model config or sharding options: ranks grouped "
                         f"by config hash {list(groups.values())}; every rank must load the same "
                         f"model with the same options")


def rank_cache(model, plan: ShardPlan, batch: int, max_len: int, *,
               device: torch.device | str | None = None) -> StaticKVCache:
    """A KV cache for this rank's K/V heads only: 1/N of the single-device cache."""
    cfg = model.config
    p = next(model.parameters())
    return StaticKVCache(cfg.n_layer, batch, plan.n_kv, cfg.head_dim, max_len, dtype=p.dtype,
                         device=device or p.device)


@dataclass
class RankReport:
    """What one rank did: its tokens, its share of memory and its time split (seconds)."""

    rank: int
    world_size: int
    device: str
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    mlp_units: tuple[int, int]
    weight_bytes: dict[str, int]
    kv_bytes: int
    token_ids: list[list[int]]
    finish_reasons: list[str]
    prefill_s: float = 0.0
    decode_steps: int = 0
    decode_s: float = 0.0  # wall time of all decode steps
    decode_comm_s: float = 0.0  # ... of which inside collectives
    allreduce_calls_per_step: int = 0
    allreduce_bytes_per_step: int = 0
    broadcast_bytes_per_step: int = 0
    logits: list[list[float]] | None = field(default=None, repr=False)  # row 0, per step

    @property
    def decode_compute_s(self) -> float:
        return self.decode_s - self.decode_comm_s

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RankReport:
        return cls(**{**d, **{k: tuple(d[k]) for k in ("q_heads", "kv_heads", "mlp_units")}})


def generate_tp(model, plan: ShardPlan, comm: Comm, prompts: list[list[int]],
                params: SamplingParams | None = None, *, eos_token_id: int | None = None,
                vocab: int | None = None, keep_logits: bool = False) -> RankReport:
    """Generate on a model already sharded by :func:`shard_gpt`; call on every rank at once.

    `prompts`: token ids, one list per row (left padded into one batch). Rank 0 samples each
    token with `params` and broadcasts it; a row stops at `eos_token_id` or ``max_new_tokens``.
    `vocab`: sample only among the first `vocab` ids. The loop is `generation.run_batch`'s, with
    the rank's cache (its own K/V heads), that sampler and hooks timing each step."""
    params = params or SamplingParams()
    device = next(model.parameters()).device
    seqs, max_len = _rows(prompts, params, eos_token_id, model.config.context_length)
    cache = rank_cache(model, plan, len(seqs), max_len, device=device)
    kept: list[list[float]] | None = [] if keep_logits else None  # row 0's logits, per step
    report = RankReport(rank=plan.rank, world_size=plan.world_size, device=str(device),
                        q_heads=plan.q_heads, kv_heads=plan.kv_heads, mlp_units=plan.mlp,
                        weight_bytes=rank_weight_bytes(model), kv_bytes=cache.nbytes,
                        token_ids=[s.output_ids for s in seqs], finish_reasons=[], logits=kept)
    token = torch.zeros(len(seqs), dtype=torch.long, device=device)
    sampler = _rank0_samples(plan.rank, comm, token, kept)
    with _timed_forwards(model, comm, report):
        req = Prepared(seqs, vocab if vocab is not None else model.config.vocab_size, device)
        for _ in run_batch(model, req, cache=cache, sampler=sampler):
            pass
    report.finish_reasons = [s.finish_reason for s in seqs]
    report.broadcast_bytes_per_step = token.numel() * token.element_size() if comm.world_size > 1 else 0
    return report


def _rows(prompts: list[list[int]], params: SamplingParams, eos_token_id: int | None,
          context_length: int) -> tuple[list[Sequence], int]:
    """One `Sequence` per prompt, and the cache length they need (ValueError past the context)."""
    if not prompts or any(not p for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token-id lists")
    eos = None if params.ignore_eos else eos_token_id
    seqs = [Sequence(b, list(p), params, eos_ids=() if eos is None else (eos,))
            for b, p in enumerate(prompts)]
    T = max(len(p) for p in prompts)
    max_len = T + params.max_new_tokens - 1  # the last token is never fed back
    if max_len > context_length:
        raise ValueError(f"longest prompt ({T} tokens) + max_new_tokens={params.max_new_tokens} "
                         f"- 1 exceeds the context of {context_length}")
    return seqs, max_len


def _rank0_samples(rank: int, comm: Comm, token: torch.Tensor, kept: list | None):
    """`run_batch`'s sampler on every rank: rank 0 samples into `token` with the default
    sampler, then every rank takes it from rank 0's broadcast (`kept`: row 0's logits, per step)."""

    def wrap(default: Sampler) -> Sampler:
        def pick(logits: torch.Tensor) -> torch.Tensor:
            if kept is not None:
                kept.append(logits[0].float().tolist())
            if rank == 0:
                token.copy_(default(logits))
            return comm.broadcast(token, src=0)
        return pick

    return wrap


@contextlib.contextmanager
def _timed_forwards(model, comm: Comm, report: RankReport):
    """Time every forward call of `model` into `report` (hooks, removed at the end): the first
    is the prefill, each other a decode step, with its collectives' time, calls and bytes."""
    device = next(model.parameters()).device
    calls = [0.0, 0]  # the current call's start time, forward calls so far

    def before(module, args, kwargs) -> None:
        comm.reset()
        sync(device)
        calls[0] = time.perf_counter()

    def after(module, args, kwargs, output) -> None:
        sync(device)
        seconds = time.perf_counter() - calls[0]
        calls[1] += 1
        if calls[1] == 1:  # the first call is the prefill
            report.prefill_s = seconds
            return
        report.decode_s += seconds
        report.decode_comm_s += comm.seconds
        report.decode_steps += 1
        report.allreduce_calls_per_step = comm.calls
        report.allreduce_bytes_per_step = comm.bytes

    hooks = [model.register_forward_pre_hook(before, with_kwargs=True),
             model.register_forward_hook(after, with_kwargs=True)]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def init_group(backend: str | None = None, device: torch.device | str | None = None,
               timeout_s: float = 60.0) -> tuple[Comm, int, int]:
    """``(comm, rank, world_size)`` after joining the group of torchrun's environment: NCCL on
    ``cuda:LOCAL_RANK`` where CUDA is present, gloo on the CPU."""
    import datetime

    if device is None:
        device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
                  if torch.cuda.is_available() else torch.device("cpu"))
    device = as_device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return Comm(None, device), dist.get_rank(), dist.get_world_size()


def shard_for_rank(model, comm: Comm, rank: int, world_size: int, *,
                   allow_uneven: bool = False) -> tuple[torch.nn.Module, ShardPlan]:
    """Check the ranks agree, then cut `model` (a full `GPT`, in place) down to this rank's share."""
    plan_args = {"world_size": world_size, "allow_uneven": allow_uneven,
                 "dtype": str(next(model.parameters()).dtype)}
    check_same_config(model.config, plan_args, comm)
    plan = shard_plan(model.config, world_size, rank, allow_uneven=allow_uneven)
    # Slice where the full model was loaded (usually the CPU), then move only this rank's share.
    return shard_gpt(model, plan, comm.all_reduce).to(comm.device), plan


def watch_parent() -> None:
    """Exit if the process that launched us dies (a killed notebook kernel leaves no orphans)."""
    if not (parent := os.environ.get(PARENT_ENV)):
        return

    def watch() -> None:
        while True:
            if os.getppid() != int(parent):
                os._exit(3)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True).start()


def leave_group(done: bool) -> None:
    """Leave the process group together: a barrier, then destroy it. A `run_local` worker that
    is `done` (its report written) ends with ``os._exit(0)`` after the barrier, since tearing
    gloo and the interpreter down can hang a finished rank; a failed run ends with its error."""
    if not done:
        dist.destroy_process_group()
        return
    with contextlib.suppress(Exception):  # a failed peer must not keep this rank from exiting
        dist.barrier()
    if os.environ.get(PARENT_ENV):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    dist.destroy_process_group()
