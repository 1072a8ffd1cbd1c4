"""LLMEngine: every request's output equals `minifer.generate` of that prompt alone, whatever
the policy, chunking, preemption or prefix sharing; seeded sampling ignores the batch;
priorities with and without aging; aborts; clear errors."""

from __future__ import annotations

import pytest
import torch

import minifer as mf
from conftest import engine_reading, on_device, pool_read
from minifer import LLMEngine, SamplingParams
from minifer.engine.llm_engine import RequestOutput
from minifer.fast.native import build_tools_problem

GREEDY = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)


def _prompts(n, lo=1, hi=60, seed=1, prefix=()):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(lo, hi + 1, (1,), generator=g))
        out.append(list(prefix) + torch.randint(0, 256, (length,), generator=g).tolist())
    return out


def _alone(model, prompts, params):
    return [mf.generate(model, [p], params)[0].token_ids for p in prompts]


CONFIGS = {
    "continuous": dict(policy="continuous", max_num_seqs=6),
    "static": dict(policy="static", max_num_seqs=6),
    "continuous-chunked": dict(policy="continuous", max_num_seqs=6, enable_chunked_prefill=True,
                               max_num_batched_tokens=16),
    "static-chunked": dict(policy="static", max_num_seqs=6, enable_chunked_prefill=True,
                           max_num_batched_tokens=16),
    "preempt": dict(policy="continuous", max_num_seqs=8, block_size=4, num_blocks=24),
    "preempt-chunked": dict(policy="continuous", max_num_seqs=8, block_size=4, num_blocks=24,
                            enable_chunked_prefill=True, max_num_batched_tokens=12),
    "static-preempt": dict(policy="static", max_num_seqs=8, block_size=4, num_blocks=24),
}


@pytest.fixture(scope="module")
def workload(tiny, device):
    prompts = _prompts(14)
    return prompts, _alone(on_device(tiny, device), prompts, GREEDY)


