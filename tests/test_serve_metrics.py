"""Serving metrics on a hand-made timeline: every definition checked against numbers worked out
by hand (vLLM's serving-benchmark definitions)."""

import math
import random

import numpy as np
import pytest

from minifer.engine.metrics import RequestMetrics
from minifer_course.summary import percentile, summarize

APPROX = dict(rel=1e-12, abs=1e-12)


def timeline() -> list[RequestMetrics]:
    """Four requests, times in seconds:

    a: arrives 0, scheduled 0.5, tokens at 1, 1.25, 1.5, 2, finishes at 2 ("length"), 10-token prompt
    b: arrives 1, scheduled 1, one token at 1.5, finishes at 1.5 ("eos"), 5-token prompt
    c: arrives 0.5, two tokens, aborted at 1 -> counted in no statistic
    d: arrives 2, never scheduled -> unfinished
    """
    a = RequestMetrics("a", prompt_tokens=10, arrival_time=0.0)
    a.on_scheduled(0.5)
    a.on_scheduled(0.75)  # only the first scheduling counts
    for t in (1.0, 1.25, 1.5, 2.0):
        a.on_token(t)
    a.on_finish(2.0, "length")
    b = RequestMetrics("b", prompt_tokens=5, arrival_time=1.0)
    b.on_scheduled(1.0)
    b.on_token(1.5)
    b.on_finish(1.5, "eos")
    c = RequestMetrics("c", prompt_tokens=7, arrival_time=0.5, first_scheduled_time=0.6,
                       first_token_time=0.8, token_times=[0.8, 1.0])
    c.on_finish(1.0, "abort")
    d = RequestMetrics("d", prompt_tokens=3, arrival_time=2.0)
    return [a, b, c, d]


def test_per_request_definitions():
    a, b, c, d = timeline()
    assert a.output_tokens == 4 and a.completed and a.finish_reason == "length"
    assert a.queue_time == 0.5
    assert a.ttft == 1.0  # first token − arrival: includes the 0.5 s in the queue
    assert a.e2el == 2.0
    assert a.itl == [0.25, 0.25, 0.5]
    assert a.tpot == pytest.approx(1 / 3, **APPROX)  # (2 − 1) / (4 − 1)
    assert a.tpot == pytest.approx(sum(a.itl) / len(a.itl), **APPROX)  # = mean ITL when finish = last token
    assert (b.queue_time, b.ttft, b.e2el, b.itl) == (0.0, 0.5, 0.5, [])
    assert math.isnan(b.tpot)  # one token: no TPOT
    assert c.finished and not c.completed
    assert not d.finished and math.isnan(d.ttft) and math.isnan(d.queue_time)
    assert math.isnan(d.e2el) and d.itl == [] and d.output_tokens == 0


def test_e2el_uses_finish_time_else_last_token():
    m = RequestMetrics("x", 1, arrival_time=1.0, token_times=[2.0, 3.0], first_token_time=2.0)
    assert m.e2el == 2.0  # not finished yet: the last token
    m.on_finish(3.5, "stop")  # e.g. a stop string found after the last token was detokenized
    assert m.e2el == 2.5 and m.tpot == 1.5  # (2.5 − 1) / 1
    # first_token_time falls back to the first of token_times
    assert RequestMetrics("y", 1, 0.0, token_times=[0.25]).ttft == 0.25


def test_summarize_hand_made_timeline():
    s = summarize(timeline(), duration_s=2.0)
    assert (s["completed"], s["aborted"], s["unfinished"]) == (2, 1, 1)
    assert (s["input_tokens"], s["output_tokens"]) == (15, 5)
    assert s["request_throughput"] == 1.0  # 2 requests / 2 s
    assert s["output_throughput"] == 2.5  # server-wide output tokens / s
    assert s["total_token_throughput"] == 10.0  # (15 + 5) / 2
    assert s["ttft"] == pytest.approx({"mean": 0.75, "median": 0.75, "p99": 0.995}, **APPROX)
    assert s["queue_time"] == pytest.approx({"mean": 0.25, "median": 0.25, "p99": 0.495}, **APPROX)
    assert s["e2el"] == pytest.approx({"mean": 1.25, "median": 1.25, "p99": 1.985}, **APPROX)
    # TPOT: only request a has one (b made a single token)
    assert s["tpot"] == pytest.approx({"mean": 1 / 3, "median": 1 / 3, "p99": 1 / 3}, **APPROX)
    # ITL pools every gap: [0.25, 0.25, 0.5]
    assert s["itl"] == pytest.approx({"mean": 1 / 3, "median": 0.25, "p99": 0.495}, **APPROX)
    assert "goodput" not in s


@pytest.mark.parametrize("slo, good", [
    ({"ttft": 0.6}, 1),               # a's TTFT is 1.0 s
    ({"ttft": 1.0}, 2),               # targets are inclusive
    ({"tpot": 0.3}, 1),               # a's TPOT is 1/3 s; b has one token and meets any TPOT target
    ({"tpot": 0.4}, 2),
    ({"e2el": 1.0}, 1),
    ({"ttft": 2.0, "tpot": 0.4, "e2el": 0.5}, 1),  # every target must hold
])
def test_goodput(slo, good):
    s = summarize(timeline(), duration_s=2.0, slo=slo)
    assert s["good"] == good and s["goodput"] == good / 2.0 and s["slo"] == slo


def test_empty_run():
    s = summarize([], 1.0)
    assert s["completed"] == 0 and s["output_throughput"] == 0.0
    assert math.isnan(s["ttft"]["mean"]) and math.isnan(s["itl"]["p99"])


def test_percentile_is_numpy_linear():
    rng = random.Random(0)
    for n in (1, 2, 3, 10, 101):
        xs = [rng.random() for _ in range(n)]
        for q in (0, 1, 25, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([0, 10], 99) == 9.9
    assert math.isnan(percentile([], 50))


@pytest.mark.parametrize("call, match", [
    (lambda: summarize(timeline(), 0), "duration_s"),
    (lambda: summarize(timeline(), -1.0), "duration_s"),
    (lambda: summarize(timeline(), 1.0, slo={"itl": 0.1}), "slo keys"),
    (lambda: summarize(timeline(), 1.0, slo={"ttft": 0}), "positive"),
    (lambda: percentile([1.0], 101), "q must be"),
    (lambda: RequestMetrics("x", 1, 0.0).on_finish(1.0, "done"), "reason"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_bad_types():
    with pytest.raises(TypeError, match="metrics"):
        summarize([{"ttft": 1.0}], 1.0)
    with pytest.raises(TypeError, match="slo"):
        summarize(timeline(), 1.0, slo=[("ttft", 1.0)])
