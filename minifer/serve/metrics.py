"""Per-request serving metrics (interim: the serving-metrics work replaces this file with the full
version and its run summaries; the field names below are the shared interface).

Timestamps are seconds on one clock, ``time.perf_counter()``. Definitions follow vLLM's serving
benchmark: TTFT = first token − arrival (queueing included), E2EL = finish − arrival,
TPOT = (E2EL − TTFT) / (output tokens − 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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

    @property
    def output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def queue_time(self) -> float:
        t = self.first_scheduled_time
        return NAN if t is None else t - self.arrival_time

    @property
    def ttft(self) -> float:
        t = self.first_token_time
        return NAN if t is None else t - self.arrival_time

    @property
    def e2el(self) -> float:
        end = self.finished_time if self.finished_time is not None else (
            self.token_times[-1] if self.token_times else None)
        return NAN if end is None else end - self.arrival_time

    @property
    def tpot(self) -> float:
        n = self.output_tokens
        return NAN if n < 2 else (self.e2el - self.ttft) / (n - 1)

    @property
    def itl(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]
