"""Lesson 07, batching and serving: many users share one model (claims BATCH-1, BATCH-2,
BATCH-4 … BATCH-7, MET-4, KV-12; prefix caching).

Four parts, each a set of plain functions that return tables or plotly figures (slider
callbacks included, so tests can call them):

* **a measured batch sweep** (BATCH-1, BATCH-2, MET-4): one decode step for 1 … 64 sequences,
  timed with :func:`minifer.bench.decode.time_decode_step`; :class:`BatchSweep` holds the
  result, :func:`batch_figure` shows step time, per-user and server tokens/s beside the claims'
  reference CPU;
* **paged vs reserved KV memory** (KV-12): arithmetic over :mod:`minifer.roofline` and a seeded
  set of sequence lengths, :func:`kv_paging_figure` with block-size and context sliders;
* **a queueing simulation** (BATCH-4 … BATCH-7): :func:`simulate` runs a workload through a
  static or a continuous batcher whose step times come from a :class:`StepCosts` (measured,
  or the claims' reference CPU), producing the same :class:`Trace` as a real engine run;
* **the real engine** (BATCH-4, BATCH-5, prefix caching): :func:`run_engine` drives a
  :class:`minifer.LLMEngine` step by step with requests that arrive at given steps, and records
  which request ran in which step; :func:`gantt_figure` draws any :class:`Trace`.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from .. import roofline as rl
from ..bench.decode import REFERENCE, time_decode_step, time_prefill
from ..serve.metrics import RequestMetrics, summarize
from ..serve.workload import LogNormal, Request
from .common import control, log_axis, panel, sig, style, table

BATCHES = (1, 2, 4, 8, 16, 32, 64)
POLICIES = ("static", "continuous")


def _layout(fig: go.Figure, title: str, *, width: int = 1000, height: int = 380) -> go.Figure:
    # top=90: a two-line title clear of the subplot titles under it
    return style(fig, title, width=width, height=height + 20, title_size=13, top=90)


# =============================================================================================
# 1. Measured: one decode step for a batch of sequences (BATCH-1, BATCH-2, MET-4)
# =============================================================================================

@dataclass(frozen=True)
class BatchSweep:
    """Median seconds of one decode step for each batch size, every sequence with ``context``
    cached tokens. Each sequence gets one token per step, so a user sees ``1 / step`` tokens/s
    and the server makes ``batch / step`` (MET-4: say which one a figure is)."""

    batches: tuple[int, ...]
    step_s: tuple[float, ...]
    context: int = 64
    label: str = "this machine"

    def __post_init__(self) -> None:
        if not self.batches or len(self.batches) != len(self.step_s):
            raise ValueError("batches and step_s must be non-empty and equally long")
        if list(self.batches) != sorted(set(self.batches)) or self.batches[0] < 1:
            raise ValueError(f"batches must be increasing positive integers, got {self.batches}")
        if any(not t > 0 for t in self.step_s):
            raise ValueError("step times must be > 0 seconds")

    def step(self, batch: int) -> float:
        if batch not in self.batches:
            raise ValueError(f"batch {batch} was not measured; choose one of {list(self.batches)}")
        return self.step_s[self.batches.index(batch)]

    def per_user(self, batch: int) -> float:
        """Tokens/s one user sees in a batch of ``batch``."""
        return 1 / self.step(batch)

    def total(self, batch: int) -> float:
        """Tokens/s the whole server makes with a batch of ``batch``."""
        return batch / self.step(batch)

    def rows(self) -> list[dict]:
        base = self.step_s[0]
        return [{"batch": b, "step ms": round(t * 1e3, 2), "× batch 1": round(t / base, 1),
                 "tok/s per user": round(1 / t), "tok/s server": round(b / t)}
                for b, t in zip(self.batches, self.step_s)]


REFERENCE_SWEEP = BatchSweep(tuple(REFERENCE["batch_ms"]),
                             tuple(ms / 1e3 for ms in REFERENCE["batch_ms"].values()),
                             context=64, label="claims' reference CPU")
"""Claim BATCH-1's figures: a 4-thread laptop CPU, the reference model in fp32."""


def measure_sweep(model: torch.nn.Module, batches: Sequence[int] = BATCHES, context: int = 64,
                  *, repeats: int = 5, seed: int = 0) -> BatchSweep:
    """Time one decode step of ``model`` for each batch size (medians after warm-up), exactly as
    ``python -m minifer.bench decode`` does."""
    time_decode_step(model, 1, context, warmup=1, repeats=1, seed=seed)  # lazy init
    steps = tuple(time_decode_step(model, b, context, warmup=2, repeats=repeats,
                                   seed=seed).median_s for b in batches)
    return BatchSweep(tuple(batches), steps, context)


