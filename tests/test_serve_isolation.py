"""One bad request never harms another (issue 45, item 1).

Whatever fails for one request inside a step (sampling with no token left, detokenizing, a stop
string) ends that request alone: finish reason "error", a message naming it, its blocks freed,
and every other request's tokens exactly as if it had never been there. The engine is never
left poisoned, and the same holds in every front: in process, in the server's thread, in an
engine process.

The hostile request is the issue's reproducer: a prompt holding every token id, a logit bias
of -100 on every id and a repetition penalty of 1e38, so that its logits row ends all -inf
(every id is seen, every logit negative, and the penalty multiplies them past float32).
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minifer import GPT, GPTConfig, LLMEngine, SamplingParams
from minifer.engine.async_engine import AsyncEngine
from minifer.engine.errors import APIError

V = 64  # a small vocabulary: one prompt can hold every id


def _model() -> GPT:
    cfg = GPTConfig(vocab_size=V, context_length=128, n_layer=2, n_head=4, n_embd=32)
    model = GPT(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() == 2 else 0.02))
            if p.dim() == 2:
                p.mul_(10.0)
    return model.eval()


@pytest.fixture(scope="module")
def small():
    return _model()


def hostile(max_new_tokens: int = 8, bias: float = -100.0, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=max_new_tokens,
                          logit_bias={i: bias for i in range(V)}, repetition_penalty=1e38, **kw)


HOSTILE_PROMPT = list(range(V))
GREEDY = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
VICTIMS = [[1, 2, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11], [42]]


def _alone(model, prompt, params=GREEDY) -> list[int]:
    return LLMEngine(model).generate([prompt], params)[0].token_ids


def test_the_reproducer_ends_only_itself_and_the_engine_is_not_poisoned(small):
    eng = LLMEngine(small, block_size=4)
    outs = eng.generate([HOSTILE_PROMPT, *VICTIMS], [hostile(), GREEDY, GREEDY, GREEDY])
    bad, *good = outs
    assert bad.finished and bad.finish_reason == "error" and bad.token_ids == []
    assert "'req-0'" in bad.error and "no token left to sample" in bad.error
    assert bad.metrics.finish_reason == "error"
    assert [o.token_ids for o in good] == [_alone(small, p) for p in VICTIMS]
    assert all(o.finish_reason == "length" and o.error is None for o in good)
    assert eng.block_manager.num_used_blocks == 0 and not eng.has_unfinished()
    eng.block_manager.check()
    # the engine goes on serving: the same requests again, one step at a time
    assert [o.token_ids for o in eng.generate(VICTIMS, GREEDY)] == [o.token_ids for o in good]


def test_a_shared_params_object_is_sampled_row_by_row_after_a_failure(small):
    """Requests sharing one `SamplingParams` are sampled together; when one row cannot be
    sampled, the others still get their own tokens (a victim with the hostile's params that
    does not see every id has tokens left)."""
    params = hostile(max_new_tokens=6, bias=-1e4)
    eng = LLMEngine(small)
    outs = eng.generate([HOSTILE_PROMPT, [5, 6, 7]], params)  # one object for both
    assert outs[0].finish_reason == "error"
    assert outs[1].token_ids == _alone(small, [5, 6, 7], params)
    assert len(outs[1].token_ids) >= 1 and eng.block_manager.num_used_blocks == 0


def test_a_failing_append_ends_that_request_alone(small, monkeypatch):
    """A detokenization or stop-string error (here: `Sequence.append` raising for one request)
    ends that request with finish reason "error" after its earlier tokens."""
    eng = LLMEngine(small, block_size=4)
    victims = [eng.add_request(p, GREEDY) for p in VICTIMS]
    rid = eng.add_request([3, 1, 4, 1, 5], GREEDY)
    seq = eng.requests[rid].seq
    real = seq.append

    def append(token, now):
        if len(seq.output_ids) == 2:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return real(token, now)

    monkeypatch.setattr(seq, "append", append)
    final = {}
    while eng.has_unfinished():
        final.update((o.request_id, o) for o in eng.step() if o.finished)
    assert final[rid].finish_reason == "error" and f"{rid!r}" in final[rid].error
    assert "UnicodeDecodeError" in final[rid].error and len(final[rid].token_ids) == 2
    assert [final[v].token_ids for v in victims] == [_alone(small, p) for p in VICTIMS]
    assert eng.block_manager.num_used_blocks == 0


async def _serve(aengine, jobs):
    """Run (prompt, params) jobs through an `AsyncEngine`-like front: each one's final token
    ids, or the `APIError` it ended with."""
    handles = [await aengine.add(p, sp) for p, sp in jobs]

    async def finish(h):
        try:
            while True:
                out = await h.next(timeout=60)
                if out.finished:
                    return out.token_ids
        except APIError as err:
            return err

    return await asyncio.gather(*(finish(h) for h in handles))


@pytest.mark.parametrize("where", ["thread", "process", "replicas"])
def test_the_server_fronts_end_only_the_bad_request(small, where):
    from minifer.distributed.engine_process import EngineProcess
    from minifer.distributed.replicas import EngineReplicas

    engine = LLMEngine(small, block_size=4)
    front = (AsyncEngine(engine) if where == "thread" else EngineProcess(engine)
             if where == "process" else EngineReplicas(engine, 2))
    front.start()
    try:
        jobs = [(VICTIMS[0], GREEDY), (HOSTILE_PROMPT, hostile()), (VICTIMS[1], GREEDY)]
        first = asyncio.run(_serve(front, jobs))
        again = asyncio.run(_serve(front, [(VICTIMS[2], GREEDY)]))  # still serving
    finally:
        front.stop()
    assert first[0] == _alone(small, VICTIMS[0]) and first[2] == _alone(small, VICTIMS[1])
    err = first[1]
    assert isinstance(err, APIError) and err.status == 500 and err.code == "request_failed"
    assert "no token left to sample" in str(err) and ("srv-2" in str(err) or "srv-r" in str(err))
    assert again == [_alone(small, VICTIMS[2])]
    assert front.num_step_errors == 0 and front.stats["blocks_used"] == 0


# ---- the property ------------------------------------------------------------------------
_REFERENCE: dict = {}


def _reference(model, prompt, n) -> list[int]:
    key = (tuple(prompt), n)
    if key not in _REFERENCE:
        _REFERENCE[key] = _alone(model, prompt, SamplingParams(temperature=0, max_new_tokens=n,
                                                               ignore_eos=True))
    return _REFERENCE[key]


victim = st.tuples(st.just("victim"), st.lists(st.integers(0, V - 1), min_size=1, max_size=24),
                   st.integers(1, 10))
attacker = st.tuples(st.just("hostile"), st.permutations(range(V)), st.integers(1, 8))
engines = st.fixed_dictionaries({
    "block_size": st.sampled_from([1, 4, 16]), "max_num_seqs": st.integers(1, 4),
    "enable_chunked_prefill": st.booleans(), "enable_prefix_caching": st.booleans()})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(st.one_of(victim, attacker), min_size=1, max_size=6),
       options=engines, shared=st.booleans())
def test_hostile_requests_never_change_a_victims_tokens(small, requests, options, shared):
    """Random hostile requests mixed with victims, on random engine shapes: every victim's
    greedy tokens equal its tokens alone, every hostile one ends with "error", no block stays
    used, and the engine serves on."""
    if not options["enable_chunked_prefill"]:
        options["max_num_batched_tokens"] = 128
    eng = LLMEngine(small, **options)
    bad = hostile(bias=-1e4)  # one object for every hostile request when `shared`
    params = [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)
              if kind == "victim" else (bad if shared else hostile(n, bias=-1e4))
              for kind, _, n in requests]
    outs = eng.generate([list(p) for _, p, _ in requests], params)
    for (kind, prompt, n), out in zip(requests, outs):
        if kind == "victim":
            assert out.token_ids == _reference(small, list(prompt), n), (options, requests)
        else:
            assert out.finish_reason == "error" and repr(out.request_id) in out.error
    assert eng.block_manager.num_used_blocks == 0 and not eng.has_unfinished()
    eng.block_manager.check()


# ---- refused at add_request: what can be known then ------------------------------------------
def test_add_request_refuses_a_bad_arrival_time_and_priority(small):
    """One request check for every front (`options.prepare_request`; the disaggregated
    front's is tested in test_serve_disagg): NaN or infinite arrival times never reach the
    scheduler's clock arithmetic."""
    eng = LLMEngine(small)
    for bad in (float("nan"), float("-inf"), "soon"):
        with pytest.raises(ValueError, match="arrival_time must be a finite number"):
            eng.add_request([1, 2], GREEDY, arrival_time=bad)
    for bad in ("high", float("inf"), 2**70):
        with pytest.raises(ValueError, match="priority must be an integer"):
            eng.add_request([1, 2], GREEDY, priority=bad)
    assert not eng.has_unfinished() and eng.num_unfinished == 0


def test_a_huge_block_size_is_a_value_error_before_allocating(small):
    """Issue 45, item 9: ``block_size=10**6`` once tried to allocate 40 GB; now the config
    names the parameter and its range before any tensor exists."""
    for bad in (10**6, 129, 0, 2.0):
        with pytest.raises(ValueError, match=r"block_size must be an integer in \[1, 128\]"):
            LLMEngine(small, block_size=bad)
    assert LLMEngine(small, block_size=128).config.num_blocks == 32


def test_handing_over_between_engines_ends_only_the_bad_request(small):
    """Disaggregated serving in one process (the workers' loops without the wire): a hostile
    request fails at its first token on the prefill engine and is handed over finished."""
    from minifer.distributed.handoff import add_prefilled, export_prefilled

    pre, dec = LLMEngine(small, block_size=4), LLMEngine(small, block_size=4)
    rids = [pre.add_request(p, sp) for p, sp in
            [(VICTIMS[0], GREEDY), (HOSTILE_PROMPT, hostile()), (VICTIMS[1], GREEDY)]]
    final = {}
    while pre.has_unfinished() or dec.has_unfinished():
        for out in pre.step() if pre.has_unfinished() else []:
            if out.finished:
                final[out.request_id] = out
            else:
                assert add_prefilled(dec, export_prefilled(pre, out.request_id))
        for out in dec.step() if dec.has_unfinished() else []:
            if out.finished:
                final[out.request_id] = out
    assert final[rids[1]].finish_reason == "error" and "'req-1'" in final[rids[1]].error
    assert [final[r].token_ids for r in (rids[0], rids[2])] == [
        _alone(small, VICTIMS[0]), _alone(small, VICTIMS[1])]
    assert pre.block_manager.num_used_blocks == dec.block_manager.num_used_blocks == 0


def test_the_disaggregated_processes_end_only_the_bad_request(small):
    from minifer.distributed.disagg import DisaggregatedEngine

    with DisaggregatedEngine(small, block_size=4, timeout_s=60) as eng:
        outs = eng.generate([VICTIMS[0], HOSTILE_PROMPT, VICTIMS[1]],
                            [GREEDY, hostile(), GREEDY])
        again = eng.generate([VICTIMS[2]], GREEDY)  # both workers still serve
    assert outs[1].finish_reason == "error" and "'req-1'" in outs[1].error
    assert outs[1].token_ids == []
    assert [outs[0].token_ids, outs[2].token_ids, again[0].token_ids] == [
        _alone(small, p) for p in VICTIMS]


def test_over_http_the_bad_request_gets_an_error_naming_it(small):
    """The HTTP server (engine in a thread): a 500 whose message names the request, or in a
    stream an error event and ``[DONE]``; the next request is served as before."""
    import json

    import httpx

    from minifer_course.server import running_server

    bad = {"model": "small", "prompt": HOSTILE_PROMPT, "max_tokens": 4, "temperature": 0,
           "logit_bias": {str(i): -100 for i in range(V)}, "repetition_penalty": 1e38}
    good = {"model": "small", "prompt": VICTIMS[0], "max_tokens": 10, "temperature": 0,
            "ignore_eos": True}
    with running_server(small, None, model_name="small", engine_in="thread") as url:
        r = httpx.post(f"{url}/v1/completions", json=bad, timeout=60)
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["code"] == "request_failed" and "request 'srv-1' failed" in err["message"]
        with httpx.stream("POST", f"{url}/v1/completions", json={**bad, "stream": True},
                          timeout=60) as s:
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        assert "no token left" in json.loads(events[0])["error"]["message"]
        assert events[-1] == "[DONE]"
        r = httpx.post(f"{url}/v1/completions", json=good, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 10
