"""The server with its engine in a process of its own (`EngineProcess`, ``--engine-in
process``): the same answers as the engine in a thread, the same limits and errors, nothing
left in flight after aborts, a clear error when the process cannot start, and 503s (not a hang)
when it dies."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
from process_double import FileSteeredGPT, GatedTokenizer

import minifer as mf
from conftest import lively_model
from minifer.distributed.engine_process import EngineProcess
from minifer.engine.errors import APIError
from minifer.engine.llm_engine import LLMEngine
from minifer.sampling import SamplingParams
from minifer.serve.api import create_app
from minifer_course.server import running_server

PROMPTS = ["Hello", "To be, or not", "a", "The quick brown fox", "0123456789", "zz top"]


@pytest.fixture(scope="module")
def model():
    return lively_model("tiny")


def _stream(url: str, prompt: str, **extra) -> tuple[str, dict | None]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0,
            "stream": True, "ignore_eos": True, **extra}
    text, first = "", None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                first = first or choice
                text += choice["text"]
    return text, first


def _all_streams(url: str) -> list:
    async def one(prompt):
        return await asyncio.to_thread(_stream, url, prompt)

    async def everyone():
        return await asyncio.gather(*(one(p) for p in PROMPTS))

    return asyncio.run(everyone())


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def _until_idle(url: str) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (_metric(url, "minifer_kv_blocks_used")
                                           or _metric(url, "minifer_num_requests_running")):
        time.sleep(0.05)
    assert _metric(url, "minifer_kv_blocks_used") == 0
    assert _metric(url, "minifer_num_requests_running") == 0


def test_the_engine_in_a_process_streams_what_the_engine_in_a_thread_streams(model):
    tok = mf.ByteTokenizer()
    seen = {}
    for where in ("thread", "process"):
        with running_server(model, tok, model_name="tiny", max_num_seqs=4,
                            engine_in=where) as url:  # the pool read by the paged kernel
            seen[where] = _all_streams(url)
            seen[where].append(_stream(url, "Echo me", echo=True, logprobs=2))
            _until_idle(url)
    assert seen["process"] == seen["thread"]
    texts = [text for text, _ in seen["process"]]
    assert len(set(texts)) > 3 and all(len(t) > 0 for t in texts)  # varied, not trivial
    assert seen["process"][-1][1]["logprobs"]["tokens"][:2] == ["E", "c"]  # the prompt, scored


def test_limits_timeouts_aborts_and_a_failed_step_are_contained(model, tmp_path):
    gate, fail = tmp_path / "gate", tmp_path / "fail"
    steered = FileSteeredGPT.like(model, str(gate), str(fail))
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0}
    gate.touch()  # every forward call waits: the engine is stuck in its step
    with running_server(steered, mf.ByteTokenizer(), model_name="tiny", max_num_seqs=2,
                        max_waiting=2, request_timeout_s=1.0, engine_in="process") as url:
        async def scenario():
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                first = [asyncio.create_task(http.post("/v1/completions", json=body))
                         for _ in range(2)]
                await asyncio.sleep(0.5)
                third = await http.post("/v1/completions", json=body)
                return third, await asyncio.gather(*first)

        third, first = asyncio.run(scenario())
        assert third.status_code == 429 and third.json()["error"]["code"] == "queue_full"
        assert [r.status_code for r in first] == [408, 408]
        gate.unlink()
        _until_idle(url)  # the aborts reached the engine process and freed the blocks
        fail.touch()  # the next step raises there: its request gets a 500, the engine lives on
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
        assert "injected failure" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        r = httpx.post(f"{url}/v1/completions", json={**body, "prompt": "x" * 5000}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert httpx.get(f"{url}/health").status_code == 200
        _until_idle(url)


def test_an_abort_frees_the_request_in_the_engine_process(model):
    engine = LLMEngine(model, mf.ByteTokenizer(), max_num_seqs=2)
    loop_engine = EngineProcess(engine)
    loop_engine.start()
    try:
        async def scenario():
            params = SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True)
            handle = await loop_engine.add(list(b"Hello"), params)
            assert len((await handle.next(30)).token_ids) == 1
            await handle.next(30)
            loop_engine.abort(handle.request_id)

        asyncio.run(scenario())
        deadline = time.monotonic() + 10
        while loop_engine.stats.get("blocks_used") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert loop_engine.stats["blocks_used"] == 0 and loop_engine.stats["running"] == 0
        assert loop_engine.num_waiting == 0 and loop_engine.alive
    finally:
        loop_engine.stop()
    assert not loop_engine.alive


def test_a_dead_engine_process_fails_requests_with_503_and_health_says_so(model, tmp_path):
    gate = tmp_path / "gate"
    steered = FileSteeredGPT.like(model, str(gate), str(tmp_path / "never"))
    loop_engine = EngineProcess(LLMEngine(steered, mf.ByteTokenizer()))
    loop_engine.start()
    try:
        async def scenario():
            gate.touch()
            handle = await loop_engine.add(list(b"Hi"), SamplingParams(max_new_tokens=4))
            loop_engine._process.kill()
            with pytest.raises(APIError) as err:
                await handle.next(30)
            assert err.value.status == 503 and err.value.code == "engine_stopped"
            time.sleep(0.2)
            assert not loop_engine.alive
            with pytest.raises(APIError) as err:
                await loop_engine.add(list(b"Hi"), SamplingParams(max_new_tokens=4))
            assert err.value.status == 503

        asyncio.run(scenario())
    finally:
        loop_engine.stop()


class _Unrebuildable(LLMEngine):
    """An engine whose options cannot build another: its engine process fails to start."""

    @property
    def options(self) -> dict:
        return {**super().options, "block_size": 0}


def test_an_engine_process_that_cannot_start_says_why(model):
    from types import SimpleNamespace

    with pytest.raises(RuntimeError, match="failed to start: ValueError: block_size"):
        EngineProcess(_Unrebuildable(model, mf.ByteTokenizer()), start_timeout_s=120).start()
    stand_in = SimpleNamespace(model=model, tokenizer=None)  # nothing to rebuild it from
    with pytest.raises(RuntimeError, match="has no `options` to rebuild it"):
        EngineProcess(stand_in).start()


def test_engine_in_is_checked_and_on_the_command_line(model):
    from minifer.serve.__main__ import build_parser, server_options

    with pytest.raises(ValueError, match="engine_in must be one of"):
        create_app(LLMEngine(model, mf.ByteTokenizer()), engine_in="fork")
    args = build_parser().parse_args(["--engine-in", "process"])
    assert server_options(args)["engine_in"] == "process"
    assert server_options(build_parser().parse_args([]))["engine_in"] == "process"


def test_a_server_whose_engine_process_cannot_start_steps_in_a_thread(model, caplog):
    engine = _Unrebuildable(model, mf.ByteTokenizer())  # the process fails; this one works
    with caplog.at_level("WARNING", logger="minifer.serve"), \
            running_server(engine=engine, model_name="tiny", engine_in="process") as url:
        text, _ = _stream(url, "Hello")
        assert httpx.get(f"{url}/health").status_code == 200
        _until_idle(url)
    assert any("failed to start: ValueError: block_size" in r.getMessage()
               and "in a thread" in r.getMessage() for r in caplog.records)
    with running_server(engine=LLMEngine(model, mf.ByteTokenizer()), model_name="tiny",
                        engine_in="thread") as url:
        assert _stream(url, "Hello")[0] == text


def test_a_killed_engine_process_is_restarted_like_a_replica(model, tmp_path):
    """kill -9 of the server's one engine process: the request in flight ends with a 503 naming
    it, /health answers 503 while it restarts (not 200 over a dead engine) and new requests get
    a 503 saying to retry, and within seconds completions succeed again."""
    import multiprocessing
    import os
    import signal

    gate = tmp_path / "gate"
    steered = FileSteeredGPT.like(model, str(gate), str(tmp_path / "never"))
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    with running_server(steered, mf.ByteTokenizer(), model_name="tiny", max_num_seqs=2,
                        engine_in="process") as url:
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
        [proc] = [p for p in multiprocessing.active_children() if p.name == "minifer-engine"]

        async def killed_in_flight():
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                gate.touch()  # the engine's step waits: the request stays in flight
                task = asyncio.create_task(http.post("/v1/completions", json=body))
                await asyncio.sleep(0.5)
                os.kill(proc.pid, signal.SIGKILL)
                return await task

        r = asyncio.run(killed_in_flight())
        gate.unlink()
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stopped"
        assert "engine process" in r.json()["error"]["message"]
        assert httpx.get(f"{url}/health").status_code == 503  # before the restart (seconds)
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 503 and "restarted within seconds" in r.json()["error"]["message"]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and httpx.get(f"{url}/health").status_code != 200:
            time.sleep(0.2)
        assert httpx.get(f"{url}/health").json()["status"] == "ok"
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert _metric(url, "minifer_engine_replica_restarts") == 1


def test_health_is_503_until_the_engine_process_has_said_ready(model, tmp_path):
    """Before the app's lifespan starts the engine, and while its process runs but has not built
    its engine and said "ready" (here: held at `GatedTokenizer`'s gate), /health is a 503 with
    the error body (HEAD too); 200 once it has."""
    from starlette.testclient import TestClient

    gate = tmp_path / "gate"
    gate.touch()
    app = create_app(LLMEngine(model, GatedTokenizer(str(gate)), max_num_seqs=2),
                     model_name="tiny", engine_in="process", allowed_hosts=None)
    replicas = app.state.server.async_engine
    client = TestClient(app)  # not `with`: no lifespan, nothing started by the client

    def not_ready() -> None:
        r = client.get("/health")
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "server_error"
        assert client.head("/health").status_code == 503

    not_ready()
    starting = threading.Thread(target=replicas.start)  # what the lifespan does
    starting.start()
    try:
        [child] = replicas.children
        deadline = time.monotonic() + 20
        while child._process is None or not child._process.is_alive():
            assert time.monotonic() < deadline, "the engine process did not start"
            time.sleep(0.01)
        time.sleep(0.5)  # it runs: unpickling its arguments, held at the gate
        assert child._process.is_alive() and starting.is_alive()
        not_ready()
        gate.unlink()
        starting.join(120)
        assert not starting.is_alive() and replicas.children == [child]  # no fallback
        assert client.get("/health").json() == {"status": "ok", "replicas": 1, "replicas_alive": 1}
        assert client.head("/health").status_code == 200
    finally:
        gate.unlink(missing_ok=True)
        starting.join(120)
        replicas.stop()


def test_the_server_answers_no_health_check_before_the_engine_process_is_ready(model, tmp_path):
    """uvicorn runs the lifespan (`EngineReplicas.start`, which waits for the engine process's
    "ready") before it listens: while the engine process starts, a health check finds no
    server (connection refused), never a 200; once it is ready, 200."""
    gate = tmp_path / "gate"
    gate.touch()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url, seen, served = f"http://127.0.0.1:{port}", [], threading.Event()

    def serve() -> None:
        with running_server(model, GatedTokenizer(str(gate)), model_name="tiny", port=port,
                            max_num_seqs=2, engine_in="process", startup_timeout_s=120):
            served.set()
            gate.touch()  # (re-made only to hold the server open until the test is done)
            while gate.exists():
                time.sleep(0.05)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3:  # the engine process is held at the gate
            try:
                seen.append(httpx.get(f"{url}/health", timeout=5).status_code)
            except httpx.TransportError as err:
                seen.append(type(err).__name__)
            time.sleep(0.05)
        assert not served.is_set() and 200 not in seen, seen
        assert set(seen) == {"ConnectError"}, seen  # not listening yet
        gate.unlink()
        assert served.wait(120)
        r = httpx.get(f"{url}/health", timeout=10)
        assert r.status_code == 200 and r.json()["status"] == "ok"
    finally:
        gate.unlink(missing_ok=True)
        server.join(60)