@pytest.mark.parametrize("kv_read", ["blocks", "kernel"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_outputs_equal_generate_alone(tiny, workload, name, kv_read, device):
    prompts, ref = workload
    engine = engine_reading(kv_read, on_device(tiny, device), **CONFIGS[name])
    if kv_read == "kernel" and build_tools_problem() is None and device == "cpu":
        assert pool_read(engine.pool) == "kernel"  # built here: no fallback
    outs = engine.generate(prompts, GREEDY)
    assert len({tuple(r) for r in ref}) == len(ref)  # varied outputs: the test can fail
    assert [o.token_ids for o in outs] == ref
    assert all(o.finished and o.finish_reason == "length" for o in outs)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check()
    if "preempt" in name:
        assert engine.scheduler.num_preemptions > 0
        assert sum(o.metrics.preemptions for o in outs) == engine.scheduler.num_preemptions
    else:
        assert engine.scheduler.num_preemptions == 0


@pytest.mark.parametrize("kv_read", ["blocks", "kernel"])
def test_gqa_model_through_every_mechanism(tiny_gqa, kv_read):
    prompts = _prompts(8, seed=3)
    ref = _alone(tiny_gqa, prompts, GREEDY)
    engine = engine_reading(kv_read, tiny_gqa, max_num_seqs=8, block_size=4, num_blocks=24,
                            enable_chunked_prefill=True, max_num_batched_tokens=10,
                            enable_prefix_caching=True)
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == ref
    assert engine.scheduler.num_preemptions > 0


def test_chunked_prefill_interleaves_with_decode(tiny):
    """A long prompt arriving while another request decodes is fed in chunks in the same steps
    as that request's decode tokens (BATCH-8)."""
    engine = LLMEngine(tiny, enable_chunked_prefill=True, max_num_batched_tokens=8)
    short, long = _prompts(1, 5, 5, seed=4)[0], _prompts(1, 60, 60, seed=5)[0]
    a = engine.add_request(short, GREEDY)
    engine.step()  # a is prefilled (5 tokens) and samples its first token
    b = engine.add_request(long, GREEDY)
    mixed = 0
    while engine.has_unfinished():
        engine.step()
        s = engine.last_step
        assert s.num_tokens <= 8
        if s.decode == [a] and s.prefill and s.prefill[0][0] == b:
            mixed += 1
    assert mixed == 60 // 7 + 1  # 7 prompt tokens per step beside a's decode token
    assert engine.num_prefill_tokens == 65


@pytest.mark.parametrize("chunked", [False, True])
def test_prefix_caching_shares_a_system_prompt_and_changes_nothing(tiny, chunked):
    system = _prompts(1, 40, 40, seed=6)[0]
    prompts = _prompts(10, 1, 12, seed=7, prefix=system)
    ref = _alone(tiny, prompts, GREEDY)
    kw = dict(block_size=8, max_num_seqs=4, enable_chunked_prefill=chunked,
              max_num_batched_tokens=32 if chunked else None)
    plain = LLMEngine(tiny, **kw)
    cached = LLMEngine(tiny, enable_prefix_caching=True, **kw)
    assert [o.token_ids for o in plain.generate(prompts, GREEDY)] == ref
    assert [o.token_ids for o in cached.generate(prompts, GREEDY)] == ref
    # the 40-token system prompt fills 5 blocks: computed once, then found by every later prompt
    saved = plain.num_prefill_tokens - cached.num_prefill_tokens
    assert saved >= 40 * 8 - 40  # at least 8 of the 10 prompts reuse all 5 blocks
    assert cached.block_manager.hit_blocks >= 5 * 8
    assert cached.block_manager.num_used_blocks == 0


def test_seeded_sampling_ignores_the_batch(tiny):
    params = SamplingParams(temperature=1.0, top_k=40, seed=123, max_new_tokens=20, ignore_eos=True)
    prompt = _prompts(1, 10, 10, seed=8)[0]
    others = _prompts(6, seed=9)
    alone = LLMEngine(tiny).generate([prompt], params)[0].token_ids
    other = SamplingParams(temperature=0.8, seed=5, max_new_tokens=30, ignore_eos=True)
    crowd = LLMEngine(tiny, max_num_seqs=4, block_size=4, num_blocks=30)
    for p in others[:3]:
        crowd.add_request(p, other)
    rid = crowd.add_request(prompt, params)
    for p in others[3:]:
        crowd.add_request(p, params)  # same params object: sampled in one group with it
    final = {}
    while crowd.has_unfinished():
        final.update({o.request_id: o for o in crowd.step() if o.finished})
    assert final[rid].token_ids == alone
    assert alone == mf.generate(tiny, [prompt], params)[0].token_ids  # and equal to generate
    reseeded = SamplingParams(temperature=1.0, top_k=40, seed=124, max_new_tokens=20,
                              ignore_eos=True)
    assert LLMEngine(tiny).generate([prompt], reseeded)[0].token_ids != alone


def test_text_stop_strings_and_eos(make_scripted, tok):
    script = list(b"Hello world. Goodbye!") + [256]
    model = make_scripted(script)
    engine = LLMEngine(model, tok)
    params = SamplingParams(temperature=0, max_new_tokens=40)
    a = engine.add_request("H", params)
    b = engine.add_request("H", SamplingParams(temperature=0, max_new_tokens=40, stop="Good"))
    outs, deltas = {}, {a: "", b: ""}
    while engine.has_unfinished():
        for o in engine.step():
            deltas[o.request_id] += o.delta
            outs[o.request_id] = o
    assert outs[a].finish_reason == "eos" and outs[a].text == "ello world. Goodbye!"
    assert outs[b].finish_reason == "stop" and outs[b].text == "ello world. "
    assert deltas[a] == outs[a].text and deltas[b] == outs[b].text


def test_step_outputs_and_metrics(tiny):
    engine = LLMEngine(tiny)
    rid = engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_new_tokens=3,
                                                       ignore_eos=True), request_id="r1")
    assert rid == "r1" and engine.has_unfinished()
    seen = []
    while engine.has_unfinished():
        seen += engine.step()
    assert [len(o.token_ids) for o in seen] == [1, 2, 3]
    assert [o.finished for o in seen] == [False, False, True]
    assert isinstance(seen[0], RequestOutput) and seen[0].text is None  # no tokenizer
    m = seen[-1].metrics
    assert m.request_id == "r1" and m.prompt_tokens == 3 and m.output_tokens == 3
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert m.token_times == sorted(m.token_times) and m.finish_reason == "length"
    assert engine.step() == []  # nothing left to do


def test_abort_frees_blocks_and_ends_the_request(tiny):
    engine = LLMEngine(tiny, max_num_seqs=1, block_size=4)
    a = engine.add_request([1] * 10, GREEDY)
    b = engine.add_request([2] * 10, GREEDY)
    engine.step()
    assert engine.block_manager.num_used_blocks == 3
    assert engine.abort(a) and not engine.abort(a) and not engine.abort("nope")
    assert engine.block_manager.num_used_blocks == 0
    assert engine.abort(b)  # still waiting
    assert not engine.has_unfinished() and engine.step() == []


