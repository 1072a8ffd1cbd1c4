"""Speculative decoding in the serving engine (`minifer.engine.speculative`): greedy output is the
plain engine's, token for token, however requests share steps (preemption, chunked prefill,
prefix caching, several lengths at once); seeded sampling follows the target's distribution;
bad options are refused naming them; the server's ``--draft-model`` serves."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import httpx
import pytest
from test_speculative import N_NEW, PROMPT3, _exact_joint, _params, _peaky, _tv, _tv_bound

import minifer as mf
from conftest import lively_model, on_device
from minifer import LLMEngine, SamplingParams

PROMPTS = ["ROMEO:\n", "JULIET: O", "KING:", "A" * 40, "To be, or not to be, that is",
           "First Citizen:\nBefore we proceed any further, hear me speak."]
GREEDY = SamplingParams(temperature=0, max_new_tokens=24)


@pytest.fixture(scope="module")
def shakespeare():
    """The shipped model, its tokenizer and the shipped draft (a smaller model, same tokenizer)."""
    return mf.load_pretrained("shakespeare") + mf.load_pretrained("shakespeare-draft")[:1]


def _ids(outs) -> list[list[int]]:
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_equals_plain_engine_and_generate(shakespeare, k, device):
    model, tok, draft = (on_device(m, device) if i != 1 else m for i, m in enumerate(shakespeare))
    params = [SamplingParams(temperature=0, max_new_tokens=n) for n in (24, 5, 1, 17, 30, 2)]
    ref = [mf.generate(model, p, sp, tok)[0].token_ids for p, sp in zip(PROMPTS, params)]
    plain = LLMEngine(model, tok, max_num_seqs=3).generate(PROMPTS, params)
    engine = LLMEngine(model, tok, max_num_seqs=3, draft_model=draft, num_speculative_tokens=k)
    got = engine.generate(PROMPTS, params)
    assert _ids(got) == _ids(plain) == ref
    assert [o.text for o in got] == [o.text for o in plain]
    assert [len(o.token_ids) for o in got] == [24, 5, 1, 17, 30, 2]
    s = engine.speculative.stats
    assert 0 < s.accepted <= s.proposed and sum(s.accept_hist) == s.rounds
    assert s.draft_passes > 0 and s.tokens == s.accepted + s.rounds
    assert s.proposed <= k * s.rounds
    assert engine.block_manager.num_used_blocks == 0  # look-ahead blocks all given back
    engine.block_manager.check()


def test_concurrent_requests_added_while_others_decode(shakespeare):
    """Requests of different lengths join while others are mid-speculation; each one's tokens
    are the plain engine's."""
    model, tok, draft = shakespeare
    outs = []
    for extra in ({}, dict(draft_model=draft, num_speculative_tokens=3)):
        engine = LLMEngine(model, tok, max_num_seqs=4, **extra)
        final, rids = {}, []
        for i, prompt in enumerate(PROMPTS):
            rids.append(engine.add_request(prompt, SamplingParams(temperature=0,
                                                                  max_new_tokens=8 + 5 * i)))
            final.update((o.request_id, o) for o in engine.step() if o.finished)
        while engine.has_unfinished():
            final.update((o.request_id, o) for o in engine.step() if o.finished)
        outs.append([final[r].token_ids for r in rids])
    assert outs[0] == outs[1]


ENGINES = {
    "preempt": dict(max_num_seqs=6, block_size=4, num_blocks=30),
    "preempt-chunked-prefix": dict(max_num_seqs=6, block_size=4, num_blocks=30,
                                   enable_chunked_prefill=True, max_num_batched_tokens=12,
                                   enable_prefix_caching=True),
    "static": dict(policy="static", max_num_seqs=4, block_size=8),
}


