"""The OpenAI-compatible server, end to end over loopback (127.0.0.1 only).

The official `openai` client and raw HTTP talk to a real uvicorn server in a background thread
(`running_server`), serving the real `LLMEngine` and a stand-in with the same interface
(`serve_double`). Greedy answers must equal `minifer.generate` of the prompt alone, whatever
else the server is doing; every refusal is an OpenAI-style error naming the parameter; the
engine ends every test with no request in flight and no KV block held.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import httpx
import pytest
import torch
from serve_double import Slow, StandInEngine

import minifer as mf
from conftest import lively_model, scripted_gpt
from minifer.serve.protocol import APIError, CompletionBody, Limits, parse_completion_request
from minifer_course.server import running_server

openai = pytest.importorskip("openai")

try:
    from minifer.engine.llm_engine import LLMEngine
except ImportError:  # the serving engine is not on this branch yet
    LLMEngine = None

ENGINES = [
    pytest.param("engine", marks=pytest.mark.skipif(LLMEngine is None, reason="no LLMEngine")),
    "stand-in",
]
SCRIPT = "Hello world. Goodbye, world!"


def make_engine(kind: str, model, tok, **kw):
    if kind == "engine":
        return LLMEngine(model, tok, **kw)
    return StandInEngine(model, tok, **kw)


def assert_idle(engine) -> None:
    """Nothing in flight and every KV block free: no leak after aborts, timeouts, errors."""
    deadline = time.monotonic() + 10
    while engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.01)  # the engine thread applies aborts at its next iteration
    assert not engine.has_unfinished()
    bm = engine.block_manager
    assert bm.num_used_blocks == 0
    if hasattr(bm, "check"):
        bm.check()


def client(url: str):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def alone(model, tok, prompt, **params) -> mf.Completion:
    [c] = mf.generate(model, [prompt], mf.SamplingParams(**params), tok)
    return c


@pytest.fixture(scope="module")
def tiny_model():
    return lively_model("tiny")


@pytest.fixture(scope="module", params=ENGINES)
def served(request, tiny_model):
    """A server on the lively tiny model: (url, engine, model, tokenizer)."""
    tok = mf.ByteTokenizer()
    engine = make_engine(request.param, tiny_model, tok, max_num_seqs=8)
    with running_server(engine=engine, model_name="tiny") as url:
        yield url, engine, tiny_model, tok


@pytest.fixture(scope="module", params=ENGINES)
def scripted(request):
    """A server on a model that recites SCRIPT then its end-of-sequence token."""
    tok = mf.ByteTokenizer()
    model = scripted_gpt(tok.encode(SCRIPT) + [256])
    engine = make_engine(request.param, model, tok, max_num_seqs=4)
    with running_server(engine=engine, model_name="scripted") as url:
        yield url, engine


# ---- the openai client ---------------------------------------------------------------------
def test_completion_equals_generate_alone(served):
    url, engine, model, tok = served
    r = client(url).completions.create(model="tiny", prompt="Hello there", max_tokens=24,
                                       temperature=0)
    ref = alone(model, tok, "Hello there", temperature=0, max_new_tokens=24)
    assert r.object == "text_completion" and r.model == "tiny" and r.id.startswith("cmpl-")
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == {"eos": "stop", "stop": "stop"}.get(
        ref.finish_reason, ref.finish_reason)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (ref.prompt_tokens,
                                                                  ref.completion_tokens)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert_idle(engine)


def test_stream_deltas_concatenate_to_the_whole_answer(served):
    url, engine, _, _ = served
    c = client(url)
    kw = dict(model="tiny", prompt=[72, 105, 33], max_tokens=30, temperature=0)
    whole = c.completions.create(**kw)
    chunks = list(c.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    token_chunks = [ch for ch in chunks if ch.choices]
    assert "".join(ch.choices[0].text for ch in token_chunks) == whole.choices[0].text
    assert len(token_chunks) == whole.usage.completion_tokens  # one event per token
    assert all(ch.choices[0].finish_reason is None for ch in token_chunks[:-1])
    assert token_chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage  # usage comes last
    assert all(ch.usage is None for ch in chunks[:-1])
    assert_idle(engine)


def test_seed_makes_sampling_reproducible(served):
    url, engine, model, tok = served
    c = client(url)
    kw = dict(model="tiny", prompt="Once", max_tokens=20, temperature=1.0, top_p=0.9)
    a, b = (c.completions.create(**kw, seed=7).choices[0].text for _ in range(2))
    other = c.completions.create(**kw, seed=8).choices[0].text
    assert a == b == alone(model, tok, "Once", temperature=1.0, top_p=0.9, max_new_tokens=20,
                           seed=7).text
    assert other != a
    assert_idle(engine)


def test_stop_strings_and_finish_reasons(scripted):
    url, engine = scripted
    c = client(url)
    r = c.completions.create(model="scripted", prompt="Hello", max_tokens=40, temperature=0,
                             stop=[". G"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (" world", "stop")
    streamed = list(c.completions.create(model="scripted", prompt="Hello", max_tokens=40,
                                         temperature=0, stop=[". G"], stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == " world"  # ". G" never shown
    r = c.completions.create(model="scripted", prompt="Hello", max_tokens=40, temperature=0)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (SCRIPT[5:], "stop")  # eos
    r = c.completions.create(model="scripted", prompt="Hello", max_tokens=6, temperature=0)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (" world", "length")
    assert r.usage.completion_tokens == 6
    assert_idle(engine)


def test_models_health_and_metrics(served):
    url, engine, _, _ = served
    models = client(url).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    client(url).completions.create(model="tiny", prompt="Hi", max_tokens=3, temperature=0)
    text = httpx.get(f"{url}/metrics").text
    for name in ("minifer_num_requests_running", "minifer_num_requests_waiting",
                 "minifer_kv_blocks_used", "minifer_time_to_first_token_seconds_bucket",
                 "minifer_time_per_output_token_seconds_bucket",
                 "minifer_e2e_request_latency_seconds_count",
                 'minifer_request_success_total{finish_reason="length"}'):
        assert name in text, name
    if LLMEngine is not None and isinstance(engine, LLMEngine):
        assert "minifer_prefix_cache_hit_rate" in text


@pytest.mark.skipif(LLMEngine is None, reason="no LLMEngine")
def test_metrics_read_the_engines_queues_and_prefix_cache(tiny_model):
    tok = mf.ByteTokenizer()
    engine = LLMEngine(tiny_model, tok, max_num_seqs=4, block_size=8, enable_prefix_caching=True)
    prompt = "To be, or not to be, that is the question: whether 'tis nobler"  # 8 full blocks
    with running_server(engine=engine, model_name="tiny") as url:
        for _ in range(2):  # the second finds the first's full prompt blocks in the cache
            client(url).completions.create(model="tiny", prompt=prompt, max_tokens=2,
                                           temperature=0)
        lines = dict(line.rsplit(" ", 1) for line in httpx.get(f"{url}/metrics").text.splitlines()
                     if line and not line.startswith("#"))
    assert float(lines["minifer_prefix_cache_hit_rate"]) == pytest.approx(
        engine.block_manager.hit_rate) and engine.block_manager.hit_rate > 0.4
    assert float(lines["minifer_kv_blocks_total"]) == engine.block_manager.num_blocks
    assert float(lines["minifer_kv_blocks_used"]) == 0  # finished: blocks free (some cached)
    assert float(lines["minifer_num_requests_running"]) == 0
    assert float(lines["minifer_time_to_first_token_seconds_count"]) == 2


# ---- bad input -----------------------------------------------------------------------------
BAD = [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),  # only with echo
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -3}, "top_k"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x" * 300}, "prompt"),  # past the 128-token context
    ({"prompt": "x" * 100, "max_tokens": 40}, "prompt"),  # 100 + 40 - 1 > 128
    ({"prompt": ""}, "prompt"),
    ({"prompt": [1, 2, 999]}, "prompt"),  # outside the vocabulary
    ({"prompt": ["a"] * 129}, "prompt"),  # at most 128 prompts per request
    ({"prompt": ["a", "x" * 300]}, "prompt[1]"),  # which of the prompts is too long
    ({"model": "gpt-4"}, "model"),
    ({"model": None}, "model"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"seed": 1.5}, "seed"),
    ({"seed": 2**70}, "seed"),  # more than a random generator takes
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({"seed": -1}, "seed"),  # SamplingParams takes [0, 2**64): was a 500
    ({"n": 2}, "n"),
    ({"best_of": 3}, "best_of"),
    ({"suffix": "x"}, "suffix"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"echo": "yes"}, "echo"),
    ({"min_tokens": 5}, "min_tokens"),  # more than max_tokens=4
    ({"logit_bias": {"999": 1}}, "logit_bias"),  # outside the vocabulary
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"a": 1}}, "logit_bias"),
    ({"priority": 1}, "priority"),  # this server schedules first come, first served
    ({"repetition_penalty": 10**400}, "repetition_penalty"),  # was a 500 (float overflow)
    ({"temperature": True}, "temperature"),
    ({"max_tokens": 4.5}, "max_tokens"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
    ({"stream": True, "stream_options": {"x": 1}}, "stream_options.x"),
    ({"frobnicate": 1}, "frobnicate"),
]


@pytest.mark.parametrize("change,param", BAD, ids=[p for _, p in BAD])
def test_bad_requests_get_400_naming_the_parameter(served, change, param):
    url, engine, _, _ = served
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, **change}
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(f"{url}/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"


def test_malformed_json_and_the_server_keeps_serving(served):
    url, engine, model, tok = served
    for raw in (b"{not json", b"\xff\xfe", b"[1, 2]", b"", b"[" * 100_000 + b"]" * 100_000):
        r = httpx.post(f"{url}/v1/completions", content=raw,
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 400, raw
        assert r.json()["error"]["type"] == "invalid_request_error"
    huge = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x" * 2_000_000})
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "body_too_large"
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client(url).completions.create(model="tiny", prompt="Hi", max_tokens=-5)
    r = client(url).completions.create(model="tiny", prompt="Hi", max_tokens=5, temperature=0)
    assert r.choices[0].text == alone(model, tok, "Hi", temperature=0, max_new_tokens=5).text
    assert httpx.get(f"{url}/nowhere").json()["error"]["message"]  # 404s are OpenAI-shaped too
    assert_idle(engine)


def test_protocol_limits_without_http():
    limits = Limits(max_model_len=64, max_tokens=8)
    tok = mf.ByteTokenizer()
    body = {"model": "m", "prompt": "hi", "max_tokens": 8, "stop": "x", "top_k": -1,
            "priority": 2}
    ok = parse_completion_request(body, model_name="m", limits=limits, tokenizer=tok,
                                  vocab_size=257, priorities=True)
    assert ok.prompt_ids == [104, 105] and ok.params.max_new_tokens == 8 and ok.priority == 2
    assert ok.params.stop == ("x",) and ok.params.top_k == 0
    with pytest.raises(APIError, match="--scheduling-policy priority"):
        parse_completion_request(body, model_name="m", limits=limits, tokenizer=tok,
                                 vocab_size=257)
    with pytest.raises(APIError, match=r"max_tokens: must be an integer in \[1, 8\]"):
        parse_completion_request({"model": "m", "prompt": "hi", "max_tokens": 9},
                                 model_name="m", limits=limits, tokenizer=tok, vocab_size=257)
    with pytest.raises(APIError, match="not valid Unicode text"):  # the engine's own check
        parse_completion_request(CompletionBody.model_construct(model="m", prompt="\ud800"),
                                 model_name="m", limits=limits, tokenizer=tok, vocab_size=257)


# ---- limits under load: gated engines make the timing deterministic ---------------------------
class Gated:
    """An engine whose `step()` waits until the test opens the gate (or fails once on demand)."""

    def __init__(self, engine) -> None:
        self.inner, self.gate, self.fail_next = engine, threading.Event(), False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def step(self):
        self.gate.wait(30)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected failure")
        return self.inner.step()


@pytest.mark.parametrize("kind", ENGINES)
def test_full_queue_gets_429_timeouts_abort_and_errors_are_contained(kind, tiny_model):
    tok = mf.ByteTokenizer()
    engine = Gated(make_engine(kind, tiny_model, tok, max_num_seqs=2))
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0}
    with running_server(engine=engine, model_name="tiny", max_waiting=2,
                        request_timeout_s=1.0) as url:
        async def scenario():
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                first = [asyncio.create_task(http.post("/v1/completions", json=body))
                         for _ in range(2)]
                await asyncio.sleep(0.3)  # both are queued; the engine is stuck in step()
                third = await http.post("/v1/completions", json=body)
                return third, await asyncio.gather(*first)

        third, first = asyncio.run(scenario())
        assert third.status_code == 429 and third.headers["retry-after"] == "1"
        assert third.json()["error"]["code"] == "queue_full"
        assert "max_waiting=2" in third.json()["error"]["message"]
        # the two queued requests ran past the 1 s timeout while the gate was shut
        assert [r.status_code for r in first] == [408, 408]
        assert "timeout" in first[0].json()["error"]["message"]
        engine.gate.set()
        assert_idle(engine)  # their aborts freed everything
        engine.fail_next = True  # one step raises: its requests get a 500, the server lives on
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        assert httpx.get(f"{url}/health").status_code == 200
        assert_idle(engine)


@pytest.mark.parametrize("kind", ENGINES)
def test_client_disconnect_aborts_its_request(kind, tiny_model):
    tok = mf.ByteTokenizer()
    engine = Slow(make_engine(kind, tiny_model, tok, max_num_seqs=2), delay=0.02)
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 100, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with running_server(engine=engine, model_name="tiny") as url:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
            got = 0
            for line in r.iter_lines():
                got += line.startswith("data:")
                if got == 3:
                    break  # leave after 3 of 100 tokens (~2 s of work left)
        assert_idle(engine)
        text = httpx.get(f"{url}/metrics").text
        assert "minifer_request_aborted_total 1.0" in text


# ---- many clients at once ------------------------------------------------------------------
@pytest.mark.parametrize("kind", ENGINES)
def test_many_concurrent_streams_with_aborts(kind, tiny_model):
    """Dozens of streaming clients at once, a quarter of them leaving early: everyone else gets
    exactly the tokens they would get alone, and the engine ends with every block free."""
    tok = mf.ByteTokenizer()
    rng = random.Random(0)
    words = SCRIPT.split() + ["thee", "thou", "art", "ROMEO:", "JULIET:", "\n"]
    jobs = []
    for _ in range(40):
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
        jobs.append((prompt, rng.randint(1, 40), rng.random() < 0.25))
    kw = {"max_num_seqs": 8}
    if kind == "engine":
        kw.update(num_blocks=40, block_size=8)  # tight: preemption happens
    engine = make_engine(kind, tiny_model, tok, **kw)

    async def one(http, prompt, max_tokens, leave):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        text, usage, n = "", None, 0
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    text += chunk["choices"][0]["text"]
                    n += 1
                    if leave and n == 2:
                        return None
                else:
                    usage = chunk["usage"]
        return text, usage

    async def run_all(url):
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
            return await asyncio.gather(*(one(http, *job) for job in jobs))

    with running_server(engine=engine, model_name="tiny", max_waiting=64) as url:
        results = asyncio.run(run_all(url))
        assert_idle(engine)
    checked = 0
    for (prompt, max_tokens, leave), res in zip(jobs, results):
        if leave and res is None:
            continue
        ref = alone(tiny_model, tok, prompt, temperature=0, max_new_tokens=max_tokens)
        text, usage = res
        assert text == ref.text, prompt
        assert usage["completion_tokens"] == ref.completion_tokens
        checked += 1
    assert checked >= 25
    if kind == "engine":
        assert engine.scheduler.num_preemptions > 0  # the pool really was tight


def test_running_server_stops_even_when_the_block_raises(tiny_model):
    tok = mf.ByteTokenizer()
    engine = StandInEngine(tiny_model, tok)
    before = set(threading.enumerate())
    with pytest.raises(KeyError):
        with running_server(engine=engine, model_name="tiny") as url:
            assert httpx.get(f"{url}/health").status_code == 200
            raise KeyError("boom")
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=2)
    assert url.startswith("http://127.0.0.1:")
    assert not set(threading.enumerate()) - before  # its HTTP and engine threads are gone


def test_no_module_imports_the_web_stack_at_import_time():
    """`import minifer` (and every engine module) must work without the serve extra: FastAPI,
    uvicorn, prometheus_client and httpx are imported inside the functions that need them.
    `serve/routes.py` is the web layer itself: only `create_app` imports it, inside."""
    import ast
    import pathlib

    web = {"fastapi", "uvicorn", "prometheus_client", "starlette", "httpx", "openai"}
    package = pathlib.Path(mf.__file__).parent
    bad = []
    for path in package.rglob("*.py"):
        if path.parts[-2] == "lessons":  # lessons may import what notebooks have
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        web_layer = path.relative_to(package).as_posix() == "serve/routes.py"
        for node in tree.body:  # module level only
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if isinstance(node, ast.ImportFrom) and any(a.name == "routes" for a in node.names):
                names.append("routes")  # `from . import routes` at module level
            bad += [f"{path.relative_to(package)}: {n}" for n in names
                    if (n.split(".")[0] in web and not web_layer) or n.endswith("routes")]
    assert not bad, bad


torch.set_num_threads(1)