def sweep_table(sweep: BatchSweep, reference: BatchSweep | None = REFERENCE_SWEEP) -> str:
    """The sweep as text, with the reference CPU's step time beside each batch it has."""
    rows = sweep.rows()
    if reference is not None:
        for r in rows:
            b = r["batch"]
            r["claim ms"] = (f"{reference.step(b) * 1e3:.1f}" if b in reference.batches else "")
            r["claim tok/s"] = (f"{reference.total(b):,.0f}" if b in reference.batches else "")
    return table(rows)


def batch_figure(sweep: BatchSweep, batch: int = 8,
                 reference: BatchSweep | None = REFERENCE_SWEEP) -> go.Figure:
    """Left: decode step time against batch (and the "64 × batch 1" a batch would cost if every
    sequence paid for its own weight reads). Right: tokens/s per user and for the server. The
    reference CPU's figures are drawn beside ours; ``batch`` is marked and titled."""
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1,
                        subplot_titles=("time of one decode step", "tokens per second"))
    x = list(sweep.batches)
    fig.add_trace(go.Scatter(x=x, y=[sig(t * 1e3, 4) for t in sweep.step_s], mode="lines+markers",
                             name=f"step, {sweep.label}"), 1, 1)
    fig.add_trace(go.Scatter(x=x, y=[sig(sweep.step_s[0] * b * 1e3, 4) for b in x], mode="lines",
                             name="batch × one step (no sharing)", line=dict(dash="dot")), 1, 1)
    fig.add_trace(go.Scatter(x=x, y=[sig(sweep.total(b), 4) for b in x], mode="lines+markers",
                             name=f"server tok/s, {sweep.label}"), 1, 2)
    fig.add_trace(go.Scatter(x=x, y=[sig(sweep.per_user(b), 4) for b in x], mode="lines+markers",
                             name=f"per-user tok/s, {sweep.label}"), 1, 2)
    if reference is not None:
        rx = list(reference.batches)
        fig.add_trace(go.Scatter(x=rx, y=[sig(t * 1e3, 4) for t in reference.step_s],
                                 mode="markers", name=f"step, {reference.label}",
                                 marker=dict(symbol="x", size=9)), 1, 1)
        fig.add_trace(go.Scatter(x=rx, y=[sig(reference.total(b), 4) for b in rx], mode="markers",
                                 name=f"server tok/s, {reference.label}",
                                 marker=dict(symbol="x", size=9)), 1, 2)
    fig.add_trace(go.Scatter(x=[batch], y=[sig(sweep.step(batch) * 1e3, 4)], mode="markers",
                             showlegend=False, marker=dict(size=13, color="crimson")), 1, 1)
    fig.add_trace(go.Scatter(x=[batch, batch], y=[sig(sweep.total(batch), 4),
                                                  sig(sweep.per_user(batch), 4)],
                             mode="markers", showlegend=False,
                             marker=dict(size=13, color="crimson")), 1, 2)
    for col in (1, 2):
        log_axis(fig, "x", values=x, title_text="batch (sequences per step)", row=1, col=col)
        log_axis(fig, "y", row=1, col=col)
    fig.update_yaxes(title_text="ms", row=1, col=1)
    fig.update_yaxes(title_text="tokens/s", row=1, col=2)
    title = (f"batch {batch}: one step {sweep.step(batch) * 1e3:.1f} ms "
             f"({sweep.step(batch) / sweep.step_s[0]:.1f}× batch 1) → "
             f"{sweep.per_user(batch):,.0f} tok/s per user, "
             f"{sweep.total(batch):,.0f} tok/s for the server ({sweep.label})")
    if reference is not None and batch in reference.batches:
        title += (f"<br>{reference.label}: {reference.step(batch) * 1e3:.1f} ms, "
                  f"{reference.per_user(batch):,.0f} per user, "
                  f"{reference.total(batch):,.0f} server")
    return _layout(fig, title, height=420)


def batch_panel(sweep: BatchSweep, batch: int = 8) -> widgets.interactive:
    """A batch-size slider over a measured :class:`BatchSweep`."""

    def figure(batch: int = batch) -> go.Figure:
        return batch_figure(sweep, batch)

    return panel(figure, batch=control("select", "batch", options=list(sweep.batches),
                                       value=batch))


