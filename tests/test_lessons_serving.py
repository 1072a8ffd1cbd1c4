"""Lesson 11's helpers: figures and the rate slider on hand-made numbers, the request helpers
and the experiments on real servers (127.0.0.1)."""

from __future__ import annotations

import math

import pytest

import minifer as mf
from conftest import lively_model

pytest.importorskip("minifer_course.workload")
pytest.importorskip("minifer.engine.llm_engine")
metrics = pytest.importorskip("minifer.engine.metrics")
RequestMetrics = metrics.RequestMetrics
from minifer_course.bench.serve_load import LoadResult  # noqa: E402
from minifer_course.lessons import serving as S  # noqa: E402
from minifer_course.server import running_server  # noqa: E402
from minifer_course.summary import summarize  # noqa: E402


def fake_result(ttft: float, gap: float, n: int = 4) -> LoadResult:
    ms = []
    for i in range(n):
        m = RequestMetrics(f"r{i}", prompt_tokens=8, arrival_time=float(i))
        for k in range(5):
            m.on_token(i + ttft + k * gap)
        m.on_finish(i + ttft + 4 * gap, "length")
        ms.append(m)
    return LoadResult(ms, n + 1.0, summarize(ms, n + 1.0, S.CHAT_SLO))


def test_rate_figure_and_slider_follow_the_sweep():
    sweep = S.Sweep([1, 10], [fake_result(0.1, 0.02), fake_result(0.9, 0.08)], capacity=5.0,
                    loads=[0.2, 2])
    rows = sweep.rows()
    assert [r["goodput req/s"] for r in rows] == [pytest.approx(4 / 5), 0.0]
    assert rows[1]["TTFT p50 ms"] == pytest.approx(900)
    fig = S.latency_figure(sweep, 10)
    assert "10 requests/s (2× capacity): 4 done, 0 within the chat SLO" in fig.layout.title.text
    # the SLO lines are named in the legend (a label beside the line could sit on a box)
    assert not [a for a in fig.layout.annotations if "SLO" in a.text]
    assert "red lines: the chat SLO, TTFT 500 ms and TPOT 50 ms" in [t.name for t in fig.data]
    assert fig.layout.yaxis.type == "log" and fig.layout.yaxis.ticktext
    # the boxes' axes stay put as the rate changes: ranges and ticks cover every rate and the SLO
    other = S.latency_figure(sweep, 1)
    for axis in ("yaxis", "yaxis2"):
        assert fig.layout[axis].range == other.layout[axis].range
        assert fig.layout[axis].tickvals == other.layout[axis].tickvals
    lo, hi = fig.layout.yaxis.range
    assert lo < math.log10(100) and hi > math.log10(900 + 4 * 80)  # 0.1 s TTFT … 1.22 s E2EL
    assert fig.layout.yaxis2.range[1] > math.log10(80)
    # the capacity line is labelled where it is, on the log rate axis
    marks = {a.text: a.x for a in fig.layout.annotations if a.xref == "x3"}
    assert marks == {"selected": pytest.approx(1.0), "capacity 5.0 req/s": pytest.approx(math.log10(5))}
    ui = S.rate_panel(sweep, rate=1)
    assert [label for label, _ in ui.children[0].options] == ["0.2× capacity", "2× capacity"]
    assert "1 requests/s (0.2× capacity): 4 done, 4 within" in ui.result.layout.title.text
    ui.children[0].value = 10
    assert "10 requests/s" in ui.result.layout.title.text


@pytest.fixture(scope="module")
def tiny_server():
    model, tok = lively_model("tiny"), mf.ByteTokenizer()
    engine = mf.LLMEngine(model, tok, max_num_seqs=1)
    with running_server(engine=engine, model_name=S.MODEL_NAME, max_waiting=2) as url:
        yield url, engine


def test_request_helpers(tiny_server):
    url, engine = tiny_server
    whole = S.complete(url, "Hello", max_tokens=6, temperature=0)
    streamed = S.complete(url, "Hello", max_tokens=6, temperature=0, stream=True)
    assert whole["status"] == 200 and streamed.text == whole["choices"][0]["text"]
    assert len(streamed.token_events) == 6 and streamed.usage == whole["usage"]
    assert not math.isnan(streamed.first_text_s) or streamed.text == ""
    statuses = S.burst(url, 6, prompt="Hi", max_tokens=40, ignore_eos=True)
    assert statuses.count(429) >= 2 and statuses.count(200) >= 2
    assert S.leave_early(url, "Hi", after=2, max_tokens=100, ignore_eos=True) == 2
    assert S.wait_idle(engine) and engine.block_manager.num_used_blocks == 0
    assert S.metric_lines(url, ["minifer_request_aborted_total"]) == {
        "minifer_request_aborted_total": 1.0}


@pytest.fixture(scope="module")
def shakespeare():
    return mf.load_pretrained("shakespeare")


def test_strict_priority_starves_the_low_request(shakespeare):
    # one client per high request: all six wait before the low one arrives, so strict priority
    # must serve it last however fast the machine is (with fewer clients than requests, a fast
    # machine can empty the queue between a client's requests and let the low one in)
    run = S.priorities(*shakespeare, aging=0.0, n_high=6, clients=6, tokens=4)
    assert run.first_token_order == ["high"] * 6 + ["low"] and run.highs_before_low == 6
    assert len(run.high_ttft_s) == 6 and run.low_ttft_s > 0


def test_interference_run_records_every_gap(shakespeare):
    run = S.interference(*shakespeare, chunked=True, n_short=2, short_tokens=48,
                         long_prompt=64, chunk_budget=16, long_after=3)
    assert [len(ts) for ts in run.short_times] == [48, 48]
    assert len(run.itls) == 94 and run.long_first_token_s > run.long_sent_s > 0
    assert run.stall_ms > 0 and run.typical_ms > 0
    assert run.others_done_s == max(ts[-1] for ts in run.short_times) - run.long_sent_s
    assert run.others_tokens_within(1e9) == sum(t >= run.long_sent_s for ts in run.short_times for t in ts)
    # 64 prompt tokens at most 14 a step (16 less the two decodes): 5 steps, each with a decode
    # of both short requests (45 of their 48 tokens are still to come when it arrives)
    assert run.long_prefill_steps == 5 and run.long_prefill_decodes == [2] * 5
    assert run.others_tokens_during_long_prefill == 10 <= run.others_tokens_within(1e9)
    fig = S.interference_figure([run])
    assert fig.data[0].name == "chunked prefill"


def test_stream_figure():
    events = [{"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]}, {"choices": [], "usage": {}}]
    st = S.Streamed(events, [0.01, 0.02, 0.021], 0.03)
    fig = S.stream_figure(st, 0.05)
    streamed, whole = fig.data
    assert list(streamed.y) == [0, 1, 2] and list(streamed.x) == [0, 10, 20]
    assert list(whole.x) == [0, 50, 50] and list(whole.y) == [0, 0, 2]
    assert "first after 10 ms" in fig.layout.title.text


def test_priority_figure():
    from minifer_course.lessons.contention import PriorityRun
    runs = [PriorityRun(0.0, ["high"] * 3 + ["low"], 0.5, [0.1, 0.2, 0.1]),
            PriorityRun(0.1, ["high", "low", "high", "high"], 0.2, [0.1, 0.3, 0.2])]
    fig = S.priority_figure(runs)
    highs, low = fig.data
    assert list(low.x) == ["strict priority", "aging 0.1 per step"] and list(low.y) == [500, 200]
    assert len(highs.y) == 6 and "before the low one: 3 vs 1" in fig.layout.title.text