def _serve_order(engine, n_steps):
    """Step `n_steps` times; the order in which requests were first scheduled."""
    order = []
    for _ in range(n_steps):
        engine.step()
        for rid in [r for r, _ in engine.last_step.prefill] + engine.last_step.decode:
            if rid not in order:
                order.append(rid)
    return order


def test_priorities_lower_value_first_then_arrival(tiny):
    engine = LLMEngine(tiny, max_num_seqs=1)
    p = SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True)
    for rid, prio in (("a", 2), ("b", 0), ("c", 1), ("d", 0)):
        engine.add_request([5, 6], p, request_id=rid, priority=prio)
    assert _serve_order(engine, 8) == ["b", "d", "c", "a"]


@pytest.mark.parametrize("aging", [0.0, 1.0])
def test_strict_priority_starves_and_aging_does_not(tiny, aging):
    """A low-priority request behind a steady stream of high-priority ones (BATCH-9): with strict
    priority it never runs while the stream lasts; with aging it does."""
    engine = LLMEngine(tiny, max_num_seqs=1, aging=aging)
    p = SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True)
    engine.add_request([1, 2, 3], p, request_id="low", priority=5)
    for i in range(40):  # one important request arrives every step
        engine.add_request([4, 5], p, request_id=f"high-{i}", priority=0)
        engine.step()
    low = engine.requests.get("low")
    if aging:
        assert low is None  # finished long before the stream ended
    else:
        assert low is not None and low.metrics.first_scheduled_time is None
        assert engine.scheduler.num_steps == 40


def test_low_priority_is_preempted_first(tiny):
    engine = LLMEngine(tiny, max_num_seqs=4, block_size=4, num_blocks=12)
    p = SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)
    ids = {prio: engine.add_request(_prompts(1, 8, 8, seed=prio)[0], p, priority=prio)
           for prio in (3, 0, 1)}
    preempted = []
    while engine.has_unfinished():
        engine.step()
        preempted += engine.last_step.preempted
    assert preempted and preempted[0] == ids[3]
    assert ids[0] not in preempted


def test_errors(tiny, tok):
    engine = LLMEngine(tiny, block_size=4, num_blocks=8)
    with pytest.raises(ValueError, match="context window"):
        engine.add_request([1] * 100, SamplingParams(max_new_tokens=30))
    with pytest.raises(ValueError, match="num_blocks=8"):
        engine.add_request([1] * 30, SamplingParams(max_new_tokens=4))  # 33 tokens > 32 slots
    assert engine.add_request([1] * 28, SamplingParams(max_new_tokens=5))  # 32 tokens: fits
    small_step = LLMEngine(tiny, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="max_num_batched_tokens=16"):
        small_step.add_request([1] * 10, SamplingParams(max_new_tokens=8))
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request("text without a tokenizer")
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.add_request([1, 2], {"temperature": 0})
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match="priority"):
        engine.add_request([1], priority=0.5)
    engine.add_request([1], request_id="x")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([1], request_id="x")
    with pytest.raises(ValueError, match="one prompt"):
        engine.add_request([[1, 2], [3]])
    for kwargs, word in (({"policy": "fifo"}, "policy"), ({"block_size": 0}, "block_size"),
                         ({"num_blocks": 0}, "num_blocks"), ({"max_num_seqs": 0}, "max_num_seqs"),
                         ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
                         ({"aging": -1}, "aging"), ({"device": "meta"}, "device")):
        with pytest.raises(ValueError, match=word):
            LLMEngine(tiny, **kwargs)
    with pytest.raises(ValueError, match="SamplingParams for"):
        LLMEngine(tiny).generate([[1], [2]], [GREEDY])


def test_top_level_names_load_lazily():
    import subprocess
    import sys

    code = ("import sys, minifer; assert 'minifer.engine.llm_engine' not in sys.modules; "
            "from minifer import LLMEngine, RequestOutput; "
            "assert LLMEngine.__module__ == 'minifer.engine.llm_engine'; "
            "assert 'LLMEngine' in minifer.__all__ and 'RequestOutput' in minifer.__all__")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    with pytest.raises(AttributeError, match="no attribute"):
        mf.NoSuchThing  # noqa: B018


