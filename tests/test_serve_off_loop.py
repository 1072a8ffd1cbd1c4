"""The HTTP server never tokenizes on its event loop: a prompt that takes long to encode does
not stall another client's stream (a functional check: no timing is asserted)."""

from __future__ import annotations

import json
import threading

import httpx

from conftest import lively_model
from minifer.tokenizer import ByteTokenizer
from minifer_course.server import running_server


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


class CountingTokenizer(ByteTokenizer):
    """Records the length of every text it encodes."""

    def __init__(self) -> None:
        super().__init__()
        self.encoded: list[int] = []

    def encode(self, text: str, *, special_tokens: bool = False) -> list[int]:
        self.encoded.append(len(text))
        return super().encode(text, special_tokens=special_tokens)


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized():
    """More characters than the context window times the most characters one token stands for
    (13 here: ``<|endoftext|>``) can never fit: refused without tokenizing (issue 45, item 2)."""
    tok = CountingTokenizer()
    assert tok.max_token_chars == len("<|endoftext|>")
    with running_server(lively_model("tiny"), tok, max_num_seqs=4) as url:
        ctx = httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"]
        huge = "x" * (ctx * tok.max_token_chars + 1)
        for path, body in (("completions", {"prompt": huge}),
                           ("chat/completions", {"messages": [{"role": "user",
                                                               "content": huge}]})):
            r = httpx.post(f"{url}/v1/{path}", json={"model": "minifer", **body, "max_tokens": 1})
            err = r.json()["error"]
            assert r.status_code == 400 and err["code"] == "context_length_exceeded"
            assert err["param"] == ("prompt" if path == "completions" else "messages")
        assert not [n for n in tok.encoded if n > ctx * tok.max_token_chars]
        r = httpx.post(f"{url}/v1/completions", json={"model": "minifer", "prompt": "x" * 200,
                                                      "max_tokens": 1})
        assert r.status_code == 400 and tok.encoded[-1] == 200  # short enough: tokenized


def test_the_bpe_tokenizer_lets_other_threads_run_while_it_encodes():
    """`Tokenizer.encode` releases the GIL (the library's batch call): a thread beside it keeps
    running. With a call that holds the GIL the other thread stood still for the whole encode."""
    import time

    from minifer.pretrained import data_dir
    from minifer.tokenizer import Tokenizer

    tok = Tokenizer.from_file(data_dir() / "shakespeare" / "tokenizer.json")
    text = (data_dir() / "shakespeare" / "validation.txt").read_text(encoding="utf-8")
    text = (text * (400_000 // len(text) + 1))[:400_000]
    gaps: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.05)
    t0 = time.perf_counter()
    ids = tok.encode(text)
    took = time.perf_counter() - t0
    stop.set()
    ticker.join()
    assert ids == tok.hf.encode(text, add_special_tokens=False).ids
    assert max(gaps) < 0.5 * took, (max(gaps), took)