# =============================================================================================
# 2. Paged vs reserve-the-maximum KV memory (KV-12), arithmetic
# =============================================================================================

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CONTEXTS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
TYPICAL_LENGTH = LogNormal(median=300, sigma=0.8, lo=16, hi=10**9)
"""Lengths (prompt + answer, tokens) of the sequences in the KV-12 example: median 300, a long
tail, clipped to the context. (vLLM's paper: ShareGPT requests average ~160 prompt + ~340 output
tokens.)"""


@functools.lru_cache(maxsize=64)
def sequence_lengths(context: int, n: int = 1000, seed: int = 0,
                     lengths: LogNormal = TYPICAL_LENGTH) -> tuple[int, ...]:
    """``n`` seeded sequence lengths from ``lengths``, none longer than ``context``."""
    import random

    rng = random.Random(f"{seed}-kv12")
    return tuple(min(lengths.sample(rng), context) for _ in range(n))


def paging_rows(context: int = 2048, block_size: int = 16, model: str = "llama-3-8b",
                hardware: str = "a100-80gb", precision: str = "fp16", n: int = 1000,
                seed: int = 0) -> dict:
    """KV memory of ``n`` sequences (lengths from :func:`sequence_lengths`) under two schemes:

    * **reserve**: every sequence gets room for ``context`` tokens up front (contiguous, as
      servers before PagedAttention did): everything past its real length is wasted;
    * **paged**: the cache is a pool of ``block_size``-token blocks; a sequence holds
      ceil(length / block size) of them, so only the unfilled tail of its last block is wasted.

    Also: how many such sequences fit in the device memory left after the weights.
    """
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ValueError(f"context must be a positive integer, got {context!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    lens = sequence_lengths(context, n, seed)
    used = sum(lens)
    reserved = n * context
    paged = sum(math.ceil(x / block_size) * block_size for x in lens)
    per_token = rl.kv_bytes_per_token(model, precision)
    hw = rl.Hardware.preset(hardware)
    room = hw.memory_bytes - rl.weight_bytes(model, precision)
    room_tokens = rl.kv_tokens_fit(model, room, precision)
    return {
        "model": rl.ModelSpec.preset(model).name, "hardware": hw.name, "context": context,
        "block_size": block_size, "sequences": n, "mean_length": used / n,
        "used_tokens": used, "reserved_tokens": reserved, "paged_tokens": paged,
        "reserve_waste": 1 - used / reserved, "paged_waste": 1 - used / paged,
        "bytes_per_token": per_token, "room_bytes": room, "room_tokens": room_tokens,
        "fit_reserve": room_tokens // context,
        "fit_paged": int(room_tokens // (paged / n)),  # on average, for lengths like these
        "fit_ideal": int(room_tokens // (used / n)),
    }


def paging_figure(context: int = 2048, block_size: int = 16, model: str = "llama-3-8b",
                  hardware: str = "a100-80gb", precision: str = "fp16") -> go.Figure:
    """Left: of the KV memory each scheme allocates, the share holding real tokens and the share
    wasted. Middle: the waste of paging against the block size (selected one marked).
    Right: sequences that fit beside the weights (KV-12)."""
    p = paging_rows(context, block_size, model, hardware, precision)
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.09, column_widths=[0.3, 0.4, 0.3],
                        subplot_titles=("KV memory allocated", "paging's waste by block size",
                                        "sequences that fit"))
    schemes = [f"reserve {context:,}", f"paged, block {block_size}"]
    used = [1 - p["reserve_waste"], 1 - p["paged_waste"]]
    fig.add_trace(go.Bar(x=schemes, y=[sig(100 * u, 4) for u in used], name="holds tokens",
                         marker_color="seagreen"), 1, 1)
    fig.add_trace(go.Bar(x=schemes, y=[sig(100 * (1 - u), 4) for u in used], name="wasted",
                         marker_color="indianred"), 1, 1)
    fig.update_layout(barmode="stack")
    waste = [sig(100 * paging_rows(context, b, model, hardware, precision)["paged_waste"], 4)
             for b in BLOCK_SIZES]
    fig.add_trace(go.Scatter(x=list(BLOCK_SIZES), y=waste, mode="lines+markers",
                             name="paged waste", line=dict(color="indianred")), 1, 2)
    fig.add_trace(go.Scatter(x=[block_size], y=[sig(100 * p["paged_waste"], 4)], mode="markers",
                             showlegend=False, marker=dict(size=13, color="crimson")), 1, 2)
    fig.add_trace(go.Bar(x=["reserve", "paged", "no waste"],
                         y=[p["fit_reserve"], p["fit_paged"], p["fit_ideal"]],
                         text=[f"{v:,}" for v in (p["fit_reserve"], p["fit_paged"],
                                                  p["fit_ideal"])],
                         textposition="outside", showlegend=False,
                         marker_color=["indianred", "seagreen", "lightgray"]), 1, 3)
    fig.update_yaxes(title_text="% of allocated KV memory", range=[0, 106],
                     tickvals=[0, 20, 40, 60, 80, 100], row=1, col=1)  # room for the subplot title
    log_axis(fig, "x", values=BLOCK_SIZES, title_text="block size (tokens)", row=1, col=2)
    fig.update_yaxes(title_text="% wasted", row=1, col=2)
    fig.update_yaxes(title_text="sequences", row=1, col=3)
    title = (f"{p['model']} ({precision} cache) on {p['hardware']}, sequences of ~"
             f"{p['mean_length']:,.0f} tokens, context {context:,}: reserving wastes "
             f"{p['reserve_waste']:.0%}, blocks of {block_size} waste {p['paged_waste']:.1%}"
             f"<br>{p['fit_reserve']:,} sequences fit reserved, {p['fit_paged']:,} paged "
             f"({p['fit_paged'] / p['fit_reserve']:.1f}×)")
    return _layout(fig, title, width=1050, height=420)


def paging_panel(context: int = 2048, block_size: int = 16) -> widgets.interactive:
    """Sliders for :func:`paging_figure`: the context length reserved and the block size."""

    def figure(context: int = context, block_size: int = block_size) -> go.Figure:
        return paging_figure(context, block_size)

    return panel(figure,
                 context=control("select", "context", options=list(CONTEXTS), value=context),
                 block_size=control("select", "block size", options=list(BLOCK_SIZES),
                                    value=block_size))


# =============================================================================================
# 3. Traces: which request ran in which step (from a simulation or from the engine)
# =============================================================================================

PREFILL, DECODE, HELD = "prefill", "decode", "held"


@dataclass
class Trace:
    """What a batcher did, step by step.

    ``steps[k]`` maps each request that ran in step ``k`` to ``"prefill"`` (its prompt, and
    its first token) or ``"decode"`` (one more token); ``"held"`` marks a finished request
    whose slot a static batch still holds. ``step_s[k]`` is the step's duration;
    ``arrival_step`` the step before which each request arrived; ``metrics`` the requests'
    :class:`RequestMetrics` (seconds); ``duration_s`` the run's span, first arrival to last
    finish, idle time included (the denominator of throughputs); ``outputs`` (engine runs)
    each request's generated token ids.
    """

    policy: str
    steps: list[dict[str, str]] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    arrival_step: dict[str, int] = field(default_factory=dict)
    metrics: list[RequestMetrics] = field(default_factory=list)
    prompt_tokens_computed: int = 0
    duration_s: float = 0.0
    outputs: dict[str, list[int]] = field(default_factory=dict)  # engine runs: tokens made

    @property
    def request_ids(self) -> list[str]:
        return list(self.arrival_step)

    def first_step(self, rid: str) -> int:
        return next(k for k, s in enumerate(self.steps) if s.get(rid) == PREFILL)

    def last_step(self, rid: str) -> int:
        return max(k for k, s in enumerate(self.steps) if s.get(rid) in (PREFILL, DECODE))

    def ttft_steps(self, rid: str) -> int:
        """Steps from arrival to the end of the step that made the first token."""
        return self.first_step(rid) - self.arrival_step[rid] + 1

    def tokens(self) -> int:
        return sum(v in (PREFILL, DECODE) for s in self.steps for v in s.values())

    def summary(self, slo: dict[str, float] | None = None) -> dict:
        return summarize(self.metrics, self.duration_s, slo)

    def step_rows(self) -> dict:
        """Counts in steps (portable: no clock): steps, mean sequences per step, mean and max
        TTFT in steps."""
        ids = self.request_ids
        ttft = [self.ttft_steps(r) for r in ids]
        busy = [sum(v in (PREFILL, DECODE) for v in s.values()) for s in self.steps]
        return {"policy": self.policy, "steps": len(self.steps),
                "tokens": self.tokens(), "mean batch": round(statistics.fmean(busy), 2),
                "mean TTFT steps": round(statistics.fmean(ttft), 2),
                "max TTFT steps": max(ttft)}


def _mark_held(trace: Trace) -> None:
    """Static batching: a finished request keeps its slot until its whole group is done."""
    groups: dict[int, list[str]] = {}
    for rid in trace.request_ids:
        groups.setdefault(trace.first_step(rid), []).append(rid)
    for members in groups.values():
        end = max(trace.last_step(r) for r in members)
        for r in members:
            for k in range(trace.last_step(r) + 1, end + 1):
                trace.steps[k].setdefault(r, HELD)


# =============================================================================================
# 4. A queueing simulation driven by step times (BATCH-4 … BATCH-7)
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


def simulate(requests: Sequence[Request], costs: StepCosts, policy: str = "continuous",
             max_num_seqs: int = 8) -> Trace:
    """Run ``requests`` (arrival times in seconds) through a batcher on a simulated clock.

    * ``"continuous"``: before every step, arrived requests join (first come, first served)
      while fewer than ``max_num_seqs`` run; their prompt is prefilled in that step, which also
      makes their first token. Finished requests leave at once.
    * ``"static"``: when nothing runs, up to ``max_num_seqs`` arrived requests form a group
      that runs until *all* of them finish; a finished member's slot stays empty (nobody may
      join) and newcomers wait for the next group. (As in minifer's engine, finished rows are
      not computed; a padded batch, as in a plain batched ``generate``, would also pay for
      them.)

    A step costs :meth:`StepCosts.step` of (sequences decoding, prompt tokens prefilled). When
    nothing runs and nothing waits, the clock jumps to the next arrival.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be a positive integer, got {max_num_seqs!r}")
    reqs = sorted(requests, key=lambda r: r.arrival_s)
    ids = [r.request_id or f"req-{i}" for i, r in enumerate(reqs)]
    if len(set(ids)) != len(ids):
        raise ValueError("request ids must be unique")
    metrics = {rid: RequestMetrics(rid, r.prompt_len, r.arrival_s) for rid, r in zip(ids, reqs)}
    trace = Trace(policy)
    left = {rid: r.max_new_tokens for rid, r in zip(ids, reqs)}
    pending = list(zip(ids, reqs))  # not arrived yet, in arrival order
    waiting: list[tuple[str, Request]] = []
    running: list[str] = []  # still making tokens
    now, k = 0.0, 0
    while pending or waiting or running:
        while pending and pending[0][1].arrival_s <= now:
            rid, r = pending.pop(0)
            waiting.append((rid, r))
            trace.arrival_step[rid] = k
        if not waiting and not running:
            now = pending[0][1].arrival_s
            continue
        joining: list[tuple[str, Request]] = []
        if policy == "continuous":
            while waiting and len(running) + len(joining) < max_num_seqs:
                joining.append(waiting.pop(0))
        elif not running:
            while waiting and len(joining) < max_num_seqs:
                joining.append(waiting.pop(0))
        decoding = list(running)
        prefill_tokens = sum(r.prompt_len for _, r in joining)
        dt = costs.step(len(decoding), prefill_tokens)
        step = {rid: DECODE for rid in decoding}
        for rid, _ in joining:
            step[rid] = PREFILL
            metrics[rid].on_scheduled(now)
        now += dt
        k += 1
        trace.steps.append(step)
        trace.step_s.append(dt)
        trace.prompt_tokens_computed += prefill_tokens
        running = decoding + [rid for rid, _ in joining]
        still = []
        for rid in running:
            metrics[rid].on_token(now)
            left[rid] -= 1
            if left[rid] == 0:
                metrics[rid].on_finish(now, "length")
            else:
                still.append(rid)
        running = still
    if policy == "static":
        _mark_held(trace)
    trace.metrics = [metrics[rid] for rid in ids]
    trace.duration_s = now - reqs[0].arrival_s if reqs else 0.0
    return trace


# =============================================================================================
# 5. Latency against load (BATCH-6, BATCH-7)
# =============================================================================================

RATES = (0.5, 1, 2, 3, 4, 6, 8, 10, 12, 14, 16, 20)  # requests/s
SEQ_LIMITS = (1, 4, 8, 16, 32, 64)
LIMIT_COLORS = ("#17becf", "#1f77b4", "#2ca02c", "#d62728", "#9467bd", "#ff7f0e")  # by SEQ_LIMITS


@functools.lru_cache(maxsize=16)
def load_workload(n: int = 200, seed: int = 0) -> tuple[Request, ...]:
    """The load sweep's requests at rate 1/s (a faster rate only rescales the arrivals):
    prompts of 16–128 tokens, answers of 16–96 tokens (random ids: the simulation only needs
    lengths)."""
    from ..serve.workload import poisson_workload

    return tuple(poisson_workload(n, 1.0, prompt_len=(16, 128), output_len=(16, 96), seed=seed,
                                  source="random", vocab_size=2))


def at_rate(requests: Sequence[Request], rate: float) -> list[Request]:
    """``requests`` (made at 1 request/s) arriving ``rate`` times as fast."""
    import dataclasses

    return [dataclasses.replace(r, arrival_s=r.arrival_s / rate) for r in requests]


@functools.lru_cache(maxsize=256)
def load_point(costs: StepCosts, rate: float, max_num_seqs: int, policy: str = "continuous",
               n: int = 200, seed: int = 0) -> dict:
    """One simulated run of the load workload at ``rate`` requests/s: a flat dict of the
    numbers the figures plot (seconds, tokens/s)."""
    tr = simulate(at_rate(load_workload(n, seed), rate), costs, policy, max_num_seqs)
    s = tr.summary()
    return {"rate": rate, "max_num_seqs": max_num_seqs, "policy": policy,
            "output_throughput": s["output_throughput"],
            "request_throughput": s["request_throughput"],
            "ttft_p50": s["ttft"]["median"], "ttft_p99": s["ttft"]["p99"],
            "queue_p50": s["queue_time"]["median"], "queue_p99": s["queue_time"]["p99"],
            "tpot_p50": s["tpot"]["median"], "tpot_p99": s["tpot"]["p99"],
            "e2el_p50": s["e2el"]["median"],
            "mean_batch": statistics.fmean(
                sum(v in (PREFILL, DECODE) for v in st.values()) for st in tr.steps)}


def load_rows(costs: StepCosts, max_num_seqs: int = 16, rates: Sequence[float] = RATES,
              policy: str = "continuous") -> list[dict]:
    """:func:`load_point` at each rate, rounded for a table (ms, tokens/s)."""
    rows = []
    for rate in rates:
        p = load_point(costs, rate, max_num_seqs, policy)
        rows.append({"req/s offered": rate, "req/s served": round(p["request_throughput"], 2),
                     "out tok/s": round(p["output_throughput"]),
                     "mean batch": round(p["mean_batch"], 1),
                     "queue p50 ms": round(p["queue_p50"] * 1e3),
                     "TTFT p50 ms": round(p["ttft_p50"] * 1e3),
                     "TTFT p99 ms": round(p["ttft_p99"] * 1e3),
                     "TPOT p50 ms": round(p["tpot_p50"] * 1e3, 1)})
    return rows


def rates_for(costs: StepCosts) -> tuple[float, ...]:
    """:data:`RATES` scaled by how much faster than the reference CPU ``costs`` step (at 16
    sequences), rounded to 3 digits: the same range of load, from idle to overloaded, on a
    faster or slower machine."""
    scale = REFERENCE_COSTS.step(16, 0) / costs.step(16, 0)
    return tuple(sig(r * scale, 3) for r in RATES)


def load_figure(costs: StepCosts, max_num_seqs: int = 16, rate: float = 8.0,
                limits: Sequence[int] = (4, 16, 64),
                rates: Sequence[float] = RATES) -> go.Figure:
    """As the offered load (requests/s) rises: left, the server's output tokens/s; middle, TTFT
    (median and p99) with the part spent queueing; right, TPOT. One line per batch limit in
    ``limits`` plus ``max_num_seqs`` (bold), at each of ``rates``; ``rate`` marked."""
    limits = sorted(set(limits) | {max_num_seqs})
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.1, subplot_titles=(
        "server output tokens/s", "TTFT (dotted: queue time), median", "TPOT, median"))
    for m in limits:
        pts = [load_point(costs, r, m) for r in rates]
        width = 4 if m == max_num_seqs else 1.5
        name = f"max {m} seqs"
        # one color per batch limit in all three panels, so the legend reads for each of them
        color = LIMIT_COLORS[SEQ_LIMITS.index(m) % len(LIMIT_COLORS)] if m in SEQ_LIMITS \
            else "#7f7f7f"
        line = dict(width=width, color=color)
        fig.add_trace(go.Scatter(x=list(rates), y=[sig(p["output_throughput"], 4) for p in pts],
                                 mode="lines", name=name, legendgroup=name, line=line), 1, 1)
        fig.add_trace(go.Scatter(x=list(rates), y=[sig(p["ttft_p50"] * 1e3, 4) for p in pts],
                                 mode="lines", name=name, legendgroup=name, showlegend=False,
                                 line=line), 1, 2)
        if m == max_num_seqs:
            fig.add_trace(go.Scatter(x=list(rates), y=[sig(p["queue_p50"] * 1e3, 4) for p in pts],
                                     mode="lines", name=f"queue time, max {m} seqs",
                                     line=dict(dash="dot", width=2.5, color=color)), 1, 2)
        fig.add_trace(go.Scatter(x=list(rates), y=[sig(p["tpot_p50"] * 1e3, 4) for p in pts],
                                 mode="lines", name=name, legendgroup=name, showlegend=False,
                                 line=line), 1, 3)
    p = load_point(costs, rate, max_num_seqs)
    for col, y in ((1, p["output_throughput"]), (2, p["ttft_p50"] * 1e3),
                   (3, p["tpot_p50"] * 1e3)):
        fig.add_trace(go.Scatter(x=[rate], y=[sig(y, 4)], mode="markers", showlegend=False,
                                 marker=dict(size=12, color="crimson")), 1, col)
    fig.update_xaxes(title_text="offered load (requests/s)", rangemode="tozero")
    fig.update_yaxes(rangemode="tozero", row=1, col=1)
    fig.update_yaxes(rangemode="tozero", row=1, col=3)
    log_axis(fig, "y", row=1, col=2)
    fig.update_yaxes(title_text="ms", row=1, col=2)
    fig.update_yaxes(title_text="ms", row=1, col=3)
    title = (f"{costs.label}, at most {max_num_seqs} sequences per step, {rate:g} requests/s: "
             f"{p['output_throughput']:,.0f} output tok/s, TTFT p50 "
             f"{p['ttft_p50'] * 1e3:,.0f} ms (queueing {p['queue_p50'] * 1e3:,.0f} ms), "
             f"TPOT p50 {p['tpot_p50'] * 1e3:,.1f} ms")
    return _layout(fig, title, width=1050, height=420)


def load_panel(costs: StepCosts, max_num_seqs: int = 16, rate: float | None = None,
               rates: Sequence[float] | None = None) -> widgets.interactive:
    """Sliders over the load simulation: the batch limit and the offered load (``rates``:
    default :func:`rates_for` ``costs``; ``rate``: default the 7th of them, 8/s on the
    reference CPU)."""
    rates = tuple(rates) if rates is not None else rates_for(costs)
    rate = rates[6] if rate is None else rate

    def figure(max_num_seqs: int = max_num_seqs, rate: float = rate) -> go.Figure:
        return load_figure(costs, max_num_seqs, rate, rates=rates)

    return panel(figure,
                 max_num_seqs=control("select", "max seqs", options=list(SEQ_LIMITS),
                                      value=max_num_seqs),
                 rate=control("select", "req/s", options=list(rates), value=rate))


def pick_batch_limit(costs: StepCosts, tpot_target_s: float,
                     limits: Sequence[int] = SEQ_LIMITS, rate: float = max(RATES)) -> dict:
    """BATCH-6: under heavy load (``rate``), the batch limit with the most output tokens/s whose
    median TPOT stays within ``tpot_target_s``; with every limit's numbers."""
    pts = [load_point(costs, rate, m) for m in limits]
    ok = [p for p in pts if p["tpot_p50"] <= tpot_target_s]
    best = max(ok, key=lambda p: p["output_throughput"]) if ok else None
    return {"best": best, "points": pts}


# =============================================================================================
# 6. Static vs continuous: a Gantt chart of steps
# =============================================================================================

_STATE = {None: 0, "waiting": 1, PREFILL: 2, DECODE: 3, HELD: 4}
_COLORS = ["white", "#d9d9d9", "#1f77b4", "#9ecae1", "#fdae6b"]


def _grid(trace: Trace, n_steps: int) -> list[list[int]]:
    grid = []
    for rid in trace.request_ids:
        row, start = [], trace.arrival_step[rid]
        first = trace.first_step(rid)
        for k in range(n_steps):
            state = trace.steps[k].get(rid) if k < len(trace.steps) else None
            if state is None and start <= k < first:
                state = "waiting"
            row.append(_STATE[state])
        grid.append(row)
    return grid


def gantt_figure(*traces: Trace, title: str | None = None) -> go.Figure:
    """Which request ran in which step, one panel per trace (same step axis): dark blue the
    prefill step (first token), light blue a decode step, grey waiting after arrival, orange a
    finished request still holding its slot in a static batch."""
    n_steps = max(len(t.steps) for t in traces)
    fig = make_subplots(rows=1, cols=len(traces), shared_yaxes=True, horizontal_spacing=0.04,
                        subplot_titles=[f"{t.policy}: {len(t.steps)} steps" for t in traces])
    n = len(_COLORS)
    scale = []
    for i, c in enumerate(_COLORS):
        scale += [[i / n, c], [(i + 1) / n, c]]
    for col, t in enumerate(traces, start=1):
        fig.add_trace(go.Heatmap(z=_grid(t, n_steps), x=list(range(n_steps)),
                                 y=t.request_ids, zmin=-0.5, zmax=n - 0.5, colorscale=scale,
                                 showscale=False, xgap=1, ygap=1,
                                 hovertemplate="step %{x}, %{y}<extra></extra>"), 1, col)
        fig.update_xaxes(title_text="step", row=1, col=col)
    for name, color in (("waiting", _COLORS[1]), ("prefill", _COLORS[2]),
                        ("decode", _COLORS[3]), ("done, slot held", _COLORS[4])):
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=name,
                                 marker=dict(size=10, color=color, symbol="square")))
    fig.update_yaxes(autorange="reversed")
    height = max(300, 22 * len(traces[0].request_ids) + 140)
    return _layout(fig, title or "which request runs in which step", width=1050, height=height)