@pytest.mark.parametrize("name", ENGINES)
def test_greedy_equals_plain_when_steps_are_crowded(shakespeare, name):
    """Preemption (the draft's K/V recomputed too), chunked prefill, shared prefixes."""
    model, tok, draft = shakespeare
    prompts = PROMPTS + ["ROMEO:\nWhat say", "ROMEO:\nWhat say you"]
    plain = LLMEngine(model, tok, **ENGINES[name]).generate(prompts, GREEDY)
    engine = LLMEngine(model, tok, draft_model=draft, num_speculative_tokens=3, **ENGINES[name])
    got = engine.generate(prompts, GREEDY)
    assert _ids(got) == _ids(plain)
    if "preempt" in name:
        assert engine.scheduler.num_preemptions > 0
    assert engine.speculative.stats.accepted > 0
    engine.block_manager.check()


def test_the_target_as_its_own_draft_accepts_nearly_everything(shakespeare):
    model, tok, _ = shakespeare
    engine = LLMEngine(model, tok, max_num_seqs=4, draft_model=model, num_speculative_tokens=4)
    got = engine.generate(PROMPTS[:4], GREEDY)
    assert _ids(got) == _ids(LLMEngine(model, tok, max_num_seqs=4).generate(PROMPTS[:4], GREEDY))
    s = engine.speculative.stats
    assert s.acceptance_rate > 0.9 and s.tokens_per_pass > 2


def test_processing_stops_logprobs_and_min_tokens_as_plain(shakespeare):
    """Repetition penalty (drafts count as seen), logit bias, stop strings, `logprobs` and
    `min_tokens` give what the plain engine gives."""
    model, tok, draft = shakespeare
    eos = tok.eos_token_id
    cases = [(SamplingParams(temperature=0, max_new_tokens=30, repetition_penalty=1.6), {}),
             (SamplingParams(temperature=0, max_new_tokens=30, logit_bias={198: 3.0}), {}),
             (SamplingParams(temperature=0, max_new_tokens=40, stop=["\n"]), {}),
             (GREEDY, dict(logprobs=3)),
             (SamplingParams(temperature=0, max_new_tokens=20, logit_bias={eos: 8.0}),
              dict(min_tokens=6))]
    for params, options in cases:
        outs = []
        for extra in ({}, dict(draft_model=draft, num_speculative_tokens=3)):
            engine = LLMEngine(model, tok, max_num_seqs=4, **extra)
            rids = [engine.add_request(p, params, **options) for p in PROMPTS[:4]]
            final = {}
            while engine.has_unfinished():
                final.update((o.request_id, o) for o in engine.step() if o.finished)
            outs.append([final[r] for r in rids])
        plain, spec = outs
        assert [(o.token_ids, o.text, o.finish_reason) for o in spec] == \
               [(o.token_ids, o.text, o.finish_reason) for o in plain], params
        if "logprobs" in options:
            for a, b in zip(spec, plain):
                assert [lp.token_id for lp in a.logprobs] == a.token_ids
                assert [lp.logprob for lp in a.logprobs] == pytest.approx(
                    [lp.logprob for lp in b.logprobs], abs=1e-4)


def test_seeded_sampling_follows_the_target_distribution():
    """Each request's own generator accepts and draws: the empirical distribution of the
    continuations is within the sampling noise of the target's exact one."""
    target, draft = _peaky(0), _peaky(5)
    exact = _exact_joint(target, PROMPT3, N_NEW, _params(0))
    n = 600
    engine = LLMEngine(target, None, max_num_seqs=64, draft_model=draft, num_speculative_tokens=2)
    outs = engine.generate([PROMPT3] * n, [_params(i) for i in range(n)])
    counts = Counter(tuple(o.token_ids) for o in outs)
    assert _tv(exact, counts, n) <= _tv_bound(exact, n)
    s = engine.speculative.stats
    assert s.rejections > 0 and s.accepted > 0  # the draft disagrees: the rule was at work
    # Reproducible for the same requests and options (not across batches: how many drafts a
    # request gets depends on the step's token budget, and so does which sample it draws).
    again = LLMEngine(target, None, max_num_seqs=64, draft_model=draft, num_speculative_tokens=2)
    assert _ids(again.generate([PROMPT3] * n, [_params(i) for i in range(n)])) == _ids(outs)


