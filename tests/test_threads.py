"""The thread policy (`minifer.fast.threads`) and the benchmark that measures it (`bench threads`)."""

from __future__ import annotations

import argparse
import os
import time

import pytest
import torch

from minifer.checks import parse_threads
from minifer.fast import threads as T
from minifer_course.bench import threads as BT


@pytest.mark.parametrize("idle,cpus,expected", [(0.0, 2, 1), (0.3, 2, 1), (0.6, 2, 1),
                                                (1.4, 2, 1), (1.6, 2, 2), (7.0, 2, 2),
                                                (3.5, 8, 4)])
def test_auto_threads_takes_the_idle_cores_at_least_one(idle, cpus, expected):
    assert T.auto_threads(idle=idle, cpus=cpus) == expected


def test_idle_cpus_is_within_the_machine():
    cpus = os.cpu_count() or 1
    assert 0.0 <= T.idle_cpus(interval=0.05) <= cpus
    assert 1 <= T.auto_threads() <= cpus


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="Linux's CPU counters")
def test_cpu_times_count_idle_within_total():
    idle, total = T.cpu_times()
    assert 0 < idle <= total


def test_parse_threads_takes_a_count_or_auto():
    assert parse_threads("auto") == "auto"
    assert parse_threads("3") == 3
    for bad in ("0", "-1", "two", "1.5", "100000"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"'auto' or an integer in \[1, "):
            parse_threads(bad)


def test_apply_threads_sets_a_count_and_none_leaves_it():
    saved = torch.get_num_threads()
    try:
        assert T.apply_threads(1) == 1 == torch.get_num_threads()
        assert T.apply_threads(None) == 1
        assert 1 <= T.apply_threads("auto") <= (os.cpu_count() or 1)
        with pytest.raises(ValueError, match="threads"):
            T.apply_threads(0)
    finally:
        torch.set_num_threads(saved)


def test_the_benchmark_options_take_auto():
    from minifer_course.bench.commands import add_machine_options

    parser = argparse.ArgumentParser()
    add_machine_options(parser)
    assert parser.parse_args(["--threads", "auto"]).threads == "auto"
    assert parser.parse_args(["--threads", "2"]).threads == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["--threads", "0"])


def test_default_settings_cover_one_all_auto_and_governed_with_both_wait_policies():
    names = [s.name for s in BT.default_settings(cpus=2)]
    assert names == ["threads=1", "threads=1, OMP_WAIT_POLICY=passive", "threads=2",
                     "threads=2, OMP_WAIT_POLICY=passive", "threads=auto",
                     "threads=auto, OMP_WAIT_POLICY=passive", "threads=governed",
                     "threads=governed, OMP_WAIT_POLICY=passive"]
    assert [s.threads for s in BT.default_settings(cpus=1)] == [1, 1, "auto", "auto",
                                                                "governed", "governed"]


