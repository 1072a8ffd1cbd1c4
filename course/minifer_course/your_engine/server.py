"""Lesson 11: your engine behind HTTP, and a client that loads it.

`serve(engine)` starts, on a free loopback port, a server from Python's standard library
(`http.server`) in front of one engine thread, and stops both when its block ends. A POST to
``/v1/completions`` (OpenAI's fields: prompt, max_tokens, temperature, top_p, top_k, seed,
stream) joins the engine's queue; with ``"stream": true`` the answer comes back as server-sent
events, one ``data: {json}`` line per step's tokens, then ``data: [DONE]``. The engine thread
steps while anyone waits, so concurrent requests share its steps (continuous batching).

The client side: `read_events` (lesson 11), `complete` (one streamed request, timed) and
`load` (many at once, each sent at its arrival time), which measure TTFT and the gaps between
tokens as a user sees them.
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import minifer as mf


def params_of(body: dict):
    """OpenAI's request fields as minifer's `SamplingParams` (its checks included)."""
    return mf.SamplingParams(temperature=body.get("temperature", 1.0), top_p=body.get("top_p", 1.0),
                             top_k=body.get("top_k", 0), seed=body.get("seed"),
                             max_new_tokens=body.get("max_tokens", 16),
                             ignore_eos=body.get("ignore_eos", False))


class EngineLoop(threading.Thread):
    """The one thread that steps the engine: it takes new requests from `inbox` between steps
    and puts each step's `Output`s into the queue of the request they belong to."""

    def __init__(self, engine) -> None:
        super().__init__(daemon=True)
        self.engine, self.inbox, self.outboxes = engine, queue.Queue(), {}
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            self.take_new(wait=not self.engine.has_unfinished())
            for out in self.engine.step() if self.engine.has_unfinished() else []:
                self.outboxes[out.id].put(out)

    def take_new(self, wait: bool) -> None:
        """Add every request waiting in the inbox (waiting a moment for one when idle)."""
        try:
            item = self.inbox.get(timeout=0.05) if wait else self.inbox.get_nowait()
            while True:
                prompt, params, box = item
                try:
                    self.outboxes[self.engine.add_request(prompt, params)] = box
                except ValueError as err:  # refused: the handler answers 400
                    box.put(err)
                item = self.inbox.get_nowait()
        except queue.Empty:
            pass


def handler(loop: EngineLoop, tok):
    class Completions(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            box: queue.Queue = queue.Queue()
            try:
                loop.inbox.put((body["prompt"], params_of(body), box))
                out = box.get()  # the first step's tokens (or why the request was refused)
            except (KeyError, ValueError) as err:
                out = err
            if isinstance(out, Exception):
                return self.send_error(400, f"{type(out).__name__}: {out}")
            self.send_response(200)
            stream = body.get("stream", False)
            self.send_header("Content-Type", "text/event-stream" if stream else "application/json")
            self.end_headers()
            tokens, text = [], ""
            while True:
                tokens += out.tokens
                new_text = tok.decode(tokens)  # the text so far; hold back a half character
                safe = new_text if out.finish_reason else new_text.rstrip("\ufffd")
                choice = {"index": 0, "text": safe[len(text):], "token_ids": out.tokens,
                          "finish_reason": out.finish_reason}
                text = safe
                if stream:
                    self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
                if out.finish_reason:
                    break
                out = box.get()
            if stream:
                self.wfile.write(b"data: [DONE]\n\n")
            else:
                whole = {"index": 0, "text": text, "token_ids": tokens, "finish_reason": out.finish_reason}
                self.wfile.write(json.dumps({"choices": [whole]}).encode())

        def log_message(self, *args):  # quiet: no line per request on stderr
            pass

    return Completions


@contextlib.contextmanager
def serve(engine):
    """The engine behind ``http://127.0.0.1:PORT`` (a free port) until the block ends."""
    loop = EngineLoop(engine)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler(loop, engine.tok))
    threads = [loop, threading.Thread(target=httpd.serve_forever, daemon=True)]
    for t in threads:
        t.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        loop.stopped.set()
        loop.join()


# ---- the client ----------------------------------------------------------------------------
def read_events(lines):
    """Server-sent event lines → the JSON events: the `data: ` lines, up to `data: [DONE]`."""
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and all(line == "" for line in lines if not line.startswith("data: "))
    return [json.loads(d) for d in data[:-1]]


def complete(url: str, body: dict) -> dict:
    """One streamed request: its token ids, text, and when each event arrived (seconds after
    sending): TTFT is the first, the gaps between the rest are the inter-token latencies."""
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    t0, lines, times = time.perf_counter(), [], []
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:  # one line at a time, as the server writes them
            lines.append(raw.decode().rstrip("\n"))
            if lines[-1].startswith("data: {"):
                times.append(time.perf_counter() - t0)
    events = read_events(lines)
    tokens = [t for e in events for t in e["choices"][0]["token_ids"]]
    return {"tokens": tokens, "text": "".join(e["choices"][0]["text"] for e in events),
            "times": times, "ttft": times[0], "itl": [b - a for a, b in zip(times, times[1:])],
            "events": len(events), "finish_reason": events[-1]["choices"][0]["finish_reason"]}


def load(url: str, bodies: list[dict], arrivals: list[float]) -> list[dict]:
    """Send `bodies[i]` at `arrivals[i]` seconds, all from threads of their own; each result of
    `complete`, plus its send time `sent` (seconds since the first arrival)."""
    start = time.perf_counter()

    def one(i: int) -> dict:
        time.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
        sent = time.perf_counter() - start
        return {**complete(url, bodies[i]), "sent": sent}

    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(one, range(len(bodies))))
