"""The generation loop: cached == recomputed, batching, streaming, stop conditions, input errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import on_device
from minifer import (
    ByteTokenizer,
    Completion,
    GPTConfig,
    SamplingParams,
    TextStopper,
    default_device,
    generate,
    stream,
)

GREEDY = SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True)
PROMPTS = [
    [72, 101, 108, 108, 111],  # "Hello"
    [7],
    list(range(40, 75)),
    [200, 3, 3, 3, 250, 1, 9],
]


def _tokens(completions):
    return [c.token_ids for c in completions]


# ---- cached == recomputed ------------------------------------------------------------------
def test_cached_equals_recomputed_greedy_64_tokens(model, device):
    """Claim KV-2: the KV cache changes the cost, never the output."""
    model = on_device(model, device)
    for prompt in PROMPTS:  # each prompt alone ...
        cached = generate(model, [prompt], GREEDY)[0]
        recomputed = generate(model, [prompt], GREEDY, use_cache=False)[0]
        assert cached.token_ids == recomputed.token_ids
        assert len(cached.token_ids) == 64 and cached.finish_reason == "length"
        assert len(set(cached.token_ids)) > 3  # a real sequence, not one token repeated
    # ... and as one left-padded batch
    assert _tokens(generate(model, PROMPTS, GREEDY)) == _tokens(
        generate(model, PROMPTS, GREEDY, use_cache=False))


def test_cached_equals_recomputed_with_sampling(model, device):
    model = on_device(model, device)
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.2,
                            max_new_tokens=32, seed=3, ignore_eos=True)
    assert _tokens(generate(model, PROMPTS, params)) == _tokens(
        generate(model, PROMPTS, params, use_cache=False))


# ---- batches of different lengths == each prompt alone ---------------------------------------
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True),
    SamplingParams(temperature=1.0, max_new_tokens=24, seed=7, ignore_eos=True),
    SamplingParams(temperature=0.7, top_k=10, top_p=0.8, repetition_penalty=1.5,
                   max_new_tokens=24, seed=1, ignore_eos=True),
], ids=["greedy", "seeded", "seeded-topk-topp-penalty"])
def test_batch_of_different_lengths_equals_each_prompt_alone(model, params, device):
    model = on_device(model, device)
    batched = generate(model, PROMPTS, params)
    alone = [generate(model, [p], params)[0] for p in PROMPTS]
    assert _tokens(batched) == _tokens(alone)
    assert [c.index for c in batched] == list(range(len(PROMPTS)))
    assert [c.prompt_token_ids for c in batched] == PROMPTS


@settings(max_examples=10, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, 256), min_size=1, max_size=24),
                        min_size=1, max_size=4),
       gqa=st.booleans())
def test_random_batches_equal_prompts_alone(tiny, tiny_gqa, prompts, gqa):
    model = tiny_gqa if gqa else tiny
    params = SamplingParams(temperature=0, max_new_tokens=8)  # EOS may end rows early too
    batched = generate(model, prompts, params)
    alone = [generate(model, [p], params)[0] for p in prompts]
    assert _tokens(batched) == _tokens(alone)
    assert [c.finish_reason for c in batched] == [c.finish_reason for c in alone]


# ---- prompt forms --------------------------------------------------------------------------
def test_prompt_forms_agree(tiny, tok):
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    ids = tok.encode("hi!")
    ref = generate(tiny, [ids], params)[0].token_ids
    for prompts in ["hi!", ["hi!"], ids, tuple(ids), [ids], torch.tensor(ids),
                    torch.tensor([ids]), [torch.tensor(ids)], torch.tensor(ids, dtype=torch.int32)]:
        out = generate(tiny, prompts, params, tok)
        assert len(out) == 1 and out[0].token_ids == ref, prompts
    two = generate(tiny, torch.tensor([ids, ids[::-1]]), params)
    assert len(two) == 2 and two[0].token_ids == ref


# ---- streaming -----------------------------------------------------------------------------
def test_stream_yields_the_tokens_of_generate_in_order(model, tok):
    params = SamplingParams(temperature=0, max_new_tokens=20)
    prompts = ["The cat", "a", "long prompt here"]
    done = generate(model, prompts, params, tok)
    completions: list[Completion] = []
    events = list(stream(model, prompts, params, tok, completions=completions))
    assert _tokens(completions) == _tokens(done)
    for b, c in enumerate(done):
        row = [e for e in events if e.index == b]
        assert [e.token_id for e in row] == c.token_ids
        assert [e.finish_reason for e in row[:-1]] == [None] * (len(row) - 1)
        assert row[-1].finish_reason == c.finish_reason  # exactly one finishing event, last
        assert "".join(e.text for e in row) == c.text == completions[b].text
        assert [e.time for e in row] == completions[b].token_times
    times = [e.time for e in events]
    assert times == sorted(times) and times[0] > 0
    assert sum(e.finish_reason is not None for e in events) == len(prompts)
    # within a step the rows come in order; a finished row yields nothing more
    finished: set[int] = set()
    for e in events:
        assert e.index not in finished
        if e.finish_reason is not None:
            finished.add(e.index)


def test_stream_is_lazy_and_can_be_abandoned(tiny):
    it = stream(tiny, [[1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=50,
                                                  ignore_eos=True))
    first = next(it)
    assert first.index == 0 and first.finish_reason is None and first.time > 0
    it.close()


def test_stream_appends_to_a_nonempty_completions_list(tiny):
    params = SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True)
    earlier = Completion(index=0, prompt_token_ids=[9], token_ids=[1, 2])
    results = [earlier]
    list(stream(tiny, [[1, 2], [3]], params, completions=results))
    assert results[0] is earlier and earlier.token_ids == [1, 2]  # untouched
    assert _tokens(results[1:]) == _tokens(generate(tiny, [[1, 2], [3]], params))


# ---- finish reasons ------------------------------------------------------------------------
def _script(tok, text: str, eos: bool = True) -> list[int]:
    return tok.encode(text) + ([tok.eos_token_id] if eos else [])


def test_scripted_model_recites_its_script(make_scripted, tok):
    """The helper model itself: it continues its script from any prefix, alone or batched."""
    script = _script(tok, "To be, or not to be: that is the question.")
    m = make_scripted(script)
    params = SamplingParams(temperature=0, max_new_tokens=60)
    out = generate(m, [script[:3], script[:10]], params, tok)
    assert out[0].text == "be, or not to be: that is the question."
    assert out[1].text == "not to be: that is the question."
    assert out[0].token_ids == script[3:] and out[1].token_ids == script[10:]


def test_finish_reason_length(make_scripted, tok):
    script = _script(tok, "abcdefghijklmnop")
    m = make_scripted(script)
    [c] = generate(m, [script[:2]], SamplingParams(temperature=0, max_new_tokens=5), tok)
    assert c.finish_reason == "length" and c.text == "cdefg"
    assert c.completion_tokens == 5 and c.prompt_tokens == 2


def test_finish_reason_eos(make_scripted, tok):
    script = _script(tok, "hi there")
    m = make_scripted(script)
    params = SamplingParams(temperature=0, max_new_tokens=50)
    [c] = generate(m, [script[:3]], params, tok)
    assert c.finish_reason == "eos"
    assert c.token_ids == tok.encode("there") + [256]  # the EOS token is reported ...
    assert c.text == "there"  # ... but never printed
    assert c.completion_tokens == 6
    [c] = generate(m, [script[:3]], params)  # no tokenizer: the model config's EOS id
    assert c.finish_reason == "eos" and c.text is None and c.token_ids[-1] == 256


def test_ignore_eos_keeps_going(make_scripted, tok):
    m = make_scripted(_script(tok, "ab"))
    [c] = generate(m, [[97]], SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True),
                   tok)
    assert c.finish_reason == "length" and c.token_ids[:2] == [98, 256]
    assert len(c.token_ids) == 4


def test_forced_eos_weights_end_at_the_first_token(tok):
    """A real model whose output head makes EOS win everywhere, whatever the input."""
    from minifer import GPT

    m = GPT.from_config("tiny-gqa", seed=3)
    with torch.no_grad():
        m.transformer.ln_f.weight.zero_()
        m.transformer.ln_f.bias.fill_(1.0)  # every position's final features = all ones
        m.lm_head.weight.zero_()
        m.lm_head.weight[256] = 1.0  # EOS logit 32, every other logit 0
    out = generate(m, ["abc", "x"], SamplingParams(temperature=1.0, seed=0), tok)
    assert [(c.finish_reason, c.token_ids, c.text) for c in out] == [("eos", [256], "")] * 2
    out = generate(m, [[1, 2]], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert out[0].token_ids == [256] * 3 and out[0].finish_reason == "length"


def test_rows_finish_independently(make_scripted, tok):
    """Rows at different points of the script hit EOS / the stop string at different steps."""
    script = _script(tok, "one two three four")
    m = make_scripted(script)
    prompts = [script[:2], script[:12], script[:6]]
    events = list(stream(m, prompts, SamplingParams(temperature=0, max_new_tokens=40,
                                                    stop=["three"]), tok))
    ends = {e.index: (e.finish_reason, i) for i, e in enumerate(events) if e.finish_reason}
    assert ends[0][0] == "stop" and ends[2][0] == "stop" and ends[1][0] == "eos"
    counts = [sum(e.index == b for e in events) for b in range(3)]
    assert counts == [len("e two three"), len("e four") + 1, len("o three")]


# ---- stop strings --------------------------------------------------------------------------
@pytest.mark.parametrize("text, prompt_len, stop, expected", [
    ("Hello world. The end", 2, ["world"], "llo "),  # 5 tokens: straddles by construction
    ("Hello world. The end", 2, [". "], "llo world"),
    ("Hello world. The end", 2, ["xyz", "The", "o w"], "ll"),  # earliest match wins
    ("Hello world. The end", 2, ["d"], "llo worl"),  # a one-token stop string
    ("Hello world. The end", 2, ["zzz"], "llo world. The end"),  # never matches: eos
    ("café😀 au lait", 1, ["é😀"], "af"),  # multi-byte characters straddling tokens
    ("café😀 au lait", 1, ["😀"], "afé"),
    ("naïve 日本語 text", 2, ["本語"], "ïve 日"),
    ("STOP then STOP", 4, ["STOP"], " then "),  # a stop string inside the prompt does not count
])
def test_stop_strings(make_scripted, tok, text, prompt_len, stop, expected):
    script = _script(tok, text)
    m = make_scripted(script)
    params = SamplingParams(temperature=0, max_new_tokens=60, stop=stop)
    [c] = generate(m, [script[:prompt_len]], params, tok)
    assert c.text == expected
    assert all(s not in c.text for s in stop)
    assert c.finish_reason == ("eos" if expected == tok.decode(script[prompt_len:]) else "stop")
    events = list(stream(m, [script[:prompt_len]], params, tok))
    assert "".join(e.text for e in events) == expected
    assert [e.token_id for e in events] == c.token_ids


def test_stop_text_is_held_back_while_streaming_then_released(make_scripted, tok):
    script = _script(tok, "xSTAR STOP!")
    m = make_scripted(script)
    params = SamplingParams(temperature=0, max_new_tokens=60, stop="STOP")
    deltas = [e.text for e in stream(m, [script[:1]], params, tok)]
    # "S", "ST" could start "STOP": held until "A" proves otherwise; the second "S", "T", "O"
    # are held and then cut with the "P", never shown.
    assert deltas == ["", "", "STA", "R", " ", "", "", "", ""]
    # stopped by max_new_tokens in the middle of a possible stop string: released at the end
    params = SamplingParams(temperature=0, max_new_tokens=8, stop="STOP")
    events = list(stream(m, [script[:1]], params, tok))
    assert [e.text for e in events] == ["", "", "STA", "R", " ", "", "", "STO"]
    assert events[-1].finish_reason == "length"
    [c] = generate(m, [script[:1]], params, tok)
    assert c.text == "STAR STO" and c.finish_reason == "length"
    # and at EOS
    m2 = make_scripted(_script(tok, "aST"))
    [c] = generate(m2, [[97]], SamplingParams(temperature=0, max_new_tokens=9, stop="STOP"), tok)
    assert c.text == "ST" and c.finish_reason == "eos"


def _reference_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """What the stream must print: the text up to the first stop string to complete, cut there."""
    for j in range(1, len(text) + 1):
        hits = [text[:j].find(s) for s in stops if s in text[:j]]
        if hits:
            return text[: min(hits)], True
    return text, False


ALPHABET = "ab é😀"


@settings(max_examples=25, deadline=None)
@given(text=st.text(alphabet=ALPHABET, min_size=1, max_size=24),
       stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), min_size=1,
                      max_size=3),
       max_new=st.integers(1, 80))
def test_streamed_stop_strings_property(make_scripted, tok, text, stops, max_new):
    """For any script and stop strings: printed text == reference, held-back text is only ever
    a possible stop-string start, no delta shows text that gets cut, no U+FFFD."""
    script = [ord(">")] + _script(tok, text)
    m = make_scripted(script)
    params = SamplingParams(temperature=0, max_new_tokens=max_new, stop=stops)
    gen = script[1:1 + max_new]
    if gen[-1] == 256:
        gen = gen[:-1]
    expected, stopped = _reference_stop(tok.decode(gen), stops)
    if not stopped:  # cut-off bytes at max_new_tokens decode to U+FFFD at the very end
        expected = tok.decode(gen)
    detok = tok.detokenizer()
    decoded, shown = "", ""
    events = list(stream(m, [script[:1]], params, tok))
    for e in events:
        decoded += detok.feed(e.token_id)
        shown += e.text
        if e.finish_reason is None:
            assert "\ufffd" not in e.text
            held = decoded[len(shown):]
            assert decoded.startswith(shown)
            assert held == "" or any(s.startswith(held) and s != held for s in stops)
    assert shown == expected
    assert events[-1].finish_reason == ("stop" if stopped else
                                        "eos" if len(gen) < max_new else "length")
    assert sum(e.finish_reason is not None for e in events) == 1


def test_text_stopper_directly(tok):
    s = TextStopper(tok, ["ab", "bcd"])
    out = [s.feed(i) for i in tok.encode("xab")]
    assert out == ["x", "", ""] and s.stopped  # "ab" completes before "bcd" could
    s = TextStopper(tok, ["ab", "bcd"])
    assert [s.feed(i) for i in tok.encode("bc")] == ["", ""] and not s.stopped
    assert s.flush() == "bc"  # the end: nothing can complete any more


# ---- usage and timings ---------------------------------------------------------------------
def test_usage_and_timings(tiny, tok):
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    out = generate(tiny, ["héllo", "a"], params, tok)
    assert [c.prompt_tokens for c in out] == [6, 1]  # UTF-8 bytes
    for c in out:
        assert c.completion_tokens == len(c.token_ids) == len(c.token_times) == 12
        assert math.isfinite(c.ttft) and c.ttft > 0
        assert math.isfinite(c.tpot) and c.tpot > 0
        assert len(c.itl) == 11 and all(g > 0 for g in c.itl)
        assert c.e2e >= c.ttft and c.token_times == sorted(c.token_times)
        assert c.text == tok.decode(c.token_ids)
    empty = Completion(index=0, prompt_token_ids=[1])
    assert math.isnan(empty.ttft) and math.isnan(empty.tpot) and empty.itl == []


def test_default_device_and_device_argument(tiny):
    dev = default_device()
    if torch.cuda.is_available():
        assert dev.type == "cuda"
    elif not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        assert dev == torch.device("cpu")
    params = SamplingParams(temperature=0, max_new_tokens=4)
    assert _tokens(generate(tiny, [[1, 2]], params, device="cpu")) == _tokens(
        generate(tiny, [[1, 2]], params, device=torch.device("cpu")))


def test_padded_model_vocab_never_samples_past_the_tokenizer(tok):
    """A model vocabulary larger than the tokenizer's (the reference: 1024 vs 257)."""
    from minifer import GPT

    m = GPT(GPTConfig.preset("tiny").replace(vocab_size=300))
    with torch.no_grad():
        m.lm_head.weight[257:] = 5.0  # make the unusable entries the most likely
    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=0, ignore_eos=True)
    [c] = generate(m.eval(), ["abc"], params, tok)
    assert all(t < 257 for t in c.token_ids)