@pytest.mark.parametrize("policy", ["static", "continuous"])
def test_static_groups_run_to_completion_and_continuous_refills(tiny, policy):
    """Two seats, a short and a long request first: with static batching the third request
    waits for the long one (BATCH-4); with continuous batching it takes the short one's seat at
    the next step (BATCH-5)."""
    engine = LLMEngine(tiny, policy=policy, max_num_seqs=2)
    short = SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True)
    long = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    engine.add_request([1, 2], short, request_id="short")
    engine.add_request([3, 4], long, request_id="long")
    engine.add_request([5, 6], short, request_id="third")
    first_step, finished_step, step = {}, {}, 0
    while engine.has_unfinished():
        step += 1
        outs = engine.step()
        for rid in [r for r, _ in engine.last_step.prefill] + engine.last_step.decode:
            first_step.setdefault(rid, step)
        finished_step.update({o.request_id: step for o in outs if o.finished})
    assert finished_step["short"] == 2 and finished_step["long"] == 12
    if policy == "static":
        assert first_step["third"] == 13
    else:
        assert first_step["third"] == 3


def test_seeded_sampling_survives_preemption(tiny, device):
    """A preempted request recomputes its tokens and keeps its generator: the same text."""
    tiny = on_device(tiny, device)
    params = SamplingParams(temperature=1.0, seed=7, max_new_tokens=30, ignore_eos=True)
    prompts = _prompts(8, 10, 30, seed=11)
    alone = [LLMEngine(tiny).generate([p], params)[0].token_ids for p in prompts]
    squeezed = LLMEngine(tiny, max_num_seqs=8, block_size=4, num_blocks=20)
    assert [o.token_ids for o in squeezed.generate(prompts, params)] == alone
    assert squeezed.scheduler.num_preemptions > 0


# ---- the Python API's refusals name the parameter (issue: raw errors deep inside) ----------
def test_python_api_refusals_name_the_parameter(tiny, tok):
    engine = LLMEngine(tiny, tok)
    for prompt in (torch.tensor(5), 5, torch.tensor([[1, 2]])):  # 0-d: not a one-token prompt
        with pytest.raises(ValueError, match="prompt must be text, a list of token ids or a 1-D"):
            engine.add_request(prompt)
    assert engine.add_request(torch.tensor([5, 6]))  # a 1-D tensor is one prompt
    for priority in (2**53 + 1, -(10**309)):  # would overflow Scheduler.rank's float arithmetic
        with pytest.raises(ValueError, match=r"priority must be an integer in \[-2\*\*53"):
            engine.add_request([1], priority=priority)
    assert engine.add_request([1], priority=2**53)  # the bound itself is fine
    with pytest.raises(TypeError, match="model must be a minifer GPT"):
        mf.generate(torch.nn.Linear(2, 2), ["hi"], tokenizer=tok)
    with pytest.raises(TypeError, match="model must be a minifer GPT"):
        LLMEngine(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="device='meta'"):
        mf.generate(tiny, ["hi"], SamplingParams(max_new_tokens=2), tok, device="meta")
    meta = mf.GPT.from_config("tiny").to("meta")
    with pytest.raises(ValueError, match="model is on the meta device"):
        LLMEngine(meta)
    with pytest.raises(ValueError, match="model is on the meta device"):
        mf.generate(meta, [[1, 2]], SamplingParams(max_new_tokens=2))
    for kw, word in (({"logprobs": 21}, "logprobs"), ({"logprobs": True}, "logprobs"),
                     ({"min_tokens": 17}, "min_tokens"), ({"min_tokens": -1}, "min_tokens")):
        with pytest.raises(ValueError, match=word):
            engine.add_request([1], SamplingParams(max_new_tokens=16), **kw)


def test_generated_ids_skip_the_ids_a_caller_chose(tiny):
    engine = LLMEngine(tiny)
    params = SamplingParams(temperature=0, max_new_tokens=2)
    assert engine.add_request([1], params, request_id="req-1") == "req-1"
    ids = [engine.add_request([2], params) for _ in range(3)]
    assert "req-1" not in ids and len(set(ids)) == 3
    taken = f"req-{int(ids[-1][4:]) + 1}"  # the id the engine would pick next
    assert engine.add_request([3], params, request_id=taken) == taken
    assert engine.add_request([4], params) != taken and len(engine.requests) == 6
    while engine.has_unfinished():
        engine.step()


