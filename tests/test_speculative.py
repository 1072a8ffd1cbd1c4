"""Speculative decoding: exact greedy output, exact sampling distribution, cache rollback, stats."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

import minifer as mf
import minifer.speculative as spec
from conftest import lively_model, on_device
from minifer import ByteTokenizer, GPTConfig, SamplingParams
from minifer.pretrained import model_files
from minifer.sampling import process_logits
from minifer.speculative import (
    ModelDrafter,
    PromptLookupDrafter,
    SpecStats,
    expected_speedup,
    expected_tokens_per_pass,
    speculative_generate,
)

PROMPTS = ["Hello", "ab", "The quick brown fox jumps over", "abcabcabcabc"]


@pytest.fixture(scope="module")
def draft():
    """A different (smaller-width-equal, GQA, other seed) random model: it agrees only sometimes."""
    return lively_model("tiny-gqa", seed=1)


def _drafters(draft_model):
    return [ModelDrafter(draft_model), PromptLookupDrafter()]


# ---- greedy: exactly the target's output -----------------------------------------------------
@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_equals_target_greedy(tiny, draft, tok, k, device):
    tiny, draft = on_device(tiny, device), on_device(draft, device)
    params = SamplingParams(temperature=0, max_new_tokens=24)
    for prompt in PROMPTS:
        ref = mf.generate(tiny, prompt, params, tok)[0]
        for drafter in _drafters(draft):
            got = speculative_generate(tiny, drafter, prompt, params, k=k, tokenizer=tok)[0]
            assert got.token_ids == ref.token_ids, (prompt, k, drafter.name)
            assert got.text == ref.text and got.finish_reason == ref.finish_reason
            assert len(got.token_times) == len(got.token_ids)


def test_greedy_with_penalty_bias_and_stop_strings(tiny, draft, tok):
    """Repetition penalty (drafts count as seen), logit bias and stop strings behave as generate."""
    base = SamplingParams(temperature=0, max_new_tokens=30)
    text = mf.generate(tiny, "Hello", base, tok)[0].text
    stop = text[10:12]
    cases = [
        SamplingParams(temperature=0, max_new_tokens=30, repetition_penalty=1.5),
        SamplingParams(temperature=0, max_new_tokens=30, logit_bias={ord("e"): 3.0}),
        SamplingParams(temperature=0, max_new_tokens=30, stop=[stop]),
        SamplingParams(temperature=0, max_new_tokens=30, top_k=3, top_p=0.5),
    ]
    for params in cases:
        ref = mf.generate(tiny, "Hello", params, tok)[0]
        for k in (1, 3, 6):
            for drafter in _drafters(draft):
                got = speculative_generate(tiny, drafter, "Hello", params, k=k, tokenizer=tok)[0]
                assert (got.token_ids, got.text, got.finish_reason) == (
                    ref.token_ids, ref.text, ref.finish_reason), (params, k, drafter.name)
    assert mf.generate(tiny, "Hello", cases[2], tok)[0].finish_reason == "stop"


def test_eos_inside_an_accepted_chunk(make_scripted, tok):
    """A draft identical to the target accepts whole chunks; EOS in the middle ends the output."""
    script = list(b"Say: abcdefgh") + [256] + list(b"ignored tail")
    target = make_scripted(script)
    prompt = script[:5]
    params = SamplingParams(temperature=0, max_new_tokens=40)
    ref = mf.generate(target, prompt, params, tok)[0]
    assert ref.finish_reason == "eos"
    for k in (2, 3, 5, 8):
        got = speculative_generate(target, target, prompt, params, k=k, tokenizer=tok)[0]
        assert (got.token_ids, got.text, got.finish_reason) == (ref.token_ids, ref.text, "eos")
        assert got.stats.accepted == got.stats.proposed  # the draft is the target: all accepted
        assert got.stats.target_passes < len(got.token_ids)


@pytest.mark.parametrize("max_new", [1, 2, 3, 5, 9, 17])
def test_max_new_tokens_never_exceeded(tiny, max_new, tok):
    params = SamplingParams(temperature=0, max_new_tokens=max_new, ignore_eos=True)
    ref = mf.generate(tiny, "abc", params, tok)[0]
    for k in (1, 4, 8):
        got = speculative_generate(tiny, tiny, "abc", params, k=k, tokenizer=tok)[0]
        assert got.token_ids == ref.token_ids and len(got.token_ids) == max_new
        assert got.finish_reason == "length"


def test_several_prompts_run_one_by_one(tiny, draft, tok):
    params = SamplingParams(temperature=0, max_new_tokens=12)
    refs = mf.generate(tiny, PROMPTS, params, tok)
    got = speculative_generate(tiny, draft, PROMPTS, params, k=3, tokenizer=tok)
    assert [g.index for g in got] == list(range(len(PROMPTS)))
    assert [g.token_ids for g in got] == [r.token_ids for r in refs]
    total = got[0].stats
    for g in got[1:]:
        total = total.merge(g.stats)
    assert total.prompts == len(PROMPTS) and total.tokens == sum(len(r.token_ids) for r in refs)


@pytest.mark.skipif(not model_files("shakespeare")[0].is_file(),
                    reason="shipped target checkpoint not written yet (python -m minifer_course.training)")
def test_shipped_pair_greedy_identical(device):
    target, tokenizer = mf.load_pretrained("shakespeare", device=device)
    draft_model, draft_tok = mf.load_pretrained("shakespeare-draft", device=device)
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    for prompt in ("ROMEO:\nBut soft, what light", "First Citizen:\n"):
        ref = mf.generate(target, prompt, params, tokenizer)[0]
        for drafter in (ModelDrafter(draft_model), PromptLookupDrafter()):
            got = speculative_generate(target, drafter, prompt, params, k=4, tokenizer=tokenizer,
                                       draft_tokenizer=draft_tok)[0]
            assert got.token_ids == ref.token_ids and got.text == ref.text
        assert got.stats.target_passes <= len(ref.token_ids)


# ---- sampling: exactly the target's distribution ---------------------------------------------
V3 = GPTConfig(vocab_size=3, context_length=16, n_layer=1, n_head=2, n_embd=16)
PROMPT3 = [0, 1]
N_NEW = 4  # first token from prefill, then a round of k=2 drafts + bonus (or more rounds)


def _peaky(seed: int) -> mf.GPT:
    return lively_model(V3, seed=seed, scale=40.0)


def _exact_joint(model, prompt, n, params) -> dict[tuple[int, ...], float]:
    """P(all n-token continuations) under `params`' logits processing, by enumeration."""
    out = {}
    with torch.inference_mode():
        for seq in itertools.product(range(V3.vocab_size), repeat=n):
            ids = list(prompt) + list(seq)
            logits = model(torch.tensor([ids]))[0, len(prompt) - 1:-1]  # (n, V)
            seen = torch.zeros(n, V3.vocab_size, dtype=torch.bool)
            for i in range(n):
                seen[i, ids[:len(prompt) + i]] = True
            probs = process_logits(logits, params, seen).softmax(-1)
            out[seq] = float(probs[torch.arange(n), torch.tensor(seq)].prod())
    return out


