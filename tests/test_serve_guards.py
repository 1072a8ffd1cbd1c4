"""The server under attack: every case an adversarial tester found, as a regression test.

Bad input never gets a 5xx and never breaks the keep-alive connection; an unexpected exception
is one JSON 500, counted, and the connection stays usable; a client that hangs up is aborted
at once, streaming or not; the guards (API key, Host, JSON-only bodies, read timeouts, header
and body sizes, connection limit) answer OpenAI-style errors; ``priority`` only counts when the
server schedules by priority. Everything talks to a real uvicorn server on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time

import httpx
import pytest
from serve_double import Slow

import minifer as mf
from conftest import lively_model
from minifer.engine.llm_engine import LLMEngine
from minifer_course.server import running_server

openai = pytest.importorskip("openai")

BODY = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
KEY = "sk-test-1234"


@pytest.fixture(scope="module")
def tiny_model():
    return lively_model("tiny")


class Buggy(mf.ByteTokenizer):
    """A tokenizer with a bug: "boom" raises something no handler expects."""

    def encode(self, text):
        if text == "boom":
            raise RuntimeError("tokenizer bug")
        return super().encode(text)


@pytest.fixture(scope="module")
def server(tiny_model):
    """A default server (first come, first served, no key) with short read timeouts."""
    engine = Slow(LLMEngine(tiny_model, Buggy(), max_num_seqs=8), delay=0.002)
    with running_server(engine=engine, model_name="tiny", read_timeout_s=0.6) as url:
        yield url, engine


def idle(engine, within: float = 10.0) -> float:
    """Seconds until the engine had nothing in flight (fails past `within`)."""
    t0 = time.monotonic()
    while engine.has_unfinished():
        assert time.monotonic() - t0 < within, "requests still in flight"
        time.sleep(0.005)
    assert engine.block_manager.num_used_blocks == 0
    return time.monotonic() - t0


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def request_bytes(body: bytes, *, path="/v1/completions", headers: dict | None = None) -> bytes:
    h = {"Host": "127.0.0.1", "Content-Type": "application/json",
         "Content-Length": str(len(body)), **(headers or {})}
    head = "".join(f"{k}: {v}\r\n" for k, v in h.items() if v is not None)
    return f"POST {path} HTTP/1.1\r\n{head}\r\n".encode() + body


def read_response(sock: socket.socket) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 response with a Content-Length from `sock`."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed after {buf!r}"
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    length = int(headers.get("content-length", 0))
    while len(rest) < length:
        rest += sock.recv(65536)
    return int(lines[0].split()[1]), headers, rest[:length]


def rejected(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("minifer_request_rejected_total{"):
            out[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
    return out


# ---- bad input: 400s, never 5xx ------------------------------------------------------------
RAW_BAD = {  # bodies that made the server answer 500
    "negative seed": (b'{"model":"tiny","prompt":"x","seed":-1}', "seed"),
    "lone surrogate": (b'{"model":"tiny","prompt":"\\ud800"}', "prompt"),
    "5000-digit integer": (b'{"model":"tiny","prompt":"x","max_tokens":' + b"1" * 5000 + b"}",
                           None),
    "penalty 10**400": (b'{"model":"tiny","prompt":"x","repetition_penalty":1' + b"0" * 400
                        + b"}", "repetition_penalty"),
    "penalty 1e400": (b'{"model":"tiny","prompt":"x","repetition_penalty":1e400}',
                      "repetition_penalty"),
    "temperature NaN": (b'{"model":"tiny","prompt":"x","temperature":NaN}', "temperature"),
    "priority 1e310": (b'{"model":"tiny","prompt":"x","priority":1' + b"0" * 310 + b"}",
                       "priority"),
    "surrogate stop": (b'{"model":"tiny","prompt":"x","stop":"\\udfff"}', "stop"),
    "surrogate chat": (b'{"model":"tiny","messages":[{"role":"user","content":"\\ud800"}]}',
                       "messages"),
}


@pytest.mark.parametrize("case", list(RAW_BAD))
def test_bad_bodies_get_400_on_a_connection_that_stays_usable(server, case):
    url, engine = server
    body, param = RAW_BAD[case]
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    with socket.create_connection(address(url), timeout=10) as sock:
        sock.sendall(request_bytes(body, path=path))
        status, headers, raw = read_response(sock)
        assert status == 400, raw
        err = json.loads(raw)["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, err
        assert headers.get("connection") != "close"
        sock.sendall(request_bytes(json.dumps(BODY).encode()))  # the same connection
        assert read_response(sock)[0] == 200
    idle(engine)


def test_an_unexpected_exception_is_one_counted_json_500_and_the_connection_lives(server):
    url, engine = server
    before = rejected(url).get("500", 0)
    with socket.create_connection(address(url), timeout=10) as sock:
        sock.sendall(request_bytes(json.dumps({**BODY, "prompt": "boom"}).encode()))
        status, headers, raw = read_response(sock)
        assert status == 500 and headers.get("connection") != "close"
        err = json.loads(raw)["error"]
        assert err["type"] == "server_error" and "RuntimeError: tokenizer bug" in err["message"]
        sock.sendall(request_bytes(json.dumps(BODY).encode()))
        assert read_response(sock)[0] == 200
    assert rejected(url)["500"] == before + 1


def test_every_refusal_is_counted_by_status(server):
    url, _ = server
    before = rejected(url)
    httpx.post(f"{url}/v1/completions", json={**BODY, "seed": -1})
    httpx.post(f"{url}/v1/completions", content=b"{}", headers={"Content-Type": "text/plain"})
    httpx.get(f"{url}/v1/completions")  # 405
    after = rejected(url)
    for status in ("400", "415", "405"):
        assert after[status] == before.get(status, 0) + 1, status


def test_405_names_the_allowed_methods(server):
    url, _ = server
    r = httpx.get(f"{url}/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["code"] == "method_not_allowed"


def test_put_and_patch_get_405_and_head_health_works(server):
    """Methods a route does not take are 405 naming the allowed ones, whatever the body's
    type (not 415: POST /v1/models too); ``HEAD /health`` answers like ``GET`` without a body."""
    url, _ = server
    for path, allowed in (("/health", "GET"), ("/v1/models", "GET"), ("/metrics", "GET"),
                          ("/v1/completions", "POST")):
        for method in ("PUT", "PATCH") + (("POST",) if allowed == "GET" else ()):
            for headers in ({}, {"Content-Type": "text/plain"}):
                r = httpx.request(method, f"{url}{path}", content=b"x", headers=headers)
                assert r.status_code == 405, (method, path, r.status_code)
                assert allowed in r.headers["allow"]
                assert r.json()["error"]["code"] == "method_not_allowed"
    r = httpx.head(f"{url}/health")
    assert r.status_code == 200 and r.content == b""


def test_a_huge_unknown_field_name_is_not_echoed_back_whole(server):
    url, _ = server
    name = "x" * 900_000
    r = httpx.post(f"{url}/v1/completions", content=b'{"model": "tiny", "prompt": "hi", "'
                   + name.encode() + b'": 1}', headers={"Content-Type": "application/json"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "unknown_parameter"
    assert len(r.content) < 2_000 and len(err["param"]) < 200 and "900,000" in err["param"]


@pytest.mark.parametrize("field", ["stream", "echo", "ignore_eos"])
@pytest.mark.parametrize("value", ["true", "false", "1", 1, 0, "yes", None])
def test_booleans_are_strict(server, field, value):
    """Only JSON true/false (or null) for a boolean: truthy strings and numbers are refused."""
    url, _ = server
    r = httpx.post(f"{url}/v1/completions", json={**BODY, field: value})
    if value is None:
        assert r.status_code == 200
    else:
        assert r.status_code == 400 and r.json()["error"]["param"] == field
    r = httpx.post(f"{url}/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "logprobs": value, "stream_options": {"include_usage": value}, "stream": True})
    assert r.status_code == (200 if value is None else 400)


# ---- hang-ups ----------------------------------------------------------------------------
def test_a_non_streaming_client_that_hangs_up_is_aborted_at_once(server):
    """Tokens keep coming every few ms, so a check "after 0.5 s without a token" never ran."""
    url, engine = server

    def aborted() -> float:
        [line] = [x for x in httpx.get(f"{url}/metrics").text.splitlines()
                  if x.startswith("minifer_request_aborted_total ")]
        return float(line.split()[1])

    before = aborted()
    body = json.dumps({**BODY, "max_tokens": 120, "ignore_eos": True}).encode()
    engine.delay = 0.02  # 120 tokens: 2.4 s of work
    try:
        sock = socket.create_connection(address(url))
        sock.sendall(request_bytes(body))
        t0 = time.monotonic()
        while not engine.has_unfinished() and time.monotonic() - t0 < 5:
            time.sleep(0.001)
        time.sleep(0.1)
        sock.close()  # after a few tokens
        assert idle(engine) < 0.5
    finally:
        engine.delay = 0.002
    assert aborted() == before + 1


# ---- guards --------------------------------------------------------------------------------
@pytest.mark.parametrize("host,ok", [("evil.example", False), ("evil.example:80", False),
                                     ("127.0.0.1.evil.example", False), ("localhost", True),
                                     ("LOCALHOST:8000", True), ("127.0.0.1", True),
                                     ("[::1]:8000", True), ("", False)])
def test_only_loopback_host_names_are_answered(server, host, ok):
    """DNS rebinding: a page at evil.example that resolves to 127.0.0.1 sends Host: evil.example."""
    url, _ = server
    with socket.create_connection(address(url), timeout=10) as sock:
        sock.sendall(request_bytes(json.dumps(BODY).encode(), headers={"Host": host}))
        status, _, raw = read_response(sock)
    assert status == (200 if ok else 400), raw
    if not ok:
        assert json.loads(raw)["error"]["code"] == "invalid_host"


@pytest.mark.parametrize("ctype,status", [("text/plain", 415), (None, 415),
                                          ("application/x-www-form-urlencoded", 415),
                                          ("multipart/form-data; boundary=x", 415),
                                          ("application/json; charset=utf-8", 200),
                                          ("application/vnd.api+json", 200)])
def test_bodies_must_be_json(server, ctype, status):
    """A cross-site form or fetch() can send text/plain (or no type) without a CORS preflight."""
    url, _ = server
    with socket.create_connection(address(url), timeout=10) as sock:
        sock.sendall(request_bytes(json.dumps(BODY).encode(), headers={"Content-Type": ctype}))
        got, _, raw = read_response(sock)
    assert got == status, raw
    if status == 415:
        assert json.loads(raw)["error"]["code"] == "unsupported_media_type"


def test_a_trickled_body_times_out(server):
    """A body trickled over 12 s was served; now it must arrive within the read timeout."""
    url, engine = server
    body = json.dumps(BODY).encode()
    with socket.create_connection(address(url), timeout=10) as sock:
        sock.sendall(request_bytes(body)[:-10])
        t0 = time.monotonic()
        status, _, raw = read_response(sock)
    assert status == 408 and json.loads(raw)["error"]["code"] == "read_timeout"
    assert 0.5 < time.monotonic() - t0 < 3
    idle(engine)


def test_trickled_or_missing_headers_time_out(server):
    url, _ = server
    for sent in (b"", b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: aaaa"):
        with socket.create_connection(address(url), timeout=10) as sock:
            t0 = time.monotonic()
            sock.sendall(sent)
            time.sleep(0.3)
            sock.sendall(b"a")  # still trickling
            got = b""
            while chunk := sock.recv(4096):
                got += chunk
            assert 0.5 < time.monotonic() - t0 < 3  # the server closed it
            assert got.startswith(b"HTTP/1.1 408")
    assert httpx.get(f"{url}/health").status_code == 200


def test_huge_headers_and_bodies_are_refused(server):
    url, _ = server
    r = httpx.get(f"{url}/health", headers={"X-Big": "a" * 100_000})
    assert r.status_code == 431 and r.json()["error"]["code"] == "headers_too_large"

    def chunks():  # no Content-Length: counted while read
        for _ in range(40):
            yield b" " * 50_000

    r = httpx.post(f"{url}/v1/completions", content=chunks(),
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


@pytest.mark.parametrize("pieces", [1, 2])
def test_huge_headers_get_431_however_they_arrive(server, pieces):
    """In one read the whole request reaches the app and `Guard` refuses it; in two, h11's
    buffer fills first (uvicorn's own answer would be a plain 400): the same JSON 431 either
    way."""
    url, _ = server
    request = (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nX-Big: "
               + b"a" * 40_000 + b"\r\n\r\n")
    with socket.create_connection(address(url)) as sock:
        if pieces == 1:
            sock.sendall(request)
        else:
            sock.sendall(request[:20_000])
            time.sleep(0.2)  # read by the server before the rest arrives
            with contextlib.suppress(OSError):  # the server may have answered and closed
                sock.sendall(request[20_000:])
        got = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431"), head
    assert json.loads(body)["error"]["code"] == "headers_too_large"
    assert httpx.get(f"{url}/health").status_code == 200


def test_connections_are_limited(tiny_model):
    """Connections that passed the guard (kept alive after a request) are never evicted: past
    the limit a new one gets 503."""
    engine = LLMEngine(tiny_model, mf.ByteTokenizer())
    with running_server(engine=engine, model_name="tiny", max_connections=3) as url:
        held = []
        for _ in range(2):  # uvicorn answers while fewer than max_connections are open
            held.append(socket.create_connection(address(url)))
            held[-1].sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert read_response(held[-1])[0] == 200
        try:
            r = httpx.get(f"{url}/health")
            assert r.status_code == 503
        finally:
            for s in held:
                s.close()
        time.sleep(0.1)
        assert httpx.get(f"{url}/health").status_code == 200


def _closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"a") -> bool:
    """Whether the server closes `sock` within `seconds` while the client trickles a byte
    every 0.1 s (what used to keep the connection open for ever)."""
    sock.settimeout(0.1)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if sock.recv(65536) == b"":
                return True
        except TimeoutError:
            pass
        except OSError:
            return True
        try:
            sock.sendall(trickle)
        except OSError:
            return True
    return False


@pytest.mark.parametrize("case", ["401 before the body", "408 for a slow body"])
def test_an_error_with_an_unread_body_closes_the_connection(tiny_model, case):
    engine = LLMEngine(tiny_model, mf.ByteTokenizer())
    with running_server(engine=engine, model_name="tiny", api_key=KEY,
                        read_timeout_s=0.5) as url:
        body = json.dumps(BODY).encode()
        key = {"Authorization": f"Bearer {KEY}"} if case.startswith("408") else {}
        with socket.create_connection(address(url), timeout=10) as sock:
            sock.sendall(request_bytes(body, headers=key)[:-10])
            status, headers, _ = read_response(sock)
            assert status == (401 if case.startswith("401") else 408)
            assert headers["connection"] == "close"
            assert _closed_within(sock, 2.0)
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}
                         ).status_code == 200


def test_hundreds_of_trickling_clients_never_lock_out_a_client_with_the_key(tiny_model):
    """300 connections on 127.0.0.1 trickle their headers, or a body the server refused (401),
    one byte at a time, against a limit of 32 connections and a read timeout longer than the
    test: a client with the key is still answered at once, and the refused ones are closed."""
    async def trickler(host: str, port: int, head: bytes, stop: asyncio.Event) -> bool:
        """Trickle until told to stop; whether the server closed the connection first."""
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            return True
        try:
            writer.write(head)
            while not stop.is_set():
                await writer.drain()
                try:
                    if await asyncio.wait_for(reader.read(65536), 0.2) == b"":
                        return True
                except asyncio.TimeoutError:
                    pass
                writer.write(b"a")
            return False
        except OSError:
            return True
        finally:
            writer.close()

    engine = LLMEngine(tiny_model, mf.ByteTokenizer(), max_num_seqs=4)
    with running_server(engine=engine, model_name="tiny", api_key=KEY, max_connections=32,
                        read_timeout_s=30) as url:
        host, port = address(url)
        partial_headers = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "
        refused_body = request_bytes(b"{" + b" " * 999)[:-900]  # no key, body unfinished

        async def attack() -> tuple[list[bool], list[bool], httpx.Response, float]:
            stop = asyncio.Event()
            slow = [asyncio.ensure_future(trickler(host, port, partial_headers, stop))
                    for _ in range(200)]
            refused = [asyncio.ensure_future(trickler(host, port, refused_body, stop))
                       for _ in range(100)]
            await asyncio.sleep(1.5)  # all connected and trickling
            async with httpx.AsyncClient(timeout=10) as http:
                t0 = time.monotonic()
                r = await http.post(f"{url}/v1/completions", json=BODY,
                                    headers={"Authorization": f"Bearer {KEY}"})
                took = time.monotonic() - t0
            await asyncio.sleep(0.5)
            stop.set()
            return (await asyncio.gather(*slow), await asyncio.gather(*refused), r, took)

        slow, refused, r, took = asyncio.run(attack())
        assert r.status_code == 200, r.text
        assert took < 5
        assert all(refused)  # each got its 401 and was closed
        assert sum(slow) >= 200 - 32  # the limit held: most were evicted
        assert httpx.get(f"{url}/health").status_code == 200


# ---- the API key ---------------------------------------------------------------------------
def test_api_key_is_checked_on_every_route_but_health(tiny_model):
    engine = LLMEngine(tiny_model, mf.ByteTokenizer())
    with running_server(engine=engine, model_name="tiny", api_key=KEY) as url:
        assert httpx.get(f"{url}/health").status_code == 200  # probes need no key
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"),
                             ("GET", "/openapi.json"), ("POST", "/v1/completions"),
                             ("POST", "/v1/chat/completions"), ("GET", "/nowhere")):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                            {"Authorization": f"Basic {KEY}"}):
                r = httpx.request(method, f"{url}{path}", json=BODY, headers=headers)
                assert r.status_code == 401, (path, headers)
                assert r.headers["www-authenticate"] == "Bearer"
                assert r.json()["error"]["code"] == "invalid_api_key"
        ok = httpx.post(f"{url}/v1/completions", json=BODY,
                        headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200
        good = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        assert good.completions.create(model="tiny", prompt="Hi", max_tokens=3).usage
        assert [m.id for m in good.models.list().data] == ["tiny"]
        bad = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError, match="incorrect API key"):
            bad.chat.completions.create(model="tiny", messages=[{"role": "user",
                                                                 "content": "Hi"}])
        assert 'minifer_request_rejected_total{status="401"}' in httpx.get(
            f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text


def test_the_command_line_takes_the_key_from_an_option_or_the_environment(monkeypatch):
    from minifer.serve.__main__ import build_parser, server_options

    monkeypatch.delenv("MINIFER_API_KEY", raising=False)
    args = build_parser().parse_args([])
    opts = server_options(args)
    assert opts["api_key"] is None and opts["allowed_hosts"] is not None
    assert opts["max_waiting"] == 256 and opts["scheduling_policy"] == "fcfs"
    monkeypatch.setenv("MINIFER_API_KEY", "from-env")
    assert server_options(build_parser().parse_args([]))["api_key"] == "from-env"
    args = build_parser().parse_args(["--api-key", "from-flag", "--host", "0.0.0.0"])
    opts = server_options(args)
    assert opts["api_key"] == "from-flag" and opts["allowed_hosts"] is None
    args = build_parser().parse_args(["--allowed-hosts", "box.lan", "localhost"])
    assert server_options(args)["allowed_hosts"] == ["box.lan", "localhost"]


def test_an_empty_api_key_is_an_error_at_start(monkeypatch, capsys):
    """``--api-key ""`` or ``MINIFER_API_KEY=""`` (an unset shell variable) must not silently
    turn authentication off: the server refuses to start."""
    from minifer.serve.__main__ import build_parser, main, server_options

    monkeypatch.delenv("MINIFER_API_KEY", raising=False)
    for argv in (["--api-key", ""], ["--api-key", "  "]):
        with pytest.raises(ValueError, match="--api-key is empty"):
            server_options(build_parser().parse_args(argv))
    monkeypatch.setenv("MINIFER_API_KEY", "")
    with pytest.raises(ValueError, match=r"\$MINIFER_API_KEY is empty"):
        server_options(build_parser().parse_args([]))
    assert server_options(build_parser().parse_args(["--api-key", "k"]))["api_key"] == "k"
    with pytest.raises(SystemExit) as exit_:  # before any model is loaded
        main(["--model", "no-such-model"])
    assert exit_.value.code == 2 and "MINIFER_API_KEY is empty" in capsys.readouterr().err


# ---- priorities ----------------------------------------------------------------------------
def test_priority_counts_only_when_the_server_schedules_by_priority(server, tiny_model):
    url, _ = server
    r = httpx.post(f"{url}/v1/completions", json={**BODY, "priority": -5})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported"
    assert "--scheduling-policy priority" in r.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/completions", json={**BODY, "priority": 0}).status_code == 200
    engine = LLMEngine(tiny_model, mf.ByteTokenizer(), max_num_seqs=4)
    with running_server(engine=engine, model_name="tiny", scheduling_policy="priority") as url:
        async def scenario():
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                body = {**BODY, "max_tokens": 60, "ignore_eos": True, "stream": True}

                async def stream():
                    async with http.stream("POST", "/v1/completions", json=body) as r:
                        return [line async for line in r.aiter_lines()]

                task = asyncio.create_task(stream())
                await asyncio.sleep(0.05)
                huge = await http.post("/v1/completions", content=json.dumps(
                    {**BODY, "priority": 10**310}), headers={"Content-Type": "application/json"})
                low = await http.post("/v1/completions", json={**BODY, "priority": 2**53})
                return huge, low, await task

        huge, low, lines = asyncio.run(scenario())
        assert huge.status_code == 400 and huge.json()["error"]["param"] == "priority"
        assert low.status_code == 200
        assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"
        assert not any("engine_error" in line for line in lines)  # the stream was untouched
        assert engine.scheduler.num_steps > 0


# ---- the waiting queue ----------------------------------------------------------------------
def test_a_burst_is_queued_by_default_and_a_429_says_when_to_retry(tiny_model):
    engine = LLMEngine(tiny_model, mf.ByteTokenizer(), max_num_seqs=8)
    body = {**BODY, "max_tokens": 16, "ignore_eos": True}
    with running_server(engine=engine, model_name="tiny") as url:
        async def burst(n):
            limits = httpx.Limits(max_connections=n)
            async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
                return await asyncio.gather(*(http.post("/v1/completions", json=body)
                                              for _ in range(n)))

        statuses = [r.status_code for r in asyncio.run(burst(100))]
        assert statuses == [200] * 100  # 36 of them got 429 with the old default of 64
    slow = Slow(LLMEngine(tiny_model, mf.ByteTokenizer(), max_num_seqs=1), delay=0.05)
    body["max_tokens"] = 4
    with running_server(engine=slow, model_name="tiny", max_waiting=1) as url:
        rs = asyncio.run(burst(6))  # the first waits 50 ms for its first token: the rest come
        full = [r for r in rs if r.status_code == 429]
        assert full and all(r.status_code == 200 for r in rs if r not in full)
        assert full[0].headers["retry-after"] == "1"
        err = full[0].json()["error"]
        assert (err["type"], err["code"]) == ("rate_limit_error", "queue_full")


# ---- shutdown ------------------------------------------------------------------------------
def _events_of_stream(url: str, max_tokens: int, events: list, started) -> None:
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()


def test_shutdown_drains_then_ends_each_stream_with_an_error_and_done(tiny_model):
    """On SIGTERM (uvicorn's ``should_exit``) a short answer still finishes within the grace;
    a longer one gets an error event naming the shutdown and ``[DONE]``, not a cut connection."""
    import threading

    engine = Slow(LLMEngine(tiny_model, mf.ByteTokenizer(), max_num_seqs=4), delay=0.05)
    short, long_ = [], []
    started = [threading.Event(), threading.Event()]
    with running_server(engine=engine, model_name="tiny", shutdown_grace_s=2.0) as url:
        threads = [threading.Thread(target=_events_of_stream, args=(url, n, out, ev))
                   for n, out, ev in ((10, short, started[0]), (100, long_, started[1]))]
        for t in threads:
            t.start()
        assert all(ev.wait(20) for ev in started)
        t0 = time.monotonic()
    took = time.monotonic() - t0
    for t in threads:
        t.join(10)
    assert 1.0 < took < 6  # it waited for the grace, and not much longer
    assert short[-1] == "[DONE]" and json.loads(short[-2])["choices"][0]["finish_reason"]
    assert long_[-1] == "[DONE]" and len(long_) < 100
    assert json.loads(long_[-2])["error"]["code"] == "shutting_down"


def test_the_command_line_takes_a_shutdown_grace():
    from minifer.serve.__main__ import build_parser

    assert build_parser().parse_args([]).shutdown_grace == 30.0
    assert build_parser().parse_args(["--shutdown-grace", "5"]).shutdown_grace == 5.0
