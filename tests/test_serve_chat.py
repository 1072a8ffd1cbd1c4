"""The server in the OpenAI ecosystem: chat completions, logprobs, echo, min_tokens, models.

The official `openai` client talks to a real server on 127.0.0.1. Chat answers equal
`minifer.generate` of the rendered conversation alone (with the end of turn as a stop string);
every logprob equals the model's own log-softmax at that position, computed here by one plain
forward pass over prompt + answer; the shipped play-trained model answers a chat in one turn.
"""

from __future__ import annotations

import codecs

import httpx
import pytest
import torch
from serve_double import StandInEngine

import minifer as mf
from conftest import lively_model, scripted_gpt
from minifer.engine.llm_engine import LLMEngine
from minifer.play_chat import ASSISTANT, END_OF_TURN, USER, render_chat, speech
from minifer_course.server import running_server

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "system", "content": "A street."},
            {"role": "user", "content": "Good morrow!"},
            {"role": "assistant", "content": "And to you."},
            {"role": "user", "content": "Whither goest thou?"}]


def client(url: str):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tiny_model():
    return lively_model("tiny")


@pytest.fixture(scope="module", params=["engine", "stand-in"])
def served(request, tiny_model):
    tok = mf.ByteTokenizer()
    make = LLMEngine if request.param == "engine" else StandInEngine
    engine = make(tiny_model, tok, max_num_seqs=4)
    with running_server(engine=engine, model_name="tiny") as url:
        yield url, engine, tiny_model, tok


def byte_id(shown: str) -> int:
    """The id of a `ByteTokenizer` token from how logprobs show it ("a", or "\\xb2")."""
    return int(shown[2:], 16) if len(shown) == 4 and shown.startswith("\\x") else ord(shown)


