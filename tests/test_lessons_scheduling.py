"""Lesson 08's module: paging's arithmetic carries the claims' numbers, the simulation
schedules the way its docstring says, the engine traces and load sweeps have the claims' shapes,
and the sliders drive their figures."""

import math

import pytest

from minifer_course.lessons import scheduling as S
from minifer_course.workload import LogNormal, Request, poisson_workload


def controls(ui) -> dict:
    return {w.description: w for w in ui.children if getattr(w, "description", "")}

# ------------------------------------------------------------------ KV-12

def test_paging_claim_numbers():
    p = S.paging_rows(context=2048, block_size=16)
    assert p["reserve_waste"] > 0.5  # "wastes most of it"
    assert p["paged_waste"] < 0.04  # "near zero" (vLLM: under 4%)
    assert p["fit_paged"] >= 2 * p["fit_reserve"]
    assert p["bytes_per_token"] == 131072 and p["room_tokens"] == 488_281  # lesson 05's numbers
    assert p["fit_reserve"] == 488_281 // 2048
    # paging wastes at most one partly filled block per sequence
    assert p["paged_tokens"] - p["used_tokens"] < 16 * p["sequences"]
    # bigger blocks waste more; block size 1 wastes nothing
    wastes = [S.paging_rows(2048, b)["paged_waste"] for b in S.BLOCK_SIZES]
    assert wastes[0] == 0 and wastes == sorted(wastes)
    # a longer reserved context wastes more
    res = [S.paging_rows(c, 16)["reserve_waste"] for c in S.CONTEXTS]
    assert res == sorted(res)


def test_paging_panel():
    ui = S.paging_panel()
    c = controls(ui)
    assert "reserving wastes 81%" in ui.result.layout.title.text
    c["context"].value = 8192
    assert "context 8,192: reserving wastes 95%" in ui.result.layout.title.text
    c["block size"].value = 256
    assert "blocks of 256 waste" in ui.result.layout.title.text
    with pytest.raises(ValueError, match="block_size"):
        S.paging_rows(2048, 0)


# ------------------------------------------------------------------ simulation

def _req(rid, prompt, out, at=0.0):
    return Request(prompt=[0] * prompt, max_new_tokens=out, arrival_s=at, request_id=rid)


COSTS = S.StepCosts((1, 2, 4), (1.0, 1.5, 2.5), prefill_s_per_token=0.25, label="toy")


def test_step_costs_interpolate():
    assert COSTS.decode_s(0) == 0 and COSTS.decode_s(1) == 1.0 and COSTS.decode_s(3) == 2.0
    assert COSTS.decode_s(6) == 3.5  # extended along the last segment
    assert COSTS.step(2, 4) == 2.5


def test_simulate_continuous_by_hand():
    reqs = [_req("a", 4, 3), _req("b", 4, 1), _req("c", 4, 2)]
    tr = S.simulate(reqs, COSTS, "continuous", max_num_seqs=2)
    # step 0: a, b prefill (8 tokens: 2 s); b is done. step 1: a decodes, c joins (1 + 1 s).
    # step 2: a, c decode (1.5 s): both done.
    assert tr.steps == [{"a": "prefill", "b": "prefill"}, {"a": "decode", "c": "prefill"},
                        {"a": "decode", "c": "decode"}]
    assert tr.step_s == [2.0, 2.0, 1.5] and tr.duration_s == 5.5
    m = {x.request_id: x for x in tr.metrics}
    assert (m["a"].ttft, m["a"].e2el, m["a"].token_times) == (2.0, 5.5, [2.0, 4.0, 5.5])
    assert (m["c"].queue_time, m["c"].ttft) == (2.0, 4.0)  # waited for b's slot
    assert tr.step_rows()["steps"] == 3 and tr.ttft_steps("c") == 2
    assert tr.summary()["output_tokens"] == 6


