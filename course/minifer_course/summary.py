"""A serving run's summary, with the definitions of vLLM's serving benchmark.

`summarize` turns a run's `minifer.engine.metrics.RequestMetrics` into mean / median / p99 of
each latency, throughputs, and **goodput**: requests per second that met every latency target
(SLO) given. As in vLLM's benchmark, TPOT and ITL pool only the requests (gaps) that have them,
and aborted or unfinished requests count in no statistic. Percentiles are numpy's default
(linear between nearest ranks).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from minifer.checks import check_number
from minifer.engine.metrics import RequestMetrics

__all__ = ["summarize", "percentile", "meets", "STATS", "LATENCIES", "SLO_KEYS"]

LATENCIES = ("queue_time", "ttft", "tpot", "itl", "e2el")
"""The per-request latencies :func:`summarize` reports (seconds)."""
STATS = ("mean", "median", "p99")
SLO_KEYS = ("ttft", "tpot", "e2el")
"""Latencies a goodput target may bound (seconds)."""

NAN = float("nan")


def meets(m: RequestMetrics, slo: dict[str, float]) -> bool:
    """Whether every latency named in ``slo`` (seconds) is within its target (one output
    token has no TPOT and meets any TPOT target, vLLM's rule)."""
    for key, limit in _check_slo(slo).items():
        if key == "tpot" and m.output_tokens < 2:
            continue
        if not getattr(m, key) <= limit:  # nan (never happened) fails too
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
        good = sum(meets(m, slo) for m in done)
        summary["slo"] = dict(slo)
        summary["good"] = good
        summary["goodput"] = good / duration_s
    return summary