def test_logprobs_are_the_models_own_log_softmax(tiny):
    """Each sampled token's logprob and its alternatives equal the log-softmax of the model's
    logits at that position (a full forward pass over prompt + output), whatever the sampling
    settings, batched with other requests."""
    engine = LLMEngine(tiny, max_num_seqs=4)
    prompts = [[5, 9, 13], [7] * 11, [100, 3]]
    plist = [SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0.8, top_k=5, seed=1, max_new_tokens=9, ignore_eos=True),
             SamplingParams(temperature=1.0, repetition_penalty=1.3, seed=2, max_new_tokens=7)]
    ids = [engine.add_request(p, sp, logprobs=k) for p, sp, k in zip(prompts, plist, (3, 0, 20))]
    engine.add_request([1, 2], GREEDY)  # a request without logprobs in the same batch
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    for rid, prompt, k in zip(ids, prompts, (3, 0, 20)):
        out = final[rid]
        assert len(out.logprobs) == len(out.token_ids)
        with torch.no_grad():
            logits = tiny(torch.tensor([prompt + out.token_ids[:-1]]))[0, len(prompt) - 1:]
        ref = torch.log_softmax(logits.float(), -1)
        for pos, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
            assert lp.token_id == tok
            assert lp.logprob == pytest.approx(ref[pos, tok].item(), abs=1e-4)
            assert len(lp.top) == k
            top = ref[pos].topk(k) if k else None
            if k:
                assert [t for t, _ in lp.top] == top.indices.tolist()
                assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert final[ids[0]].token_ids[0] == final[ids[0]].logprobs[0].top[0][0]  # greedy = top-1
    assert all(o.logprobs is None for rid, o in final.items() if rid not in ids)


def test_min_tokens_defers_the_end_of_sequence_and_stop_strings(make_scripted, tok):
    script = list(b"Hello world. Goodbye!") + [256]
    engine = LLMEngine(make_scripted(script), tok)

    def run(min_tokens, **kw):
        rid = engine.add_request("H", SamplingParams(temperature=0, max_new_tokens=40, **kw),
                                 min_tokens=min_tokens)
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == rid and out.finished:
                    return out

    plain = run(0)
    assert (plain.text, plain.finish_reason) == ("ello world. Goodbye!", "eos")
    longer = run(25)  # the script ends after 21 tokens: EOS is banned until 25
    assert len(longer.token_ids) >= 25 and 256 not in longer.token_ids[:25]
    assert longer.text.startswith("ello world. Goodbye!")
    stop = run(0, stop=". G")
    assert (stop.text, stop.finish_reason) == ("ello world", "stop")
    # "." is token 11: a stop string that starts after the first min_tokens tokens counts ...
    late = run(10, stop=". G")
    assert (late.text, late.finish_reason) == ("ello world", "stop")
    # ... one that starts within them does not (that text is already out, streamed or not)
    deferred = run(11, stop=". G")
    assert deferred.text == "ello world. Goodbye!" and deferred.finish_reason == "eos"


def test_the_pool_is_sized_from_a_memory_budget_and_max_model_len():
    """A checkpoint whose context is far longer than what a laptop can cache still gets an
    engine: `kv_cache_memory` bounds the pool, `max_model_len` the requests (issue 56)."""
    from minifer.engine.config import EngineConfig

    model = mf.GPT(mf.GPTConfig(vocab_size=257, context_length=131072, n_layer=2, n_head=4, n_embd=32,
                          n_kv_head=2, intermediate_size=64, positions="rope", norm="rms",
                          mlp="swiglu", bias=False)).eval()
    per_token = 2 * 2 * 2 * 8 * 4  # layers × (K, V) × kv heads × head dim × fp32 bytes
    engine = LLMEngine(model, max_num_seqs=4, kv_cache_memory=1 << 20)  # 1 MiB
    c = engine.config
    assert c.num_blocks * c.block_size == (1 << 20) // per_token // 16 * 16  # not 4 × 131072
    assert engine.pool.nbytes <= 1 << 20
    with pytest.raises(ValueError, match="max_model_len"):  # longer than the pool holds
        engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=(1 << 20) // per_token))
    short = LLMEngine(model, max_num_seqs=4, max_model_len=512, kv_cache_memory=1 << 20)
    assert short.config.num_blocks == 4 * 512 // 16 and short.config.max_model_len == 512
    with pytest.raises(ValueError, match=r"max_model_len.*512"):
        short.add_request([1] * 500, SamplingParams(max_new_tokens=20))
    with pytest.raises(ValueError, match="kv_cache_memory.*--kv-cache-memory.*--max-model-len"):
        LLMEngine(model, max_model_len=100_000, kv_cache_memory=1 << 20)
    for bad in (0, -1, 1.5, "1GB"):
        with pytest.raises((ValueError, TypeError), match="kv_cache_memory"):
            EngineConfig(kv_cache_memory=bad).resolved(model)
    with pytest.raises(ValueError, match="max_model_len"):
        EngineConfig(max_model_len=200_000).resolved(model)