def test_background_load_starts_and_ends_its_processes(monkeypatch):
    started = []
    real = BT.subprocess.Popen

    def spy(*args, **kwargs):
        started.append(real(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(BT.subprocess, "Popen", spy)
    with BT.background_load(0):
        assert started == []
    with BT.background_load(1, max_s=30):
        assert len(started) == 1 and started[0].poll() is None
    assert started[0].poll() is not None  # killed with the block


def test_a_trial_runs_in_its_own_process_with_its_settings():
    res = BT.trial(BT.Setting(1, "passive"), preset="tiny", new_tokens=4, repeats=1)
    assert res["threads"] == 1 and res["t_all"] > 0
    governed = BT.trial(BT.Setting("governed"), preset="tiny", new_tokens=4, repeats=1)
    assert 1 <= governed["threads"] <= (os.cpu_count() or 1)  # torch's count: every core
    assert res["tokens_per_s"] > 0 or res["tokens_per_s"] != res["tokens_per_s"]  # a rate or NaN


def test_report_gives_medians_spread_and_the_ratio_to_the_quiet_default():
    rows = [BT.ThreadsRow(BT.Setting(2), 0, [100.0, 110.0, 90.0], [2, 2, 2]),
            BT.ThreadsRow(BT.Setting(1), 1, [60.0, 50.0, 40.0], [1, 1, 1]),
            BT.ThreadsRow(BT.Setting("auto", "passive"), 1, [55.0, 50.0, 50.0], [1, 2, 1])]
    assert rows[0].median == 100.0 and rows[1].spread == 1.5
    text = BT.format_report(rows, cpus=2)
    assert "background load: 0 busy core(s) of 2" in text and "1 busy core(s)" in text
    line = next(x for x in text.splitlines() if x.startswith("threads=auto"))
    assert line.split()[-4:] == ["50.0", "1.10", "1/2", "0.50"]


class FakeMachine:
    """CPU counters, our own CPU time and a clock that a test moves by hand (100 ticks/s)."""

    def __init__(self, cpus=2):
        self.cpus, self.t, self.idle, self.total, self.own = cpus, 0.0, 0.0, 0.0, 0.0
        self.waited = 0.0

    def run(self, seconds, others, ours, waiting=0.0):
        """`seconds` pass with `others` cores busy in other programs and `ours` in this one,
        our threads waiting for a core `waiting` cores' worth of the time."""
        self.t += seconds
        self.total += 100 * seconds * self.cpus
        self.idle += 100 * seconds * max(0.0, self.cpus - others - ours)
        self.own += seconds * ours
        self.waited += seconds * waiting

    def governor(self, **kw):
        return T.ThreadGovernor(self.cpus, 1.0, counters=lambda: (self.idle, self.total),
                                own_cpu_s=lambda: self.own, waited_s=lambda: self.waited,
                                clock=lambda: self.t, ticks_per_s=100, **kw)


@pytest.fixture
def machine():
    """A 2-core `FakeMachine` and its governor, torch at two threads (its count restored after)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    m = FakeMachine()
    try:
        yield m, m.governor()
    finally:
        torch.set_num_threads(saved)


def test_the_governor_follows_other_programs_not_its_own_work(machine):
    m, g = machine
    assert g.maybe_adjust() is None  # the first look only starts counting
    m.run(1.0, others=0.0, ours=2.0)  # we keep both cores busy: nothing to change
    assert g.maybe_adjust() is None and g.others_busy == 0.0 and torch.get_num_threads() == 2
    m.run(1.0, others=1.0, ours=1.0)  # another program takes a core
    assert g.maybe_adjust() == 1 and torch.get_num_threads() == 1
    m.run(0.5, others=0.0, ours=1.0)  # within the period: no look
    assert g.maybe_adjust() is None
    m.run(1.0, others=0.0, ours=1.0)  # it has gone: both cores again
    assert g.maybe_adjust() == 2 and g.changes == 2
    m.run(1.0, others=0.4, ours=1.6)  # a little noise is not a busy core
    assert g.maybe_adjust() is None and torch.get_num_threads() == 2


def test_a_load_that_starts_is_met_within_a_tenth_of_a_second_and_a_free_core_in_a_period(machine):
    m, g = machine
    g.resume()
    m.run(0.1, others=0.7, ours=1.3)  # more than half a core, but not clearly a core
    assert g.maybe_adjust(2) is None and torch.get_num_threads() == 2
    m.run(0.1, others=1.0, ours=1.0)  # a spinner starts: a tenth of a second decides
    assert g.maybe_adjust(2) == 1 and g.others_busy > 0.75
    m.run(0.5, others=0.0, ours=1.0)  # it stops: not raised within the period...
    assert g.maybe_adjust(2) is None
    m.run(0.5, others=0.0, ours=1.0)  # ...but at its end
    assert g.maybe_adjust(2) == 2


def test_our_threads_waiting_for_a_core_take_one_away_within_a_tenth_of_a_second(machine):
    """Two spinning threads crowd a starting program out, so the counters show it on less than
    half a core; the wait of our own threads for a core shows it at once."""
    m, g = machine
    g.resume()
    m.run(0.1, others=0.0, ours=2.0, waiting=0.01)  # alone: the scheduler's noise
    assert g.maybe_adjust(2) is None
    m.run(0.1, others=0.45, ours=1.55, waiting=0.8)  # crowded out, and we wait
    assert g.maybe_adjust(2) == 1 and g.waiting == pytest.approx(0.8)
    assert g.others_busy < 0.5  # what the counters saw: not enough to decide
    m.run(0.1, others=1.0, ours=1.0)  # one thread beside it waits no more: held
    assert g.maybe_adjust(2) is None
    m.run(1.0, others=1.0, ours=1.0)  # the period's counters see the core taken: held
    assert g.maybe_adjust(2) is None and torch.get_num_threads() == 1
    m.run(1.1, others=0.0, ours=1.0)  # it has gone: given back after a period
    assert g.maybe_adjust(2) == 2
    g.resume()
    assert g.maybe_adjust(2) is None
    m.run(0.3, others=0.5, ours=1.5, waiting=0.9)  # a call of one step (a prefill)...
    g.pause()  # ...is counted when it ends, and the next call starts lower
    torch.set_num_threads(2)
    g.resume()
    assert g.maybe_adjust(2) == 1
    m.run(0.2, others=2.0, ours=1.0, waiting=1.0)  # one thread can go no lower
    assert g.maybe_adjust(1) is None and g.decided >= 1


def test_a_decision_holds_into_the_next_call_and_a_pause_is_not_counted():
    """Short calls (each under a period) still get the decision of earlier work at their first
    step, and what others did while we paused (another engine's turn) does not count."""
    saved = torch.get_num_threads()
    try:
        m = FakeMachine()
        g = m.governor()
        torch.set_num_threads(2)
        g.resume()
        for _ in range(4):  # a call of 4 half-second steps beside a busy core
            m.run(0.5, others=1.0, ours=1.0)
            g.maybe_adjust(2)
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)  # the call restores the caller's count
        m.run(10.0, others=2.0, ours=0.0)  # a pause: other programs on both cores
        g.resume()
        assert g.maybe_adjust(2) == 1  # the next call starts at once at the decided count
        torch.set_num_threads(2)
        m2 = FakeMachine()  # a quiet machine, then a pause full of others' work
        g2 = m2.governor()
        g2.resume()
        for _ in range(3):
            m2.run(0.5, others=0.0, ours=2.0)
            assert g2.maybe_adjust(2) is None
        m2.run(10.0, others=2.0, ours=0.0)
        g2.resume()
        m2.run(0.5, others=0.0, ours=2.0)
        assert g2.maybe_adjust(2) is None and torch.get_num_threads() == 2
        assert g2.others_busy == 0.0
    finally:
        torch.set_num_threads(saved)


def test_the_governor_does_nothing_without_counters():
    g = T.ThreadGovernor(2, 0.0, counters=lambda: None)
    assert g.maybe_adjust() is None and g.maybe_adjust() is None and g.others_busy is None


def test_the_server_takes_threads_from_its_command_line():
    from minifer.serve.__main__ import build_parser, server_options

    assert server_options(build_parser().parse_args([]))["threads"] == "auto"
    assert server_options(build_parser().parse_args(["--threads", "1"]))["threads"] == 1
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--threads", "none"])


def test_the_engine_loop_sets_its_threads_and_auto_keeps_a_governor():
    import minifer as mf
    from conftest import lively_model
    from minifer.engine.async_engine import AsyncEngine
    from minifer.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="threads"):
        AsyncEngine(LLMEngine(lively_model("tiny"), mf.ByteTokenizer()), threads=0)
    saved = torch.get_num_threads()
    try:
        for threads in (1, "auto"):
            engine = AsyncEngine(LLMEngine(lively_model("tiny"), mf.ByteTokenizer()),
                                 threads=threads)
            engine.start()
            engine.stop()
            governed = isinstance(getattr(engine.adjust_threads, "__self__", None),
                                  T.ThreadGovernor)
            assert governed == (threads == "auto")
            assert 1 <= engine.threads_in_force <= (os.cpu_count() or 1)
            if threads == 1:
                assert engine.threads_in_force == 1
    finally:
        torch.set_num_threads(saved)


def test_generate_runs_with_the_threads_it_is_given_and_restores_torchs():
    import minifer as mf

    model = mf.GPT.from_config("tiny")
    greedy = mf.SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    before = torch.get_num_threads()
    seen = []
    hook = model.transformer.h[0].register_forward_hook(
        lambda *_: seen.append(torch.get_num_threads()))
    try:
        plain = mf.generate(model, [[1, 2, 3]], greedy)[0].token_ids
        seen.clear()
        one = mf.generate(model, [[1, 2, 3]], greedy, threads=1)[0].token_ids
    finally:
        hook.remove()
    assert one == plain and set(seen) == {1} and torch.get_num_threads() == before
    for bad in (0, -2, 1.5, "many"):
        with pytest.raises(ValueError, match=r"threads must be 'auto' or an integer in \[1, "):
            mf.generate(model, [[1, 2, 3]], greedy, threads=bad)


@pytest.fixture
def asked(monkeypatch):
    """The shared governor replaced by one that records what it is asked, in order."""
    calls = []

    class Recording:
        def resume(self):
            calls.append("resume")

        def pause(self):
            calls.append("pause")

        def maybe_adjust(self, ceiling=None):
            calls.append(ceiling)

    monkeypatch.setattr(T, "_shared", Recording())
    return calls


def test_generate_with_auto_threads_asks_the_shared_governor_at_every_step(asked):
    import minifer as mf

    model = mf.GPT.from_config("tiny")
    greedy = mf.SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True)
    auto = mf.generate(model, [[4, 5]], greedy, threads="auto")[0].token_ids
    # resumed at the start, asked then and before each of the 5 steps, paused at the end
    assert asked == ["resume"] + [None] * (1 + 5) + ["pause"]
    asked.clear()
    assert auto == mf.generate(model, [[4, 5]], greedy)[0].token_ids
    assert asked == []  # the default reads no CPU counters: the governor runs only when asked
    mf.generate(model, [[4, 5]], greedy, threads=1)  # a fixed count: no governor
    assert asked == []
    assert T.shared_governor() is T._shared


