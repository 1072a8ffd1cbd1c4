"""Per-request serving metrics, with the definitions of vLLM's serving benchmark.

One :class:`RequestMetrics` per request holds timestamps on one clock (``time.perf_counter()``)
and derives queue time, TTFT (first token − arrival, queueing *included*: a user does not care
why it waited), ITL (the gaps between tokens), E2EL and TPOT ((E2EL − TTFT) / (tokens − 1)).
A run's summary (means, percentiles, goodput) is the benchmarks' business: `minifer_course.summary`."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RequestMetrics", "FINISH_REASONS"]

FINISH_REASONS = ("eos", "stop", "length", "abort", "error")

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