# ---- bad input -----------------------------------------------------------------------------
P = SamplingParams(temperature=0, max_new_tokens=4)


@pytest.mark.parametrize("prompts, use_tok, match", [
    ("", True, "empty"),
    ([""], True, "empty"),
    ([[]], False, "empty"),
    ([[1], []], False, "prompt 1 is empty"),
    ([], False, "non-empty"),
    ((), False, "non-empty"),
    (None, False, "prompts"),
    (42, False, "prompts"),
    ("hello", False, "tokenizer"),
    (["a", [1, 2]], False, "tokenizer"),
    ([[1, -1]], False, "-1 outside the vocabulary"),
    ([1, 257], False, "257 outside the vocabulary"),
    ([[10**9]], False, "vocabulary"),
    ([1.0, 2.0], False, "integers"),
    ([[1, 2.5]], False, "integers"),
    ([[True, 2]], False, "integers"),
    ([["a", "b"]], False, "integers"),
    (torch.tensor([1.0, 2.0]), False, "integers"),
    ([torch.tensor([1.0, 2.0])], False, "integers"),
    (torch.tensor([True, False]), False, "integers"),
    (torch.zeros(1, 2, 3, dtype=torch.long), False, "1-D or 2-D"),
    (torch.tensor([[1, 300]]), False, "vocabulary"),
])
def test_bad_prompts_raise_clear_errors(tiny, tok, prompts, use_tok, match):
    with pytest.raises(ValueError, match=match):
        generate(tiny, prompts, P, tok if use_tok else None)
    with pytest.raises(ValueError, match=match):
        next(stream(tiny, prompts, P, tok if use_tok else None))


