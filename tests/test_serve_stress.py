"""A randomized stress run of the serving engine: arrivals over time, random lengths, random
aborts, a block pool small enough to force preemption. Every request that is not aborted
finishes exactly once with the right tokens; every block is free at the end."""

from __future__ import annotations

import random

import pytest

import minifer as mf
from minifer import LLMEngine, SamplingParams

MAX_NEW = 40


def _workload(rng: random.Random, n: int, system: list[int]):
    reqs = []
    for i in range(n):
        body = [rng.randrange(256) for _ in range(rng.randint(1, 50))]
        prompt = (system[:rng.choice([8, 16, 30])] + body) if rng.random() < 0.4 else body
        reqs.append((f"r{i}", prompt, rng.randint(1, MAX_NEW), rng.randint(0, 3)))
    return reqs


def _reference(model, reqs):
    """Greedy, EOS ignored: a request's tokens are the first max_new of the longest run, so one
    batched `generate` (left padded, identical to alone in fp32) gives every reference."""
    prompts = [p for _, p, _, _ in reqs]
    full = mf.generate(model, prompts, SamplingParams(temperature=0, max_new_tokens=MAX_NEW,
                                                      ignore_eos=True))
    return {rid: c.token_ids[:n] for (rid, _, n, _), c in zip(reqs, full)}


CASES = {
    "continuous-chunked-prefix": dict(policy="continuous", enable_chunked_prefill=True,
                                      max_num_batched_tokens=24, enable_prefix_caching=True),
    "continuous": dict(policy="continuous"),
    "static-prefix": dict(policy="static", enable_prefix_caching=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_stress(tiny_gqa, case):
    seed = list(CASES).index(case)
    rng = random.Random(seed)
    system = [rng.randrange(256) for _ in range(30)]
    reqs = _workload(rng, 200, system)
    ref = _reference(tiny_gqa, reqs)
    engine = LLMEngine(tiny_gqa, block_size=4, num_blocks=40, max_num_seqs=12, aging=0.1,
                       **CASES[case])
    finished: dict[str, list[int]] = {}
    aborted: set[str] = set()
    pending = list(reqs)
    step = 0
    while pending or engine.has_unfinished():
        for _ in range(rng.randint(0, 3)):  # arrivals
            if pending:
                rid, prompt, n, prio = pending.pop(0)
                engine.add_request(prompt, SamplingParams(temperature=0, max_new_tokens=n,
                                                          ignore_eos=True),
                                   request_id=rid, priority=prio)
        if engine.requests and rng.random() < 0.05:  # abort a random live request
            rid = rng.choice(sorted(engine.requests))
            assert engine.abort(rid)
            aborted.add(rid)
        for out in engine.step():
            assert out.request_id not in finished and out.request_id not in aborted
            if out.finished:
                finished[out.request_id] = out.token_ids
        step += 1
        if step % 50 == 0:
            engine.block_manager.check()
    assert len(aborted) >= 5 and engine.scheduler.num_preemptions >= 10
    assert set(finished) | aborted == {rid for rid, *_ in reqs} and not set(finished) & aborted
    for rid, tokens in finished.items():
        assert tokens == ref[rid], rid
    bm = engine.block_manager
    bm.check()
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks and not bm.tables
    assert not engine.requests and not engine.scheduler.running and not engine.scheduler.waiting
    if engine.block_manager.enable_prefix_caching:
        assert bm.hit_blocks > 0
