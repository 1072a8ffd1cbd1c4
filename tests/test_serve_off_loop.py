"""The HTTP server never tokenizes on its event loop: a prompt that takes long to encode does
not stall another client's stream (a functional check: no timing is asserted)."""

from __future__ import annotations

import json
import threading

import httpx
from conftest import lively_model

from minifer.serve.api import running_server
from minifer.tokenizer import ByteTokenizer


class SlowTokenizer(ByteTokenizer):
    """Encodes prompts that start with "BIG" only once `release` is set (a huge prompt's
    tokenization, as long as the test likes); records the thread of every encode and decode."""

    def __init__(self) -> None:
        super().__init__()
        self.started, self.release = threading.Event(), threading.Event()
        self.threads: list[str] = []

    def encode(self, text: str) -> list[int]:
        self.threads.append(threading.current_thread().name)
        if text.startswith("BIG"):
            self.started.set()
            assert self.release.wait(20), "the other stream never finished"
        return super().encode(text)

    def decode(self, ids) -> str:
        self.threads.append(threading.current_thread().name)
        return super().decode(ids)


def _stream(url: str, prompt) -> list[str]:
    body = {"model": "minifer", "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "stream": True, "ignore_eos": True}
    events = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:])["choices"][0]["text"])
    return events


def test_a_prompt_being_tokenized_does_not_stall_another_stream():
    tok = SlowTokenizer()
    with running_server(lively_model("tiny"), tok, max_num_seqs=4) as url:
        big: dict = {}
        t = threading.Thread(target=lambda: big.setdefault("events",
                                                           _stream(url, "BIG" + "x" * 60)))
        t.start()
        assert tok.started.wait(20)  # the big prompt is being encoded (and held) now
        small = _stream(url, "hello")  # would hang here if the loop were busy encoding
        assert len(small) == 8 and not big and t.is_alive()
        tok.release.set()
        t.join(60)
        assert len(big["events"]) == 8
        assert _stream(url, list(b"ids, decoded for echo")) and tok.threads
    assert "minifer-http" not in tok.threads  # never the event loop's thread
