"""Lesson 08, parts 3 and 4: which request ran in which step. A :class:`Trace` comes from a
simulation (:mod:`.simulation`) or from the real engine (:func:`run_engine` drives a
:class:`minifer.LLMEngine` step by step, requests arriving at given steps); :func:`gantt_figure`
draws any trace.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from minifer.engine.metrics import RequestMetrics
from minifer_course.summary import summarize

from ..workload import Arrival
from .common import wide_layout

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


def mark_held(trace: Trace) -> None:
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
# 3. Static vs continuous: a Gantt chart of steps
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
    prefill step (first token), light blue a decode step, grey waiting after arrival, light orange a
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
    return wide_layout(fig, title or "which request runs in which step", width=1050, height=height)


# =============================================================================================
# 3 and 4. The real engine (needs minifer.LLMEngine)
# =============================================================================================

def run_engine(engine: Any, requests: Sequence[Arrival], arrival_steps: Sequence[int] | None = None,
               params: Any = None) -> Trace:
    """Drive ``engine`` (a :class:`minifer.LLMEngine`) through ``requests`` one step at a time:
    request ``i`` is added just before step ``arrival_steps[i]`` (default: all before step 0).

    Records which request produced a token in each step (``"prefill"`` for its first token,
    ``"decode"`` after), the steps' wall-clock durations, the prompt tokens the engine computed
    (``engine.num_prefill_tokens``: fewer with prefix caching) and the requests' metrics.
    ``params``: one `SamplingParams` for all (default: each request's :meth:`Arrival.params`:
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
        mark_held(trace)
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


def sequential_ttft(engine: Any, requests: Sequence[Arrival], warmup: int = 1) -> list[float]:
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