def test_speculative_generate_keeps_the_same_thread_policy(asked):
    import minifer as mf
    from minifer.speculative import PromptLookupDrafter, speculative_generate

    model = mf.GPT.from_config("tiny")
    greedy = mf.SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    prompt = [[4, 5, 6, 4, 5]]
    plain = mf.generate(model, prompt, greedy, threads=1)[0].token_ids
    saved = torch.get_num_threads()
    spec = speculative_generate(model, PromptLookupDrafter(), prompt, greedy)[0].token_ids
    assert spec == plain and torch.get_num_threads() == saved and asked == []
    speculative_generate(model, PromptLookupDrafter(), prompt, greedy, threads="auto")
    # resumed, asked before the prefill and every round, paused at the end
    assert asked[0] == "resume" and asked[-1] == "pause" and len(asked) >= 4
    assert set(asked[1:-1]) == {None}
    asked.clear()
    speculative_generate(model, PromptLookupDrafter(), prompt, greedy, threads=1)
    assert asked == [] and torch.get_num_threads() == saved
    with pytest.raises(ValueError, match="threads"):
        speculative_generate(model, PromptLookupDrafter(), prompt, greedy, threads=0)


def test_auto_threads_give_a_busy_core_its_thread(monkeypatch):
    """``threads="auto"`` on a 2-core machine where another program takes a core halfway: the
    governor drops to one thread, and the count it set stays after the call."""
    import minifer as mf

    m = FakeMachine()
    monkeypatch.setattr(T, "_shared", m.governor())
    model = mf.GPT.from_config("tiny")
    greedy = mf.SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    seen = []

    def tick(*_):  # each step takes a second; from the fourth on, another program holds a core
        seen.append(torch.get_num_threads())
        busy = len(seen) >= 4
        m.run(1.0, others=1.0 if busy else 0.0, ours=1.0 if busy else 2.0)

    hook = model.transformer.h[0].register_forward_hook(tick)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        plain = mf.generate(model, [[1, 2, 3]], greedy, threads=2)[0].token_ids
        seen.clear()
        assert mf.generate(model, [[1, 2, 3]], greedy, threads="auto")[0].token_ids == plain
        assert seen[:4] == [2, 2, 2, 2] and seen[-1] == 1 and torch.get_num_threads() == 1
    finally:
        hook.remove()
        torch.set_num_threads(saved)


