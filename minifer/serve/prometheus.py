"""The server's Prometheus metrics: latency histograms and request counters, recorded as
requests finish, and gauges read from the engine (queues, KV blocks, prefix-cache hit rate) when
``GET /metrics`` is scraped. prometheus_client (the ``serve`` extra) is imported only here."""

from __future__ import annotations

from typing import Any

__all__ = ["ServerMetrics", "TTFT_BUCKETS", "TPOT_BUCKETS", "E2EL_BUCKETS"]

# histogram buckets (seconds), spaced like vLLM's
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5)
E2EL_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                60.0, 120.0)


class ServerMetrics:
    """The server's Prometheus metrics, in a registry of its own (several servers may share a
    process, as in tests). Gauges are read from the engine at scrape time."""

    def __init__(self, async_engine: Any) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = r = CollectorRegistry()
        self.async_engine = async_engine
        self.ttft = Histogram("minifer_time_to_first_token_seconds", "Time to first token "
                              "(arrival to first token, queueing included)", buckets=TTFT_BUCKETS,
                              registry=r)
        self.tpot = Histogram("minifer_time_per_output_token_seconds", "Time per output token "
                              "after the first, per request", buckets=TPOT_BUCKETS, registry=r)
        self.e2el = Histogram("minifer_e2e_request_latency_seconds", "End-to-end request latency",
                              buckets=E2EL_BUCKETS, registry=r)
        self.queue = Histogram("minifer_request_queue_time_seconds", "Arrival to first scheduled "
                               "step", buckets=TTFT_BUCKETS, registry=r)
        self.finished = Counter("minifer_request_success", "Finished requests, by OpenAI "
                                "finish_reason", ["finish_reason"], registry=r)
        self.aborted = Counter("minifer_request_aborted", "Requests aborted (client gone, "
                               "timeout)", registry=r)
        self.rejected = Counter("minifer_request_rejected", "Requests refused, by HTTP status",
                                ["status"], registry=r)
        self.prompt_tokens = Counter("minifer_prompt_tokens", "Prompt tokens of finished "
                                     "requests", registry=r)
        self.generation_tokens = Counter("minifer_generation_tokens", "Tokens generated",
                                         registry=r)
        r.register(_EngineGauges(async_engine))

    def on_finish(self, out: Any) -> None:
        """Record a finished request's metrics (called in the engine thread)."""
        from .replies import openai_finish_reason

        m = out.metrics
        self.finished.labels(openai_finish_reason(out.finish_reason) or "unknown").inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(len(out.token_ids))
        for hist, value in ((self.ttft, m.ttft), (self.e2el, m.e2el), (self.tpot, m.tpot),
                            (self.queue, m.queue_time)):
            if value == value:  # not nan
                hist.observe(value)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class _EngineGauges:
    """A Prometheus collector that reads the engine's queues and KV pool when scraped."""

    GAUGES = {
        "running": ("minifer_num_requests_running", "Requests holding KV blocks and being run"),
        "waiting": ("minifer_num_requests_waiting", "Requests in the engine's waiting queue "
                    "(not started, or preempted)"),
        "unstarted": ("minifer_num_requests_unstarted", "Requests accepted that have no token "
                      "yet (what --max-waiting bounds)"),
        "blocks_used": ("minifer_kv_blocks_used", "KV-cache blocks in use"),
        "blocks_total": ("minifer_kv_blocks_total", "KV-cache blocks in the pool"),
        "kv_usage": ("minifer_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use"),
        "prefix_cache_hit_rate": ("minifer_prefix_cache_hit_rate", "Fraction of looked-up full "
                                  "prompt blocks found in the prefix cache"),
        "preemptions": ("minifer_num_preemptions", "Preemptions so far"),
        "replicas": ("minifer_engine_replicas", "Engine replicas (--engine-replicas)"),
        "replicas_alive": ("minifer_engine_replicas_alive", "Engine replicas serving now"),
        "replica_restarts": ("minifer_engine_replica_restarts", "Engine replicas started "
                             "again after they died"),
    }

    def __init__(self, async_engine: Any) -> None:
        self.async_engine = async_engine

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        stats = dict(self.async_engine.stats)
        stats["unstarted"] = self.async_engine.num_waiting
        for key, (name, doc) in self.GAUGES.items():
            if key in stats:
                yield GaugeMetricFamily(name, doc, value=float(stats[key]))
