"""Engine replicas (`EngineReplicas`, ``--engine-replicas N``): the seats and the pool split
without losing any, every replica serving, the same greedy streams as one engine, the server's
limits over all replicas, aborts reaching the replica that holds the request, and clear errors
for splits that cannot work."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from process_double import FileSteeredGPT
from test_serve_engine_process import _metric

import minifer as mf
from conftest import engine_reading, lively_model
from minifer.distributed.replicas import EngineReplicas, replica_options, split
from minifer.engine.errors import APIError
from minifer.engine.llm_engine import LLMEngine
from minifer_course.server import running_server

PROMPTS = ["Hello", "To be, or not", "a", "The quick brown fox", "0123456789", "zz top",
           "One more", "and the last"]


@pytest.fixture(scope="module")
def model():
    return lively_model("tiny")


def test_shares_add_up_and_bad_splits_are_refused():
    assert split(32, 2) == [16, 16] and split(7, 3) == [3, 2, 2] and split(5, 1) == [5]
    opts = dict(max_num_seqs=5, num_blocks=40, block_size=16, policy="continuous")
    shares = replica_options(opts, 2, blocks_needed=8)
    assert [s["max_num_seqs"] for s in shares] == [3, 2]
    assert [s["num_blocks"] for s in shares] == [20, 20]
    assert all(s["policy"] == "continuous" and s["block_size"] == 16 for s in shares)
    with pytest.raises(ValueError, match="replicas must be at most max_num_seqs"):
        replica_options(opts, 6, blocks_needed=1)
    with pytest.raises(ValueError, match="fewer than the 30 the longest request needs"):
        replica_options(opts, 2, blocks_needed=30)
    with pytest.raises(ValueError, match="replicas"):
        replica_options(opts, 0, blocks_needed=1)


def test_auto_threads_share_the_cores_between_replicas(model, monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    engine = LLMEngine(model, mf.ByteTokenizer(), max_num_seqs=4)
    reps = EngineReplicas(engine, 2, threads="auto")
    assert reps.replica_threads == 4 and [c.threads for c in reps.children] == [4, 4]
    assert reps.threads == "auto"  # a fallback to one engine process still follows the cores
    assert EngineReplicas(engine, 3, threads="auto").replica_threads == 2
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert EngineReplicas(engine, 4, threads="auto").replica_threads == 1
    assert EngineReplicas(engine, 2, threads=3).replica_threads == 3  # a number stays as given


def test_replicas_need_an_engine_with_options_and_processes(model):
    with pytest.raises(TypeError, match="has none"):
        EngineReplicas(object(), 2)
    with pytest.raises(ValueError, match="engine_in='process'"):
        with running_server(model, mf.ByteTokenizer(), model_name="tiny", max_num_seqs=4,
                            engine_in="thread", replicas=2):
            pass


def _stream(url: str, prompt: str) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0,
            "stream": True, "ignore_eos": True}
    text = ""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def _all_streams(url: str) -> list[str]:
    async def everyone():
        return await asyncio.gather(*(asyncio.to_thread(_stream, url, p) for p in PROMPTS))

    return asyncio.run(everyone())


def test_two_replicas_stream_what_one_engine_streams_and_share_the_work(model):
    tok = mf.ByteTokenizer()
    alone = [c.text for c in mf.generate(model, PROMPTS, mf.SamplingParams(
        temperature=0, max_new_tokens=10, ignore_eos=True), tok)]
    engine = engine_reading("kernel", model, tok, max_num_seqs=4)
    with running_server(engine=engine, model_name="tiny", engine_in="process",
                        replicas=2) as url:
        for _ in range(3):  # the first round warms both replicas up
            assert _all_streams(url) == alone
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _metric(url, "minifer_kv_blocks_used"):
            time.sleep(0.05)
        assert _metric(url, "minifer_kv_blocks_used") == 0
        assert _metric(url, "minifer_kv_blocks_total") == engine.block_manager.num_blocks


def test_limits_hold_over_all_replicas_and_aborts_reach_their_replica(model, tmp_path):
    gate = tmp_path / "gate"
    steered = FileSteeredGPT.like(model, str(gate), str(tmp_path / "fail"))
    reps = EngineReplicas(LLMEngine(steered, mf.ByteTokenizer(), max_num_seqs=2), 2,
                          max_waiting=3)
    reps.start()
    try:
        assert reps.alive and len(reps.threads_in_force) == 2
        assert reps.stats["blocks_used"] == 0 and reps.stats["blocks_total"] == 128 * 2 // 16
        params = mf.SamplingParams(temperature=0, max_new_tokens=100, ignore_eos=True)

        async def scenario():
            gate.touch()  # every forward call waits: no request gets its first token
            queued = [asyncio.create_task(reps.add([1, 2, 3], params)) for _ in range(3)]
            await asyncio.sleep(0.5)
            assert reps.num_waiting == 3
            assert sorted(c.num_in_flight for c in reps.children) == [1, 2]  # least loaded
            with pytest.raises(APIError) as err:  # max_waiting counts every replica's
                await reps.add([1, 2, 3], params)
            assert err.value.status == 429
            gate.unlink()
            handles = await asyncio.gather(*queued)
            for h in handles:
                reps.abort(h.request_id)  # each abort goes to the replica holding it
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and (reps.stats["blocks_used"]
                                                   or sum(c.num_in_flight
                                                          for c in reps.children)):
                await asyncio.sleep(0.05)
            assert reps.stats["blocks_used"] == 0 and reps.stats["running"] == 0
            assert {h.request_id.split("-")[1] for h in handles} == {"r0", "r1"}

        asyncio.run(scenario())
    finally:
        reps.stop()
    assert not reps.alive


def _health(url: str) -> dict:
    r = httpx.get(f"{url}/health", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_killed_replica_leaves_the_routing_at_once_and_is_restarted(model):
    """kill -9 of one replica: every request goes to the other at once (it got 503s when the
    dead one had the fewest in flight), /health and the metrics say 1 of 2 replicas with the
    dead one's gauges gone, and the replica is started again in the background."""
    import multiprocessing
    import os
    import signal

    engine = LLMEngine(model, mf.ByteTokenizer(), max_num_seqs=4)
    with running_server(engine=engine, model_name="tiny", engine_in="process",
                        replicas=2) as url:
        assert _health(url) == {"status": "ok", "replicas": 2, "replicas_alive": 2}
        total = _metric(url, "minifer_kv_blocks_total")
        procs = [p for p in multiprocessing.active_children() if p.name == "minifer-engine"]
        assert len(procs) == 2
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].join(10)
        health = _health(url)  # before the restart (a new process takes seconds to start)
        assert health == {"status": "degraded", "replicas": 2, "replicas_alive": 1}
        assert _metric(url, "minifer_engine_replicas_alive") == 1
        assert _metric(url, "minifer_kv_blocks_total") == total // 2  # its gauges left
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        for _ in range(10):  # sequentially: the dead replica has the fewest in flight
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
        assert all(_all_streams(url))  # concurrently
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and _health(url)["status"] != "ok":
            time.sleep(0.2)
        assert _health(url) == {"status": "ok", "replicas": 2, "replicas_alive": 2}
        assert _metric(url, "minifer_engine_replica_restarts") == 1
        assert _metric(url, "minifer_kv_blocks_total") == total
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