def test_a_compiled_step_is_not_compiled_again_when_the_governor_changes_the_count(monkeypatch):
    """torch compiles a step again for every thread count (10 s for GPT-2 on a 2-core Xeon):
    once the governor has lowered the count, the steps of a shape compiled at the old count run
    eager, with the same tokens, while they have taken less time than compiling did."""
    import minifer as mf
    from minifer.fast import compiled as C
    from minifer.fast.decode import LeanStep

    m = FakeMachine()
    monkeypatch.setattr(T, "_shared", m.governor())
    monkeypatch.setattr(C, "_shapes", type(C._shapes)())
    counts = []

    class SpyStep(LeanStep):  # stands in for the compiled step
        def forward(self, model, tokens, writer):
            if not counts:
                time.sleep(0.3)  # compiling: far longer than the few eager steps below
            counts.append(torch.get_num_threads())
            return super().forward(model, tokens, writer)

    spy_step = SpyStep(fixed_shape=True)
    monkeypatch.setattr(C, "compiled_decode", lambda model, mode=None: spy_step)
    model = mf.GPT.from_config("tiny")
    greedy = mf.SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    seen = []

    def tick(*_):  # each forward a second; from the fourth on, another program holds a core
        seen.append(torch.get_num_threads())
        busy = len(seen) >= 4
        m.run(1.0, others=1.0 if busy else 0.0, ours=1.0 if busy else 2.0)

    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        plain = mf.generate(model, [[1, 2, 3]], greedy, threads=2)[0].token_ids
        hook = model.transformer.h[0].register_forward_hook(tick)
        try:
            out = mf.generate(model, [[1, 2, 3]], greedy, compile=True, threads="auto")[0].token_ids
        finally:
            hook.remove()
        assert out == plain
        assert 1 in seen and counts and set(counts) == {2}  # compiled only at the first count
        assert len(counts) < len(seen) - 1  # the steps at one thread ran eager
    finally:
        torch.set_num_threads(saved)