def test_prompt_plus_max_new_tokens_beyond_the_context(tiny, tok):
    ctx = tiny.config.context_length
    # The last new token is never fed back: prompt + max_new_tokens - 1 positions must fit.
    generate(tiny, [[1] * (ctx - 4)], SamplingParams(max_new_tokens=5))  # exactly fits
    for use_cache in (True, False):
        [full] = generate(tiny, [[1] * ctx], SamplingParams(max_new_tokens=1, temperature=0,
                                                          ignore_eos=True), use_cache=use_cache)
        assert full.completion_tokens == 1 and full.finish_reason == "length"
    with pytest.raises(ValueError, match="context window"):
        generate(tiny, [[1] * (ctx - 4)], SamplingParams(max_new_tokens=6))
    with pytest.raises(ValueError, match="context window"):
        generate(tiny, [[1] * ctx], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="prompt 1 .*context window"):
        generate(tiny, ["a", "b" * (ctx + 1)], SamplingParams(max_new_tokens=1), tok)
    with pytest.raises(ValueError, match="max_new_tokens=200"):
        generate(tiny, [[1]], SamplingParams(max_new_tokens=200))


def test_tokenizer_larger_than_the_model_vocab(tiny):
    big = ByteTokenizer(specials=("<|endoftext|>", "<|pad|>"))
    with pytest.raises(ValueError, match="tokenizer"):
        generate(tiny, "hi", P, big)


@pytest.mark.parametrize("bad", [
    dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2),
    dict(max_new_tokens=0), dict(stop=[""]),
])
def test_bad_sampling_params_raise_before_generating(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_stop_strings_need_a_tokenizer(tiny):
    with pytest.raises(ValueError, match="tokenizer"):
        generate(tiny, [[1, 2, 3]], SamplingParams(max_new_tokens=4, stop=["x"]))
