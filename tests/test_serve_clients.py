"""The OpenAI API as its clients use it (issue 45, item 12): lm-evaluation-harness's four request
types written out as it sends them (`local-completions` with a batch of prompts, loglikelihood
and rolling loglikelihood by echo + logprobs, generation with stop strings, and
`local-chat-completions`), a list of prompts in one request, special tokens in text, the
shipped tokenizer folder read by ``transformers.AutoTokenizer``, and echo's offsets. Everything
talks to a real server on 127.0.0.1 serving the shipped Shakespeare model."""

from __future__ import annotations

import json
from operator import itemgetter

import httpx
import pytest
import torch

import minifer as mf
from minifer.pretrained import data_dir
from minifer_course.server import running_server

EOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def shakespeare():
    model, tok = mf.load_pretrained("shakespeare")
    with running_server(model, tok, model_name="shakespeare", max_num_seqs=8) as url:
        yield url, model, tok


def post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(f"{url}/v1/{path}", json={"model": "shakespeare", **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def own_logprobs(model, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1, from the model itself."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids]))[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[i - 1, t].item() for i, t in enumerate(ids) if i]


def loglikelihood(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """lm-eval's `parse_logprobs`: the continuation's logprobs (the last entry is the one
    generated token, left out) and whether each was the greedy choice."""
    lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    return sum(lps), all(lp == max(top.values()) for lp, top in zip(lps, tops))


def test_lm_eval_loglikelihood_batch_of_token_prompts(shakespeare):
    """``local-completions`` with ``batch_size 2``: two prompts of token ids in one request,
    echo + logprobs 1 + max_tokens 1; the scores equal the model's own."""
    url, model, tok = shakespeare
    pairs = [("ROMEO:\nBut soft, what light", " through yonder window breaks?"),
             ("JULIET:\nO Romeo, Romeo!", " wherefore art thou Romeo?")]
    prompts = [tok.encode(c) + tok.encode(x) for c, x in pairs]
    ctxlens = [len(tok.encode(c)) for c, _ in pairs]
    out = post(url, "completions", {"prompt": prompts, "temperature": 0, "max_tokens": 1,
                                    "logprobs": 1, "seed": 1234, "echo": True})
    choices = sorted(out["choices"], key=itemgetter("index"))
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert out["usage"]["prompt_tokens"] == sum(map(len, prompts))
    for choice, ids, ctxlen in zip(choices, prompts, ctxlens):
        assert choice["logprobs"]["token_logprobs"][0] is None  # the first token: no context
        ll, _ = loglikelihood(choice, ctxlen)
        assert ll == pytest.approx(sum(own_logprobs(model, ids)[ctxlen - 1:]), abs=1e-4)
    # the same with max_tokens 0 (scores only): no generated entry at the end
    out0 = post(url, "completions", {"prompt": prompts, "temperature": 0, "max_tokens": 0,
                                     "logprobs": 1, "echo": True})
    for c0, c1 in zip(sorted(out0["choices"], key=itemgetter("index")), choices):
        assert c0["logprobs"]["token_logprobs"] == c1["logprobs"]["token_logprobs"][:-1]
        assert c0["finish_reason"] == "length" and out0["usage"]["completion_tokens"] == 0


def test_lm_eval_rolling_loglikelihood_starts_with_the_end_of_text_token(shakespeare):
    """Rolling perplexity: each window starts with the prefix token (end of text). Sent as text,
    ``<|endoftext|>`` is that one token, as the HF tokenizer makes it: the same scores as ids."""
    url, model, tok = shakespeare
    text = "First Citizen:\nBefore we proceed any further, hear me speak."
    ids = [tok.eos_token_id] + tok.encode(text)
    body = {"temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}
    by_ids = post(url, "completions", {**body, "prompt": [ids]})["choices"][0]
    by_text = post(url, "completions", {**body, "prompt": EOS + text})["choices"][0]
    assert by_text["logprobs"]["tokens"][0] == EOS
    assert by_ids["logprobs"]["token_logprobs"] == by_text["logprobs"]["token_logprobs"]
    ll, _ = loglikelihood(by_ids, 1)
    assert ll == pytest.approx(sum(own_logprobs(model, ids)), abs=1e-4)
    # echo's text keeps the special token, and every offset indexes into it
    for choice in (by_ids, by_text):
        text_out, lp = choice["text"], choice["logprobs"]
        assert text_out.startswith(EOS + text)
        for token, offset in zip(lp["tokens"], lp["text_offset"]):
            assert text_out[offset:offset + len(token)] == token


def test_lm_eval_generation_with_stop_and_a_batch_of_text_prompts(shakespeare):
    url, model, tok = shakespeare
    prompts = ["ROMEO:\n", "KING HENRY:\n"]
    out = post(url, "completions", {"prompt": prompts, "max_tokens": 24, "temperature": 0,
                                    "stop": ["\n\n"], "seed": 1234})
    texts = [None] * 2
    for choice in out["choices"]:
        texts[choice["index"]] = choice["text"]
    for prompt, text in zip(prompts, texts):  # each as if it had been sent alone
        alone = post(url, "completions", {"prompt": prompt, "max_tokens": 24, "temperature": 0,
                                          "stop": ["\n\n"], "seed": 1234})
        assert text == alone["choices"][0]["text"] and "\n\n" not in text


def test_lm_eval_chat(shakespeare):
    url, _, _ = shakespeare
    out = post(url, "chat/completions", {
        "messages": [{"role": "user", "content": "Speak, my lord."}], "max_tokens": 16,
        "temperature": 0, "stop": ["\n\n", EOS][:4], "seed": 1234})
    assert out["choices"][0]["index"] == 0
    assert isinstance(out["choices"][0]["message"]["content"], str)


def test_a_list_of_prompts_streams_each_choice_with_its_index(shakespeare):
    url, _, _ = shakespeare
    body = {"model": "shakespeare", "prompt": ["ROMEO:", "JULIET:"], "max_tokens": 6,
            "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    texts, events = ["", ""], []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    usage = json.loads(events[-2])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    for data in events[:-2]:
        [choice] = json.loads(data)["choices"]
        texts[choice["index"]] += choice["text"]
    whole = post(url, "completions", {k: v for k, v in body.items()
                                      if k not in ("stream", "stream_options")})
    assert texts == [c["text"] for c in whole["choices"]]


def test_a_chat_request_too_long_names_messages(shakespeare):
    url, _, _ = shakespeare
    r = httpx.post(f"{url}/v1/chat/completions", json={
        "model": "shakespeare", "messages": [{"role": "user", "content": "O Romeo! " * 100}],
        "max_tokens": 8})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    assert err["param"] == "messages" and "prompt" not in err["message"]


def test_the_shipped_tokenizer_folder_is_read_by_autotokenizer(shakespeare):
    """`AutoTokenizer` (what lm-eval's ``tokenizer_backend=huggingface`` loads) reads the folder
    with its eos/bos token, and tokenizes text as the server does, special tokens included."""
    transformers = pytest.importorskip("transformers")
    _, _, tok = shakespeare
    hf = transformers.AutoTokenizer.from_pretrained(str(data_dir() / "shakespeare"))
    assert hf.eos_token == hf.bos_token == EOS
    assert hf.eos_token_id == hf.bos_token_id == tok.eos_token_id == 2047
    text = "ROMEO:\nAy me! " + EOS + "JULIET:"
    assert hf.encode(text) == tok.encode(text, special_tokens=True)
    assert tok.eos_token_id in hf.encode(text) and tok.eos_token_id not in tok.encode(text)