def test_bad_options_are_refused_naming_them(tiny):
    other_vocab = lively_model(mf.GPTConfig(vocab_size=300, context_length=64, n_layer=1,
                                            n_head=2, n_embd=16))
    short = lively_model(tiny.config.replace(context_length=16))
    for options, match in [
        (dict(draft_model="tiny"), "draft_model must be a minifer GPT"),
        (dict(draft_model=other_vocab), "draft_model and the target must share a vocabulary"),
        (dict(draft_model=tiny, num_speculative_tokens=0), r"num_speculative_tokens.*\[1, 16\]"),
        (dict(draft_model=tiny, num_speculative_tokens=17), r"num_speculative_tokens.*\[1, 16\]"),
        (dict(draft_model=tiny, num_speculative_tokens=2.0), "num_speculative_tokens"),
        (dict(num_speculative_tokens=3), "num_speculative_tokens needs a draft_model"),
        (dict(draft_model=short, max_model_len=32), r"max_model_len must be an integer in \[1, 16\]"),
    ]:
        with pytest.raises((ValueError, TypeError), match=match):
            LLMEngine(tiny, None, **options)
    engine = LLMEngine(tiny, None, draft_model=short)  # requests bounded by the draft's context
    assert engine.config.max_model_len == 16 and engine.config.num_speculative_tokens == 4


def test_options_rebuild_the_engine_with_the_same_draft(tiny):
    engine = LLMEngine(tiny, None, draft_model=tiny, num_speculative_tokens=2)
    assert engine.options["draft_model"] is tiny  # not a copy: `engine_process` shares it
    assert LLMEngine(tiny, None, **engine.options).config == engine.config
    assert LLMEngine(tiny, None).speculative is None


def _served_engine(monkeypatch, argv: list[str]):
    """The engine ``python -m minifer.serve ARGV`` builds (its server is never started)."""
    import minifer.serve.api as api
    from minifer.serve.__main__ import main

    apps = []
    monkeypatch.setattr(api, "make_server", lambda config: apps.append(config.app) or SimpleNamespace(
        run=lambda: None))
    assert main(["--device", "cpu", *argv]) == 0
    return apps[0].state.server.engine


def test_server_serves_with_a_draft_model(shakespeare, monkeypatch):
    """``--draft-model`` and ``--num-speculative-tokens`` reach the engine; its answers over
    HTTP (the engine in a process of its own) are the plain engine's."""
    from minifer_course.server import running_server

    engine = _served_engine(monkeypatch, ["--model", "shakespeare", "--draft-model",
                                          "shakespeare-draft", "--num-speculative-tokens", "3",
                                          "--max-num-seqs", "4"])
    assert engine.config.num_speculative_tokens == 3 and engine.speculative is not None
    assert _served_engine(monkeypatch, ["--model", "shakespeare"]).speculative is None
    model, tok, _ = shakespeare
    want = LLMEngine(model, tok).generate(PROMPTS[:2], SamplingParams(temperature=0,
                                                                       max_new_tokens=16))
    body = {"model": "shakespeare", "max_tokens": 16, "temperature": 0}
    with running_server(engine=engine, model_name="shakespeare", engine_in="process") as url:
        for prompt, w in zip(PROMPTS[:2], want):
            r = httpx.post(f"{url}/v1/completions", json=dict(body, prompt=prompt), timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == w.text


def test_the_server_refuses_bad_draft_options(monkeypatch, capsys):
    with pytest.raises(ValueError, match="tokenizer differs"):
        _served_engine(monkeypatch, ["--model", "shakespeare", "--draft-model", "tiny"])
    for argv in (["--num-speculative-tokens", "0"], ["--num-speculative-tokens", "17"]):
        with pytest.raises(SystemExit):  # argparse's error, before any model is loaded
            _served_engine(monkeypatch, ["--draft-model", "shakespeare-draft", *argv])
        assert "--num-speculative-tokens: invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--draft-model must be one of"):
        _served_engine(monkeypatch, ["--draft-model", "no-such-model"])