def log_softmax_at(model, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """The model's log-probabilities at each answer position (one forward pass, no cache)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + answer[:-1]]))[0, len(prompt) - 1:]
    return torch.log_softmax(logits.float(), -1)


# ---- the chat template ----------------------------------------------------------------------
def test_the_chat_template_renders_a_scene():
    prompt, reply = render_chat(MESSAGES)
    assert prompt == ("A street.\n\n"
                      f"{USER}:\nGood morrow!\n\n"
                      f"{ASSISTANT}:\nAnd to you.\n\n"
                      f"{USER}:\nWhither goest thou?\n\n"
                      f"{ASSISTANT}:\n")
    assert reply == ASSISTANT and END_OF_TURN == "\n\n"
    named = [{"role": "user", "name": "HAMLET", "content": "To be?"},
             {"role": "assistant", "name": "HORATIO", "content": "My lord."},
             {"role": "developer", "content": "  "},  # an empty stage direction: nothing
             {"role": "user", "name": "HAMLET", "content": "Or not\r\n\r\n\n  to be."}]
    prompt, reply = render_chat(named)
    assert prompt == "HAMLET:\nTo be?\n\nHORATIO:\nMy lord.\n\nHAMLET:\nOr not\nto be.\n\nHORATIO:\n"
    assert reply == "HORATIO"
    assert speech(" a\n \n\tb \n") == "a\nb"  # a turn never holds a blank line
    assert render_chat([{"role": "user", "content": ""}])[0] == f"{USER}:\n\n{ASSISTANT}:\n"
    with pytest.raises(ValueError, match="role"):
        render_chat([{"role": "tool", "content": "x"}])


def test_the_shipped_model_answers_a_chat_in_one_turn():
    model, tok = mf.load_pretrained("shakespeare")
    with running_server(model, tok, model_name="shakespeare", max_num_seqs=4) as url:
        c = client(url)
        for seed in (None, 1, 2):
            r = c.chat.completions.create(
                model="shakespeare", temperature=0 if seed is None else 0.8, seed=seed,
                messages=[{"role": "user", "content": "Good morrow, fair lady. How dost thou?"}])
            text = r.choices[0].message.content
            assert text and "\n\n" not in text and not text.startswith("\n"), text
            assert r.choices[0].finish_reason == "stop"  # the speech ended: not max_tokens
            assert r.usage.completion_tokens < 100


# ---- chat through the openai client --------------------------------------------------------
def test_chat_equals_generate_of_the_rendered_conversation(served):
    url, engine, model, tok = served
    r = client(url).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40,
                                            temperature=0, stop=["zz"])
    prompt, _ = render_chat(MESSAGES)
    [ref] = mf.generate(model, [prompt], mf.SamplingParams(temperature=0, max_new_tokens=40,
                                                           stop=("zz", END_OF_TURN)), tok)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "tiny"
    msg = r.choices[0].message
    assert (msg.role, msg.content) == ("assistant", ref.text)
    assert r.choices[0].finish_reason == {"eos": "stop"}.get(ref.finish_reason, ref.finish_reason)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(tok.encode(prompt)),
                                                                  ref.completion_tokens)
    assert r.choices[0].logprobs is None


def test_chat_streamed_deltas_make_the_whole_answer(served):
    url, engine, _, _ = served
    c = client(url)
    kw = dict(model="tiny", messages=MESSAGES, max_completion_tokens=30, temperature=0)
    whole = c.chat.completions.create(**kw)
    chunks = list(c.chat.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finish[-1] == whole.choices[0].finish_reason and not any(finish[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert len({ch.id for ch in chunks}) == 1


def test_chat_errors_name_the_parameter(served):
    url, _, _, _ = served
    c = client(url)
    for kw, param in (({"messages": []}, "messages"),
                      ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
                      ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
                      ({"messages": [{"role": "user", "content": "x", "name": "A:B"}]},
                       "messages[0].name"),
                      ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                       "messages[0].content"),
                      ({"top_logprobs": 2}, "top_logprobs"),
                      ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
                      ({"tools": [{"type": "function"}]}, "tools"),
                      ({"n": 2}, "n")):
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], **kw}
        r = httpx.post(f"{url}/v1/chat/completions", json=body)
        assert r.status_code == 400, (kw, r.text)
        assert r.json()["error"]["param"] == param, (kw, r.json())
    with pytest.raises(openai.BadRequestError, match="context length"):
        c.chat.completions.create(model="tiny", max_tokens=100,
                                  messages=[{"role": "user", "content": "x" * 120}])


# ---- logprobs ------------------------------------------------------------------------------
def test_completion_logprobs_are_the_models_log_softmax(served):
    url, engine, model, tok = served
    prompt = "To be or"
    r = client(url).completions.create(model="tiny", prompt=prompt, max_tokens=10, logprobs=3,
                                       temperature=0.7, seed=3)
    choice = r.choices[0]
    lp = choice.logprobs
    ids = [byte_id(t) for t in lp.tokens]  # the byte tokenizer: one byte per token
    assert len(lp.tokens) == r.usage.completion_tokens == len(lp.token_logprobs)
    assert tok.decode(ids) == choice.text
    ref = log_softmax_at(model, tok.encode(prompt), ids)
    for pos, (t, value, top) in enumerate(zip(ids, lp.token_logprobs, lp.top_logprobs)):
        assert value == pytest.approx(ref[pos, t].item(), abs=1e-4)
        best = ref[pos].topk(3)
        expected = {tok.token_to_text(i): v for i, v in zip(best.indices.tolist(),
                                                             best.values.tolist())}
        expected.setdefault(lp.tokens[pos], value)  # the chosen token is always listed
        assert top == pytest.approx(expected, abs=1e-4)
    # each offset indexes into the text: where the character that the token's first byte
    # begins (or continues) stands; a whole-character token is found there
    utf8, chars, offsets = codecs.getincrementaldecoder("utf-8")("replace"), 0, []
    for t in ids:
        offsets.append(chars)
        chars += len(utf8.decode(bytes([t])))
    assert lp.text_offset == offsets
    assert chars + len(utf8.decode(b"", final=True)) == len(choice.text)
    for token, t, offset in zip(lp.tokens, ids, lp.text_offset):
        if t < 128:
            assert choice.text[offset:offset + len(token)] == token


def test_chat_logprobs_plain_and_streamed(served):
    url, engine, model, tok = served
    c = client(url)
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True,
              top_logprobs=2)
    r = c.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    ids = [e.bytes[0] for e in content]
    ref = log_softmax_at(model, tok.encode(render_chat(MESSAGES)[0]), ids)
    for pos, e in enumerate(content):
        assert e.logprob == pytest.approx(ref[pos, ids[pos]].item(), abs=1e-4)
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob)  # greedy: the top token
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(
            ref[pos].topk(2).values.tolist(), abs=1e-4)
        assert e.token == tok.token_to_text(ids[pos])
    streamed = [e for ch in c.chat.completions.create(**kw, stream=True)
                if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = c.chat.completions.create(**{**kw, "top_logprobs": None})  # logprobs only
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)


def test_echo_with_prompt_logprobs_scores_a_continuation(served):
    """What lm-eval's log-likelihood tasks send: prompt = context + continuation, echo, one
    new token, logprobs; the continuation's score is the sum of its tokens' logprobs."""
    url, engine, model, tok = served
    context, continuation = tok.encode("The quick"), tok.encode(" brown fox")
    r = httpx.post(f"{url}/v1/completions", json={
        "model": "tiny", "prompt": [context + continuation], "max_tokens": 1, "temperature": 0,
        "logprobs": 1, "echo": True}).json()
    choice = r["choices"][0]
    lp = choice["logprobs"]
    prompt = context + continuation
    assert choice["text"].startswith("The quick brown fox")
    assert len(lp["tokens"]) == len(prompt) + 1 and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt]))[0].float(), -1)
    expected = sum(ref[p - 1, prompt[p]].item() for p in range(len(context), len(prompt)))
    assert sum(lp["token_logprobs"][len(context):len(prompt)]) == pytest.approx(expected,
                                                                                abs=1e-3)
    for p in range(1, len(prompt)):
        top = lp["top_logprobs"][p]
        assert max(top.values()) == pytest.approx(ref[p - 1].max().item(), abs=1e-4)
    streamed = client(url).completions.create(model="tiny", prompt="Hi", max_tokens=3, echo=True,
                                              temperature=0, stream=True)
    whole = client(url).completions.create(model="tiny", prompt="Hi", max_tokens=3, echo=True,
                                           temperature=0)
    assert "".join(ch.choices[0].text for ch in streamed) == whole.choices[0].text
    assert whole.choices[0].text.startswith("Hi")


def test_min_tokens_and_logit_bias(tiny_model):
    tok = mf.ByteTokenizer()
    model = scripted_gpt(tok.encode("Hello world.") + [256])
    with running_server(model, tok, model_name="s") as url:
        c = client(url)
        short = c.completions.create(model="s", prompt="Hello", max_tokens=30, temperature=0)
        assert (short.choices[0].text, short.choices[0].finish_reason) == (" world.", "stop")
        longer = c.completions.create(model="s", prompt="Hello", max_tokens=30, temperature=0,
                                      extra_body={"min_tokens": 12})
        assert longer.usage.completion_tokens >= 12
        assert longer.choices[0].text.startswith(" world.")
        with pytest.raises(openai.BadRequestError, match="min_tokens"):
            c.completions.create(model="s", prompt="Hello", max_tokens=3,
                                 extra_body={"min_tokens": 4})
    with running_server(tiny_model, tok, model_name="tiny") as url:
        c = client(url)
        kw = dict(model="tiny", prompt="Hello", max_tokens=1, temperature=0, logprobs=1)
        first = c.completions.create(**kw).choices[0].logprobs.tokens[0]
        banned = c.completions.create(**kw, logit_bias={str(byte_id(first)): -100})
        assert banned.choices[0].logprobs.tokens[0] != first
        forced = c.completions.create(**kw, logit_bias={str(ord("Q")): 100})
        assert forced.choices[0].text == "Q"


# ---- models --------------------------------------------------------------------------------
def test_models_list_the_fields_clients_read(served):
    url, _, _, _ = served
    c = client(url)
    [m] = c.models.list().data
    assert (m.id, m.object, m.owned_by) == ("tiny", "model", "minifer")
    raw = httpx.get(f"{url}/v1/models").json()["data"][0]
    assert raw["root"] == "tiny" and raw["parent"] is None and raw["max_model_len"] == 128
    assert raw["permission"][0]["allow_logprobs"] is True
    assert c.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4")


def test_a_checkpoint_without_a_chat_template_gets_a_400_naming_messages():
    """A base model's folder has no chat template: chat is refused with the reason, naming
    ``messages``, instead of the play form the shipped models use (or a 500)."""
    from minifer.engine.errors import APIError
    from minifer.serve.protocol import Limits, parse_chat_request

    tok = mf.ByteTokenizer()
    tok.checkpoint_folder = "/models/base"  # as `load_hf_checkpoint` marks a folder's tokenizer
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
    with pytest.raises(APIError) as err:
        parse_chat_request(body, model_name="m", limits=Limits(max_model_len=128, max_tokens=16),
                           tokenizer=tok, vocab_size=257)
    assert err.value.status == 400 and err.value.param == "messages"
    assert "no chat template" in err.value.message and "/v1/completions" in err.value.message