# =============================================================================================
# 7. The real engine (needs minifer.LLMEngine)
# =============================================================================================

def run_engine(engine: Any, requests: Sequence[Request], arrival_steps: Sequence[int] | None = None,
               params: Any = None) -> Trace:
    """Drive ``engine`` (a :class:`minifer.LLMEngine`) through ``requests`` one step at a time:
    request ``i`` is added just before step ``arrival_steps[i]`` (default: all before step 0).

    Records which request produced a token in each step (``"prefill"`` for its first token,
    ``"decode"`` after), the steps' wall-clock durations, the prompt tokens the engine computed
    (``engine.num_prefill_tokens``: fewer with prefix caching) and the requests' metrics.
    ``params``: one `SamplingParams` for all (default: each request's :meth:`Request.params`:
    greedy, exactly ``max_new_tokens`` tokens).
    """
    arrival_steps = list(arrival_steps) if arrival_steps is not None else [0] * len(requests)
    if len(arrival_steps) != len(requests):
        raise ValueError("arrival_steps must give one step per request")
    order = sorted(range(len(requests)), key=lambda i: arrival_steps[i])
    scheduler = getattr(engine, "scheduler", None)
    policy = getattr(scheduler, "policy", None) or getattr(engine, "policy", "engine")
    trace = Trace(str(policy))
    pending = [(arrival_steps[i], requests[i]) for i in order]
    seen: set[str] = set()
    latest: dict[str, Any] = {}
    prefilled0 = getattr(engine, "num_prefill_tokens", 0)
    k = 0
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= k:
            _, r = pending.pop(0)
            rid = engine.add_request(r.prompt, params if params is not None else r.params(),
                                     request_id=r.request_id or None)
            trace.arrival_step[rid] = k
        if not engine.has_unfinished():  # idle until the next arrival
            k = pending[0][0]
            continue
        t0 = time.perf_counter()
        outs = engine.step()
        trace.step_s.append(time.perf_counter() - t0)
        step: dict[str, str] = {}
        for o in outs:  # the requests that produced a token in this step
            step[o.request_id] = DECODE if o.request_id in seen else PREFILL
            seen.add(o.request_id)
            latest[o.request_id] = o
        trace.steps.append(step)
        k += 1
    trace.duration_s = time.perf_counter() - start
    trace.prompt_tokens_computed = getattr(engine, "num_prefill_tokens", 0) - prefilled0
    if str(policy) == "static":
        _mark_held(trace)
    trace.metrics = [latest[rid].metrics for rid in trace.request_ids if rid in latest]
    trace.outputs = {rid: list(latest[rid].token_ids) for rid in trace.request_ids
                     if rid in latest}
    return trace


