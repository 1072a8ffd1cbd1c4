"""Chat templates run in a bounded sandbox (issue 56): a template that loops is stopped at the
server's time limit in a process of its own, so eight of them in flight neither hold the
server's threads nor slow ``/v1/completions``; one that builds a huge string is refused before
it allocates it; Jinja's sandbox still refuses code execution; each is a 400 naming the chat
template and the limit it hit."""

from __future__ import annotations

import threading
import time
import tracemalloc

import httpx
import pytest
from jinja2.exceptions import SecurityError as Refused

import minifer as mf
from conftest import lively_model
from minifer.chat_template import TemplateSandbox, render_template
from minifer_course.server import running_server

LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
# loops only when the first message says so: the same server also answers ordinary chats
TEMPLATE = ("{% if messages[0]['content'] == 'loop' %}" + LOOP + "{% endif %}"
            "{% if messages[0]['content'] == 'huge' %}{{ 'A' * 300000000 }}{% endif %}"
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
PAYLOADS = ["{{ ''.__class__.__mro__[1].__subclasses__() }}",
            "{{ cycler.__init__.__globals__.os.system('touch {marker}') }}",
            "{{ self._TemplateReference__context.cycler.__init__.__globals__.os }}",
            "{% set x = messages.append(1) %}"]


@pytest.fixture(scope="module")
def model():
    return lively_model("tiny")


def _chat(url: str, content: str) -> tuple[httpx.Response, float]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}],
            "max_tokens": 4, "temperature": 0}
    t0 = time.monotonic()
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    return r, time.monotonic() - t0


def test_a_huge_string_is_refused_before_it_is_built():
    """``{{ 'A' * 300000000 }}`` (3.2 s and 1.5 GB a request before) is refused by the sandbox's
    ``*`` at once, allocating nothing of the size; so are a huge list and a huge rendering."""
    tracemalloc.start()
    try:
        t0 = time.monotonic()
        for template in ("{{ 'A' * 300000000 }}", "{{ [0] * 10**9 }}", "{{ 10 ** 100000000 }}"):
            with pytest.raises(Refused, match="would build .* more than the 4,194,304 a chat "
                               "template may"):
                render_template(template, [])
        with pytest.raises(Refused, match="it renders 101,000\\+ characters, more than the 100,000"):
            render_template("{% for i in range(1000) %}{{ 'x' * 1000 }}{% endfor %}", [],
                            max_chars=100_000)
        elapsed, peak = time.monotonic() - t0, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert elapsed < 1.0 and peak < 20 * 2**20
    assert render_template("{{ 'ab' * 3 + 'c' }}{{ 1000 * 5000 }}{{ 2 ** 10 }}", []) \
        == "abababc50000001024"  # numbers and small strings are untouched


def test_code_execution_payloads_stay_refused(tmp_path):
    marker = tmp_path / "pwned"
    sandbox = TemplateSandbox(workers=1, timeout_s=10)
    try:
        for payload in PAYLOADS:
            with pytest.raises(ValueError, match="the chat template failed: SecurityError"):
                sandbox.render(payload.replace("{marker}", str(marker)), [{"role": "user"}])
        assert sandbox.render("{{ messages[0]['role'] }}{{ x }}", [{"role": "user"}],
                              x="!") == "user!"
    finally:
        sandbox.close()
    assert not marker.exists()
    for name, value in (("chat_template_timeout_s", 0), ("chat_template_max_chars", 0),
                        ("chat_template_workers", 0)):
        with pytest.raises(ValueError, match=name):
            TemplateSandbox(**{name.removeprefix("chat_template_"): value})


def test_looping_templates_neither_hold_the_server_nor_run_past_their_limit(model):
    """Eight chats whose template loops ~forever: ``/v1/completions`` answers within 2 s while
    they are in flight, /health says ok, each of them gets a 400 naming the chat template's time
    limit within it, and the next ordinary chat is answered (the killed renders replaced)."""
    limit = 2.0
    tok = mf.ByteTokenizer()
    tok.chat_template = TEMPLATE
    results: list = []
    with running_server(model, tok, model_name="tiny", max_num_seqs=4,
                        chat_template_timeout_s=limit) as url:
        assert _chat(url, "hello")[0].status_code == 200
        chats = [threading.Thread(target=lambda: results.append(_chat(url, "loop")))
                 for _ in range(8)]
        for t in chats:
            t.start()
        time.sleep(0.3)  # every chat is in flight
        t0 = time.monotonic()
        r = httpx.post(f"{url}/v1/completions", timeout=30, json={
            "model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0})
        completion_s = time.monotonic() - t0
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        for t in chats:
            t.join(30)
        after = _chat(url, "hello")[0]
        huge, huge_s = _chat(url, "huge")
    print(f"completion with 8 looping templates in flight: {completion_s:.3f} s; chats' errors "
          f"after {sorted(round(s, 2) for _, s in results)} s; 'A' * 3e8: {huge_s:.3f} s")
    assert r.status_code == 200 and completion_s < 2.0
    assert len(results) == 8
    for res, seconds in results:
        err = res.json()["error"]
        assert res.status_code == 400 and err["param"] == "messages"
        assert f"the chat template did not finish rendering within {limit:g} s" in err["message"]
        assert "--chat-template-timeout" in err["message"]
        assert seconds < limit + 1.0
    assert after.status_code == 200
    assert huge.status_code == 400 and huge_s < 1.0
    assert "'*' would build 300,000,000 characters" in huge.json()["error"]["message"]


def test_the_limits_are_server_flags():
    from minifer.serve.__main__ import build_parser, server_options

    args = build_parser().parse_args(["--chat-template-timeout", "2.5",
                                      "--chat-template-max-chars", "1000"])
    options = server_options(args)
    assert options["chat_template_timeout_s"] == 2.5
    assert options["chat_template_max_chars"] == 1000
    defaults = server_options(build_parser().parse_args([]))
    assert defaults["chat_template_timeout_s"] == 5.0
    assert defaults["chat_template_max_chars"] == 2**22