def test_simulate_static_by_hand():
    reqs = [_req("a", 4, 3), _req("b", 4, 1), _req("c", 4, 2)]
    tr = S.simulate(reqs, COSTS, "static", max_num_seqs=2)
    # group {a, b} runs until a is done; b's slot is held (nobody may join); then c alone
    assert tr.steps == [{"a": "prefill", "b": "prefill"}, {"a": "decode", "b": "held"},
                        {"a": "decode", "b": "held"}, {"c": "prefill"}, {"c": "decode"}]
    assert tr.step_s == [2.0, 1.0, 1.0, 1.0, 1.0]
    m = {x.request_id: x for x in tr.metrics}
    assert m["c"].queue_time == 4.0 and m["c"].ttft == 5.0  # waited for the whole group
    cont = S.simulate(reqs, COSTS, "continuous", max_num_seqs=2)
    assert cont.duration_s < tr.duration_s and len(cont.steps) < len(tr.steps)


def test_simulate_idles_until_arrival():
    tr = S.simulate([_req("a", 4, 1, at=0.0), _req("b", 4, 1, at=10.0)], COSTS, "continuous", 4)
    m = {x.request_id: x for x in tr.metrics}
    assert m["b"].ttft == 1.0 and tr.duration_s == 11.0 and tr.arrival_step == {"a": 0, "b": 1}


def test_continuous_beats_static_on_a_workload():
    reqs = poisson_workload(16, math.inf, prompt_len=(8, 32), seed=0, source="random",
                            output_len=LogNormal(8, 1.2, 2, 64), vocab_size=2)
    s = S.simulate(reqs, S.REFERENCE_COSTS, "static", 4)
    c = S.simulate(reqs, S.REFERENCE_COSTS, "continuous", 4)
    assert len(c.steps) < 0.7 * len(s.steps)
    assert s.tokens() == c.tokens() == sum(r.max_new_tokens for r in reqs)
    assert c.summary()["output_throughput"] > 1.2 * s.summary()["output_throughput"]
    assert c.summary()["ttft"]["mean"] < s.summary()["ttft"]["mean"]
    fig = S.gantt_figure(s, c)
    assert len(fig.data) == 2 + 4 and fig.data[0].z[0][0] == 2  # req-0's first step: prefill


@pytest.mark.parametrize("kwargs, match", [(dict(policy="fifo"), "policy"),
                                           (dict(max_num_seqs=0), "max_num_seqs")])
def test_simulate_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        S.simulate([_req("a", 1, 1)], COSTS, **kwargs)


# ------------------------------------------------------------------ BATCH-6, BATCH-7

def test_load_sweep_shapes():
    rows = S.load_rows(S.REFERENCE_COSTS, 16)
    low, high = rows[0], rows[-1]
    assert low["TTFT p50 ms"] < 100 and high["TTFT p50 ms"] > 10 * low["TTFT p50 ms"]
    # under overload TTFT is almost all queueing (BATCH-7)
    assert high["queue p50 ms"] > 0.9 * high["TTFT p50 ms"]
    # the served rate saturates below the offered one
    assert high["req/s served"] < high["req/s offered"]
    # BATCH-6: a bigger batch limit, more throughput under load, slower tokens
    big, small = S.load_point(S.REFERENCE_COSTS, 20, 64), S.load_point(S.REFERENCE_COSTS, 20, 4)
    assert big["output_throughput"] > 1.5 * small["output_throughput"]
    assert big["tpot_p50"] > 2 * small["tpot_p50"]
    pick = S.pick_batch_limit(S.REFERENCE_COSTS, 0.050)
    assert pick["best"]["max_num_seqs"] == 16 and pick["best"]["tpot_p50"] <= 0.050


def test_rates_follow_the_machine():
    assert S.rates_for(S.REFERENCE_COSTS) == S.RATES
    twice = S.StepCosts(S.REFERENCE_COSTS.batches, tuple(t / 2 for t in S.REFERENCE_COSTS.step_s),
                        S.REFERENCE_COSTS.prefill_s_per_token / 2)
    assert S.rates_for(twice) == tuple(2 * r for r in S.RATES)
    ui = S.load_panel(twice)
    assert "at most 16 sequences per step, 16 requests/s" in ui.result.layout.title.text
    # the same load relative to capacity: the same queueing, half the time
    assert S.load_point(twice, 40, 16)["ttft_p50"] == pytest.approx(
        S.load_point(S.REFERENCE_COSTS, 20, 16)["ttft_p50"] / 2, rel=1e-9)


def test_load_panel():
    ui = S.load_panel(S.REFERENCE_COSTS)
    assert "at most 16 sequences per step, 8 requests/s" in ui.result.layout.title.text
    controls(ui)["max seqs"].value = 64
    assert "at most 64 sequences" in ui.result.layout.title.text


