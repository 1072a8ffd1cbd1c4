"""Lesson 08, parts 3 and 5: a queueing simulation driven by step times (BATCH-4 … BATCH-7).

:func:`simulate` runs a workload through the engine's own :class:`minifer.engine.scheduler.Scheduler`
on a simulated clock whose step times come from a :class:`StepCosts` (measured, or the claims'
reference CPU), producing the same :class:`Trace` as a real engine run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minifer import sequence
from minifer.checks import check_int
from minifer.engine.block_manager import BlockManager
from minifer.engine.config import EngineConfig
from minifer.engine.request import Request as ServeRequest
from minifer.engine.scheduler import POLICIES, Scheduler
from minifer.sampling import SamplingParams

from ..bench.decode import time_prefill
from ..bench.reference import DECODE as REFERENCE
from ..workload import Arrival
from .batch_sweep import REFERENCE_SWEEP, BatchSweep
from .traces import DECODE, PREFILL, Trace, mark_held

# =============================================================================================
# 3 and 5. A queueing simulation driven by step times (BATCH-4 … BATCH-7)
# =============================================================================================

@dataclass(frozen=True)
class StepCosts:
    """What a step costs, for the simulation: a decode step for ``b`` sequences takes
    ``decode_s(b)`` (linear between the measured batch sizes, extended along the last
    segment), and each prompt token prefilled in the step adds ``prefill_s_per_token``."""

    batches: tuple[int, ...]
    step_s: tuple[float, ...]
    prefill_s_per_token: float
    label: str = "this machine"

    def __post_init__(self) -> None:
        BatchSweep(self.batches, self.step_s)  # same checks
        if not self.prefill_s_per_token > 0:
            raise ValueError("prefill_s_per_token must be > 0")
        if len(self.batches) < 2:
            raise ValueError("StepCosts needs at least two batch sizes")

    @classmethod
    def from_sweep(cls, sweep: BatchSweep, prefill_s_per_token: float) -> StepCosts:
        return cls(sweep.batches, sweep.step_s, prefill_s_per_token, sweep.label)

    def decode_s(self, batch: int) -> float:
        if batch <= 0:
            return 0.0
        xs, ys = self.batches, self.step_s
        if batch <= xs[0]:
            return ys[0]
        i = next((i for i in range(1, len(xs)) if batch <= xs[i]), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (batch - x0) / (x1 - x0)

    def step(self, decode_batch: int, prefill_tokens: int) -> float:
        return self.decode_s(decode_batch) + prefill_tokens * self.prefill_s_per_token


REFERENCE_COSTS = StepCosts.from_sweep(REFERENCE_SWEEP, REFERENCE["prefill_512_ms"] / 1e3 / 512)
"""The claims' reference CPU: BATCH-1's step times, PD-3's 512-token prefill in 147 ms."""


def measure_costs(model: torch.nn.Module, sweep: BatchSweep, prompt_tokens: int = 128, *,
                  repeats: int = 3, seed: int = 0) -> StepCosts:
    """:class:`StepCosts` for ``model`` on this machine: ``sweep``'s decode steps and the
    per-token cost of one ``prompt_tokens``-token prefill."""
    t = time_prefill(model, prompt_tokens, warmup=1, repeats=repeats, seed=seed).median_s
    return StepCosts.from_sweep(sweep, t / prompt_tokens)


def simulate(requests: Sequence[Arrival], costs: StepCosts, policy: str = "continuous",
             max_num_seqs: int = 8) -> Trace:
    """Run ``requests`` (arrival times in seconds) through the serving engine's own
    :class:`minifer.engine.scheduler.Scheduler` on a simulated clock.

    * ``"continuous"``: before every step, arrived requests join (first come, first served)
      while fewer than ``max_num_seqs`` run; their prompt is prefilled in that step, which also
      makes their first token. Finished requests leave at once.
    * ``"static"``: when nothing runs, up to ``max_num_seqs`` arrived requests form a group
      that runs until *all* of them finish; a finished member's slot stays empty (nobody may
      join) and newcomers wait for the next group. (As in minifer's engine, finished rows are
      not computed; a padded batch, as in a plain batched ``generate``, would also pay for
      them.)

    The scheduler decides exactly as in :class:`minifer.LLMEngine`, with room for every
    request's KV blocks and no token budget (only ``max_num_seqs`` limits a step); no model
    runs. A step costs :meth:`StepCosts.step` of (sequences decoding, prompt tokens
    prefilled), and each request scheduled in it gets one token when it ends. When nothing
    runs and nothing waits, the clock jumps to the next arrival.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    check_int("max_num_seqs", max_num_seqs, 1)
    arrivals = sorted(requests, key=lambda r: r.arrival_s)
    ids = [r.request_id or f"req-{i}" for i, r in enumerate(arrivals)]
    if len(set(ids)) != len(ids):
        raise ValueError("request ids must be unique")
    block = 16
    bm = BlockManager(num_blocks=max(1, sum(-(-(r.prompt_len + r.max_new_tokens) // block)
                                            for r in arrivals)), block_size=block)
    scheduler = Scheduler(bm, EngineConfig(policy=policy, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max(1, sum(r.prompt_len for r in arrivals))))
    params: dict[int, SamplingParams] = {}  # one per output length
    cpu = torch.device("cpu")
    pending = []  # not arrived yet, in arrival order
    for i, (rid, r) in enumerate(zip(ids, arrivals)):
        p = params.setdefault(r.max_new_tokens, r.params())
        seq = sequence.Sequence(i, [0] * r.prompt_len, p)  # only the lengths matter: no model runs
        pending.append(ServeRequest(rid, seq, 1, 0, r.arrival_s, i, cpu))
    trace = Trace(policy)
    metrics = [r.metrics for r in pending]
    now, k = 0.0, 0
    while pending or scheduler.has_unfinished():
        while pending and pending[0].metrics.arrival_time <= now:
            req = pending.pop(0)
            scheduler.add(req)
            trace.arrival_step[req.request_id] = k
        if not scheduler.has_unfinished():
            now = pending[0].metrics.arrival_time
            continue
        plan = scheduler.schedule()
        chunks = plan.chunks
        decoding = [c for c in chunks if c.start > 0]  # one token after cached ones
        prefill_tokens = sum(c.num_new for c in chunks if c.start == 0)
        dt = costs.step(len(decoding), prefill_tokens)
        step = {}
        for c in chunks:
            step[c.request.request_id] = DECODE if c.start > 0 else PREFILL
            c.request.metrics.on_scheduled(now)
        now += dt
        k += 1
        trace.steps.append(step)
        trace.step_s.append(dt)
        trace.prompt_tokens_computed += prefill_tokens
        # every chunk completes its request's tokens: one more token each (token 0: only the
        # lengths matter), recorded by the engine's own bookkeeping at the simulated time
        scheduler.postprocess(plan, [0] * len(plan.due), now=now)
    if policy == "static":
        mark_held(trace)
    trace.metrics = metrics
    trace.duration_s = now - arrivals[0].arrival_s if arrivals else 0.0
    return trace