def _tv(exact: dict, counts: Counter, n: int) -> float:
    return 0.5 * sum(abs(p - counts[s] / n) for s, p in exact.items())


def _tv_bound(exact: dict, n: int, q: float = 0.999, reps: int = 4000) -> float:
    """The q-quantile of TV(empirical, exact) for n honest samples from `exact` (simulated)."""
    outcomes = list(exact)
    p = torch.tensor([exact[s] for s in outcomes], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    draws = torch.multinomial(p, n * reps, replacement=True, generator=gen).view(reps, n)
    counts = torch.zeros(reps, len(p), dtype=torch.float64).scatter_add_(
        1, draws, torch.ones_like(draws, dtype=torch.float64))
    tv = 0.5 * (counts / n - p).abs().sum(1)
    return float(tv.quantile(q))


def _spec_counts(target, drafter, params_for, n, k=2, accept=spec.accept_with_ratio) -> Counter:
    counts = Counter()
    for i in range(n):
        c = speculative_generate(target, drafter, PROMPT3, params_for(i), k=k, accept=accept)[0]
        counts[tuple(c.token_ids)] += 1
    return counts


def _params(seed, **kw):
    return SamplingParams(temperature=1.0, max_new_tokens=N_NEW, seed=seed, ignore_eos=True, **kw)


def test_sampling_matches_target_distribution(device):
    target, draft_model = _peaky(0), _peaky(5)
    exact = _exact_joint(target, PROMPT3, N_NEW, _params(0))  # on the CPU, by enumeration
    draft_exact = _exact_joint(draft_model, PROMPT3, N_NEW, _params(0))
    assert 0.5 * sum(abs(exact[s] - draft_exact[s]) for s in exact) > 0.5  # they disagree a lot
    target, drafter = on_device(target, device), ModelDrafter(on_device(draft_model, device))
    counts = _spec_counts(target, drafter, _params, 600)
    small = Counter()
    for i in range(150):  # the first 150 runs are a sub-sample
        small[tuple(speculative_generate(target, drafter, PROMPT3, _params(i), k=2)[0].token_ids)] += 1
    tv_small, tv_big = _tv(exact, small, 150), _tv(exact, counts, 600)
    bound_small, bound_big = _tv_bound(exact, 150), _tv_bound(exact, 600)
    assert bound_big < bound_small
    assert tv_small <= bound_small and tv_big <= bound_big, (tv_small, tv_big, bound_big)
    assert tv_big < tv_small  # more samples, closer to the target's distribution


def test_sampling_with_processing_and_prompt_lookup_matches_target():
    """top-k, temperature and repetition penalty applied to p and q alike; a deterministic
    drafter (prompt lookup: q one-hot) is exact too."""
    target, draft_model = _peaky(0), _peaky(5)
    kw = dict(temperature=0.8, top_k=2, repetition_penalty=1.5)

    def params(i):
        return SamplingParams(max_new_tokens=N_NEW, seed=i, ignore_eos=True, **kw)

    exact = _exact_joint(target, PROMPT3, N_NEW, params(0))
    bound = _tv_bound(exact, 300)
    for drafter in (ModelDrafter(draft_model), PromptLookupDrafter(max_ngram=2)):
        counts = _spec_counts(target, drafter, params, 300)
        assert _tv(exact, counts, 300) <= bound, drafter.name


def test_wrong_acceptance_rule_fails_the_check():
    """Always accepting the draft gives the draft's distribution, which the same check rejects."""
    target, draft_model = _peaky(0), _peaky(5)
    exact = _exact_joint(target, PROMPT3, N_NEW, _params(0))
    counts = _spec_counts(target, ModelDrafter(draft_model), _params, 150,
                          accept=lambda p_d, q_d, u: torch.ones_like(p_d, dtype=torch.bool))
    assert _tv(exact, counts, 150) > _tv_bound(exact, 150)


def test_sampling_is_reproducible_with_a_seed(tiny, draft, tok):
    params = SamplingParams(temperature=1.0, max_new_tokens=20, seed=7)
    a = speculative_generate(tiny, draft, "Hello", params, k=3, tokenizer=tok)[0]
    b = speculative_generate(tiny, draft, "Hello", params, k=3, tokenizer=tok)[0]
    assert a.token_ids == b.token_ids and len(a.token_ids) == 20


def test_acceptance_rule_guards():
    u = torch.tensor([0.0, 0.5, 0.5, 0.99])
    p = torch.tensor([0.0, 0.3, 0.6, 0.1])
    q = torch.tensor([0.0, 0.0, 0.3, 0.2])
    # q = 0 and p = 0: reject; q = 0, p > 0: accept; p ≥ q: accept; p/q = 0.5 with u = 0.99: reject
    assert spec.accept_with_ratio(p, q, u).tolist() == [False, True, True, False]


# ---- caches and stats --------------------------------------------------------------------------
def _assert_cache_equals_prefill(model, cache, ids):
    fresh = mf.StaticKVCache.for_model(model, 1, cache.max_len)
    with torch.inference_mode():
        model(torch.tensor([ids]), cache=fresh)
    assert cache.pos == fresh.pos == len(ids)
    for layer in range(cache.n_layer):
        for mine, ref in ((cache.k[layer], fresh.k[layer]), (cache.v[layer], fresh.v[layer])):
            torch.testing.assert_close(mine[:, :, :len(ids)], ref[:, :, :len(ids)],
                                       rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rollback_leaves_caches_equal_to_fresh_prefill(tiny, draft, temperature):
    prompt = [72, 101, 108, 108, 111]
    params = SamplingParams(temperature=temperature, max_new_tokens=23, seed=3, ignore_eos=True)
    for k in (1, 3, 5):
        drafter = ModelDrafter(draft)
        cache = mf.StaticKVCache.for_model(tiny, 1, 64)
        out = speculative_generate(tiny, drafter, prompt, params, k=k, target_cache=cache)[0]
        assert out.stats.accepted < out.stats.proposed  # some drafts were rolled back
        seq = prompt + out.token_ids
        _assert_cache_equals_prefill(tiny, cache, seq[:-1])  # the last token is never fed
        _assert_cache_equals_prefill(draft, drafter.cache, seq[:drafter.n_cached])
        # the draft lags by at most dk + the bonus token, plus one token from a last round that
        # had room for no draft at all
        assert drafter.n_cached >= len(seq) - 3


def test_stats_are_consistent(tiny, draft, tok):
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    for k in (1, 4, 8):
        for drafter in _drafters(draft):
            s = speculative_generate(tiny, drafter, "abcabcabc", params, k=k, tokenizer=tok)[0].stats
            assert s.k == k and len(s.accept_hist) == k + 1
            assert 0 <= s.accepted <= s.proposed <= k * s.rounds
            assert sum(s.accept_hist) == s.rounds == s.target_passes - 1
            assert sum(j * n for j, n in enumerate(s.accept_hist)) == s.accepted
            assert s.tokens == 40 == s.accepted + s.target_passes  # no early stop here
            assert s.draft_passes == (1 + s.proposed if isinstance(drafter, ModelDrafter) else 0)
            assert s.draft_time_s >= 0 and s.target_time_s > 0
            assert s.wall_time_s >= s.target_time_s
            assert 0 <= s.acceptance_rate <= 1 and s.tokens_per_pass >= 1


def test_prompt_lookup_finds_latest_match():
    seq = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert PromptLookupDrafter.lookup(seq, 2, max_ngram=3) == [7, 8]
    assert PromptLookupDrafter.lookup(seq, 4, max_ngram=3) == [7, 8, 1, 2]
    assert PromptLookupDrafter.lookup([5, 6, 7], 3) == []  # nothing repeats: no proposal
    assert PromptLookupDrafter.lookup([4, 5, 4], 3, max_ngram=2) == [5, 4]  # falls back to 1-gram


def test_repetitive_text_accepts_more_with_prompt_lookup(make_scripted, tok):
    passage = list(b"to be or not to be, that is the question. ")
    target = make_scripted(passage * 2)
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    got = speculative_generate(target, PromptLookupDrafter(), passage + passage[:4], params, k=6)[0]
    assert got.stats.acceptance_rate > 0.75 and got.stats.tokens_per_pass > 4


def test_expected_speedup_formula():
    assert expected_tokens_per_pass(0.0, 4) == 1.0
    assert expected_tokens_per_pass(1.0, 4) == 5.0
    assert abs(expected_tokens_per_pass(0.5, 2) - 1.75) < 1e-12
    assert abs(expected_speedup(0.8, 4, 0.05) - (1 - 0.8**5) / 0.2 / 1.2) < 1e-12
    s = SpecStats(k=2)
    assert s.accept_hist == [0, 0, 0] and s.tokens_per_pass != s.tokens_per_pass  # nan


# ---- errors ------------------------------------------------------------------------------------
def test_errors(tiny, draft, tok):
    params = SamplingParams(temperature=0, max_new_tokens=20)
    other_vocab = mf.GPT.from_config(GPTConfig(vocab_size=300, context_length=128, n_layer=1,
                                               n_head=2, n_embd=16, eos_token_id=256))
    with pytest.raises(ValueError, match="share a vocabulary"):
        speculative_generate(tiny, other_vocab, "hi", params, tokenizer=tok)
    with pytest.raises(ValueError, match="tokenizer differs"):
        speculative_generate(tiny, draft, "hi", params, tokenizer=tok,
                             draft_tokenizer=ByteTokenizer(("<|endoftext|>", "<|pad|>")))
    for bad_k in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="k \\(draft tokens"):
            speculative_generate(tiny, draft, "hi", params, k=bad_k, tokenizer=tok)
    with pytest.raises(ValueError, match="context window.*target"):
        speculative_generate(tiny, draft, "x" * 120, params, tokenizer=tok)
    short = mf.GPT.from_config(GPTConfig(vocab_size=257, context_length=32, n_layer=1, n_head=2,
                                         n_embd=16, eos_token_id=256))
    with pytest.raises(ValueError, match="context window.*draft"):
        speculative_generate(tiny, short, "x" * 20, params, tokenizer=tok)
    with pytest.raises(ValueError, match="draft must be"):
        speculative_generate(tiny, "not a model", "hi", params, tokenizer=tok)
    with pytest.raises(ValueError, match="stop strings"):
        speculative_generate(tiny, draft, [1, 2], SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookupDrafter(max_ngram=0)
    with pytest.raises(ValueError, match="target_cache"):
        speculative_generate(tiny, draft, "hi", params, tokenizer=tok,
                             target_cache=mf.StaticKVCache.for_model(tiny, 1, 8))