def test_a_new_count_gets_its_compiled_graph_once_eager_steps_have_cost_a_compile():
    from minifer.fast.compiled import ShapeThreads

    shape = ShapeThreads()
    assert shape.compiled(2)  # the first count compiles
    shape.ran(2, True, 10.0)  # ... and that took 10 s
    assert shape.compiled(2)
    shape.ran(2, True, 0.01)
    assert shape.compile_s == 10.0
    for _ in range(3):  # the governor moved to one thread: eager, 3 s a step
        assert not shape.compiled(1)
        shape.ran(1, False, 3.0)
    assert shape.compiled(1) is False  # 9 s < 10 s
    shape.ran(1, False, 3.0)
    assert shape.compiled(1) and shape.counts == {1, 2}  # 12 s >= 10 s: compile for it now
    assert shape.compiled(2)  # and the old count keeps its graph


@pytest.mark.parametrize("threads", [0, -1, 10**5, 2.5, True, "many"])
def test_generate_refuses_a_thread_count_out_of_range_before_any_work(threads):
    """threads=100_000 crashed torch (a segfault), 10,000 took seconds a token: the count is
    bounded by `checks.max_threads` (four per core) with an error naming the parameter."""
    import minifer as mf
    from minifer.checks import max_threads

    model = mf.GPT.from_config("tiny")
    params = mf.SamplingParams(temperature=0, max_new_tokens=2)
    for fn in (mf.generate, lambda *a, **k: mf.speculative_generate(model, model, *a[1:], **k)):
        with pytest.raises(ValueError, match=rf"threads must be 'auto' or an integer in \[1, "
                                             rf"{max_threads()}\]"):
            fn(model, [[1, 2]], params, threads=threads)
    assert mf.generate(model, [[1, 2]], params, threads=max_threads())[0].token_ids