def fastest_steps_s(*traces: Trace) -> float:
    """Total time of a schedule run several times: the sum over steps of each step's fastest
    run. The runs must have made the same schedule (the engine's is deterministic), so step
    ``k`` did the same work in each; a busy moment of the machine slows one run's step, not
    all of them."""
    if not traces:
        raise ValueError("fastest_steps_s needs at least one trace")
    if any(t.steps != traces[0].steps for t in traces):
        raise ValueError("the traces made different schedules; their steps cannot be compared")
    return sum(min(ts) for ts in zip(*(t.step_s for t in traces)))


def sequential_ttft(engine: Any, requests: Sequence[Request], warmup: int = 1) -> list[float]:
    """Serve ``requests`` through ``engine`` one at a time, nothing else queued, and return each
    one's TTFT in seconds (the first ``warmup`` requests run but are not counted). Without
    queueing, TTFT is the prefill: what prefix caching shortens."""
    ttfts = []
    for i, r in enumerate(requests):
        rid = engine.add_request(r.prompt, r.params(), request_id=r.request_id or None)
        final = None
        while engine.has_unfinished():
            for o in engine.step():
                if o.request_id == rid and o.finished:
                    final = o
        if i >= warmup:
            ttfts.append(final.metrics.ttft)
    return ttfts
