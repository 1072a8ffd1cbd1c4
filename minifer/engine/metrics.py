"""Per-request serving metrics and run summaries, with the definitions of vLLM's serving benchmark.

One :class:`RequestMetrics` per request holds timestamps on one clock (``time.perf_counter()``)
and derives queue time, TTFT (first token − arrival, queueing *included*: a user does not care
why it waited), ITL (the gaps between tokens), E2EL and TPOT ((E2EL − TTFT) / (tokens − 1)).

:func:`summarize` turns a run's metrics into mean / median / p99 of each, throughputs, and
**goodput**: requests per second that met every latency target (SLO) given. As in vLLM's
benchmark, TPOT and ITL pool only the requests (gaps) that have them, and aborted or unfinished
requests count in no statistic. Percentiles are numpy's default (linear between nearest ranks).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ..checks import check_number

__all__ = ["RequestMetrics", "summarize", "percentile", "STATS", "LATENCIES", "SLO_KEYS",
           "FINISH_REASONS"]

FINISH_REASONS = ("eos", "stop", "length", "abort", "error")
LATENCIES = ("queue_time", "ttft", "tpot", "itl", "e2el")
"""The per-request latencies :func:`summarize` reports (seconds)."""
STATS = ("mean", "median", "p99")
SLO_KEYS = ("ttft", "tpot", "e2el")
"""Latencies a goodput target may bound (seconds)."""

NAN = float("nan")


@dataclass
class RequestMetrics:
    """Timestamps of one request, seconds on one clock (time.perf_counter())."""

    request_id: str
    prompt_tokens: int
    arrival_time: float  # add_request was called
    first_scheduled_time: float | None = None  # first time the scheduler gave it a step
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per output token
    finished_time: float | None = None
    finish_reason: str | None = None  # "eos" | "stop" | "length" | "abort"
    preemptions: int = 0

    # -- what the engine records ---------------------------------------------------------
    def on_scheduled(self, now: float) -> None:
        """The scheduler gave this request a step (only the first one counts)."""
        if self.first_scheduled_time is None:
            self.first_scheduled_time = now

    def on_token(self, now: float) -> None:
        """One output token was produced at ``now``."""
        if self.first_token_time is None:
            self.first_token_time = now
        self.token_times.append(now)

    def on_finish(self, now: float, reason: str) -> None:
        """The request ended at ``now`` for ``reason`` (one of :data:`FINISH_REASONS`)."""
        if reason not in FINISH_REASONS:
            raise ValueError(f"reason must be one of {FINISH_REASONS}, got {reason!r}")
        self.finished_time, self.finish_reason = now, reason

    # -- what a benchmark reports --------------------------------------------------------
    @property
    def output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def finished(self) -> bool:
        return self.finished_time is not None

    @property
    def completed(self) -> bool:
        """Finished, and not aborted: the requests a benchmark's statistics count."""
        return self.finished and self.finish_reason != "abort"

    @property
    def queue_time(self) -> float:
        """First scheduled − arrival (nan if never scheduled)."""
        first = self.first_scheduled_time
        return NAN if first is None else first - self.arrival_time

    @property
    def ttft(self) -> float:
        """First token − arrival, queueing included (nan before the first token)."""
        first = self.first_token_time
        if first is None:
            first = self.token_times[0] if self.token_times else None
        return NAN if first is None else first - self.arrival_time

    @property
    def e2el(self) -> float:
        """Finish (else the last token) − arrival (nan if neither happened)."""
        end = self.finished_time
        if end is None:
            end = self.token_times[-1] if self.token_times else None
        return NAN if end is None else end - self.arrival_time

    @property
    def tpot(self) -> float:
        """(E2EL − TTFT) / (output tokens − 1); nan with fewer than two tokens."""
        n = self.output_tokens
        return NAN if n < 2 else (self.e2el - self.ttft) / (n - 1)

    @property
    def itl(self) -> list[float]:
        """Gaps between successive output tokens (output tokens − 1 of them)."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    def meets(self, slo: dict[str, float]) -> bool:
        """Whether every latency named in ``slo`` (seconds) is within its target (one output
        token has no TPOT and meets any TPOT target, vLLM's rule)."""
        for key, limit in _check_slo(slo).items():
            if key == "tpot" and self.output_tokens < 2:
                continue
            if not getattr(self, key) <= limit:  # nan (never happened) fails too
                return False
        return True


def _check_slo(slo: dict[str, float] | None) -> dict[str, float]:
    if slo is None:
        return {}
    if not isinstance(slo, dict):
        raise TypeError(f"slo must be a dict of {SLO_KEYS} → seconds, got {type(slo).__name__}")
    for key, value in slo.items():
        if key not in SLO_KEYS:
            raise ValueError(f"slo keys must be among {SLO_KEYS}, got {key!r}")
        check_number(f"slo[{key!r}]", value, gt=0, why=" of seconds")
    return slo


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0 ≤ q ≤ 100) of ``values`` as numpy's default; nan for none."""
    check_number("q", q, ge=0, le=100)
    xs = sorted(values)
    if not xs:
        return NAN
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _stats(values: Sequence[float]) -> dict[str, float]:
    vals = [v for v in values if not math.isnan(v)]
    mean = sum(vals) / len(vals) if vals else NAN
    return {"mean": mean, "median": percentile(vals, 50), "p99": percentile(vals, 99)}


def summarize(metrics: Iterable[RequestMetrics], duration_s: float,
              slo: dict[str, float] | None = None) -> dict:
    """A run's summary over ``duration_s`` seconds of wall clock: request counts, token totals
    over completed requests, throughputs (per second, for the whole server), ``{"mean",
    "median", "p99"}`` per latency in :data:`LATENCIES`, and with ``slo`` (keys among
    :data:`SLO_KEYS`) ``"good"`` and ``"goodput"`` (good requests/s)."""
    check_number("duration_s", duration_s, gt=0, why=" of seconds")
    slo = _check_slo(slo)
    metrics = list(metrics)
    for m in metrics:
        if not isinstance(m, RequestMetrics):
            raise TypeError(f"metrics must be RequestMetrics, got {type(m).__name__}")
    done = [m for m in metrics if m.completed]
    out = sum(m.output_tokens for m in done)
    inp = sum(m.prompt_tokens for m in done)
    summary: dict = {
        "completed": len(done),
        "aborted": sum(m.finish_reason == "abort" for m in metrics),
        "unfinished": sum(not m.finished for m in metrics),
        "duration_s": float(duration_s),
        "input_tokens": inp,
        "output_tokens": out,
        "request_throughput": len(done) / duration_s,
        "output_throughput": out / duration_s,
        "total_token_throughput": (inp + out) / duration_s,
    }
    for name in LATENCIES:
        if name == "itl":
            values = [g for m in done for g in m.itl]
        else:
            values = [getattr(m, name) for m in done]
        summary[name] = _stats(values)
    if slo:
        good = sum(m.meets(slo) for m in done)
        summary["slo"] = dict(slo)
        summary["good"] = good
        summary["goodput"] = good / duration_s
    return summary