# ------------------------------------------------------------------ the real engine

def test_run_engine_records_the_schedule():
    import minifer as mf

    if not hasattr(mf, "LLMEngine"):
        pytest.skip("minifer.LLMEngine is not in this tree yet")
    model = mf.GPT.from_config(mf.GPTConfig(vocab_size=64, context_length=64, n_layer=1,
                                            n_head=2, n_embd=16), seed=0)
    reqs = [Request(prompt=[1, 2, 3 + i], max_new_tokens=n, arrival_s=0.0, request_id=f"r{i}")
            for i, n in enumerate((3, 1, 2))]
    runs = {p: S.run_engine(mf.LLMEngine(model, policy=p, max_num_seqs=2), reqs, [0, 0, 1])
            for p in ("static", "continuous")}
    for tr in runs.values():
        assert tr.tokens() == 6 and tr.arrival_step == {"r0": 0, "r1": 0, "r2": 1}
        assert {r: len(t) for r, t in tr.outputs.items()} == {"r0": 3, "r1": 1, "r2": 2}
        assert tr.steps[0] == {"r0": "prefill", "r1": "prefill"}
        assert tr.prompt_tokens_computed == 9 and tr.summary()["completed"] == 3
    # same greedy answers whatever the schedule
    assert runs["static"].outputs == runs["continuous"].outputs
    # continuous: r2 takes r1's free slot at once; static: it waits for r0 too (r1's slot held)
    assert runs["continuous"].steps[1] == {"r0": "decode", "r2": "prefill"}
    assert runs["static"].steps[1] == {"r0": "decode", "r1": "held"}
    assert runs["static"].first_step("r2") == 3 and len(runs["continuous"].steps) == 3


def test_sequential_ttft():
    import minifer as mf

    if not hasattr(mf, "LLMEngine"):
        pytest.skip("minifer.LLMEngine is not in this tree yet")
    model = mf.GPT.from_config(mf.GPTConfig(vocab_size=64, context_length=64, n_layer=1,
                                            n_head=2, n_embd=16), seed=0)
    reqs = poisson_workload(4, math.inf, prompt_len=4, output_len=2, seed=0, source="random",
                            vocab_size=64, system_prompt_len=32)
    eng = mf.LLMEngine(model, enable_prefix_caching=True, max_num_seqs=1)
    ttft = S.sequential_ttft(eng, reqs)
    assert len(ttft) == 3 and all(t > 0 for t in ttft)
    assert eng.block_manager.hit_blocks == 3 * 2  # each later request reuses the 2 prefix blocks


def test_fastest_steps():
    a = S.Trace("x", steps=[{"r": "prefill"}, {"r": "decode"}], step_s=[1.0, 5.0])
    b = S.Trace("x", steps=[{"r": "prefill"}, {"r": "decode"}], step_s=[3.0, 2.0])
    assert S.fastest_steps_s(a, b) == 3.0 and S.fastest_steps_s(a) == 6.0
    c = S.Trace("x", steps=[{"r": "prefill"}], step_s=[0.5])
    with pytest.raises(ValueError, match="different schedules"):
        S.fastest_steps_s(a, c)


def test_load_figure_one_color_per_batch_limit():
    fig = S.load_figure(S.REFERENCE_COSTS, max_num_seqs=16, rate=8, rates=(1, 8, 20))
    colors: dict[str, set] = {}
    for t in fig.data:
        if t.name and t.name.startswith("max "):
            colors.setdefault(t.name, set()).add(t.line.color)
    assert len(colors) == 3 and all(len(c) == 1 for c in colors.values())  # same in every panel
    assert len({next(iter(c)) for c in colors.values()}) == 3  # and different between limits
    assert fig.layout.yaxis2.type == "log" and fig.layout.yaxis2.ticktext  # labelled log ticks
    # the curves are drawn at the rates they were computed for, and the marker sits on them
    curve = next(t for t in fig.data if t.name == "max 16 seqs")
    assert list(curve.x) == [1, 8, 20]
    marker = next(t for t in fig.data if t.mode == "markers" and t.xaxis == "x")
    assert marker.y[0] == curve.y[1]
