"""The workload generator: seeded, reproducible, real prompts, the distributions it promises."""

import math
import random
import statistics

import pytest

import minifer as mf
from minifer_course.workload import (
    LogNormal,
    Request,
    Uniform,
    as_lengths,
    corpus_ids,
    poisson_workload,
)


def test_reproducible_and_sorted():
    a = poisson_workload(50, rate=4.0, seed=3)
    b = poisson_workload(50, rate=4.0, seed=3)
    c = poisson_workload(50, rate=4.0, seed=4)
    assert a == b and a != c
    arrivals = [r.arrival_s for r in a]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    assert [r.request_id for r in a] == [f"req-{i}" for i in range(50)]
    assert all(16 <= r.prompt_len <= 64 and 16 <= r.max_new_tokens <= 64 for r in a)


def test_rate_only_rescales_arrivals():
    slow = poisson_workload(30, rate=2.0, seed=1, prompt_len=(8, 40), output_len=(4, 9))
    fast = poisson_workload(30, rate=8.0, seed=1, prompt_len=(8, 40), output_len=(4, 9))
    assert [r.prompt for r in slow] == [r.prompt for r in fast]
    assert [r.max_new_tokens for r in slow] == [r.max_new_tokens for r in fast]
    for s, f in zip(slow, fast):
        assert f.arrival_s == pytest.approx(s.arrival_s / 4, rel=1e-9, abs=1e-12)


def test_poisson_gaps_have_the_rate():
    reqs = poisson_workload(4000, rate=5.0, seed=0, prompt_len=4, output_len=4,
                            source="random", vocab_size=10)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(reqs, reqs[1:])]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(0.2, rel=0.05)  # 1 / rate; 4,000 draws: ~1.6% standard error
    # exponential: the standard deviation equals the mean; gamma with burstiness 4 is 2x smaller
    assert statistics.pstdev(gaps) == pytest.approx(mean, rel=0.08)
    even = poisson_workload(4000, rate=5.0, seed=0, prompt_len=4, output_len=4,
                            source="random", vocab_size=10, burstiness=4.0)
    egaps = [b.arrival_s - a.arrival_s for a, b in zip(even, even[1:])]
    assert statistics.fmean(egaps) == pytest.approx(0.2, rel=0.05)
    assert statistics.pstdev(egaps) == pytest.approx(0.1, rel=0.08)


def test_infinite_rate_is_an_offline_batch():
    reqs = poisson_workload(5, rate=math.inf, seed=0)
    assert {r.arrival_s for r in reqs} == {0.0}


def test_prompts_are_real_corpus_text():
    tok = mf.Tokenizer.from_file(mf.pretrained.model_files("shakespeare")[2])
    ids = corpus_ids()
    reqs = poisson_workload(20, rate=1.0, seed=0, prompt_len=(30, 60))
    text = mf.pretrained.load_validation_text()
    for r in reqs:
        assert max(r.prompt) < tok.vocab_size
        # a contiguous window of the tokenized corpus
        starts = [i for i in range(len(ids) - r.prompt_len + 1)
                  if ids[i] == r.prompt[0] and ids[i:i + r.prompt_len] == r.prompt]
        assert starts
    # and its text is in the plays (the middle of the window decodes to corpus text)
    middle = tok.decode(reqs[0].prompt[5:-5])
    assert middle.strip() and middle in text


def test_given_tokenizer():
    tok = mf.ByteTokenizer()
    reqs = poisson_workload(10, rate=1.0, seed=0, prompt_len=20, tokenizer=tok)
    text = mf.pretrained.load_validation_text()
    for r in reqs:
        assert r.prompt_len == 20 and max(r.prompt) < 256
        assert bytes(r.prompt).decode("utf-8", "replace")[2:-2] in text


def test_shared_system_prompt():
    base = poisson_workload(10, rate=1.0, seed=0, prompt_len=(5, 10))
    shared = poisson_workload(10, rate=1.0, seed=0, prompt_len=(5, 10), system_prompt_len=40)
    system = shared[0].prompt[:40]
    for b, s in zip(base, shared):
        assert s.prefix_len == 40 and s.prompt[:40] == system
        assert s.prompt[40:] == b.prompt  # the requests' own parts are unchanged
        assert s.prompt_len == b.prompt_len + 40
    assert base[0].prefix_len == 0


def test_random_source():
    reqs = poisson_workload(10, rate=1.0, seed=0, source="random", vocab_size=7, prompt_len=12)
    assert all(r.prompt_len == 12 and set(r.prompt) <= set(range(7)) for r in reqs)


def test_length_distributions():
    rng = random.Random(0)
    u = [Uniform(3, 6).sample(rng) for _ in range(2000)]
    assert set(u) == {3, 4, 5, 6}
    ln = LogNormal(median=50, sigma=1.0, lo=2, hi=1000)
    xs = [ln.sample(rng) for _ in range(4000)]
    assert 2 <= min(xs) and max(xs) <= 1000
    assert statistics.median(xs) == pytest.approx(50, rel=0.1)
    assert statistics.fmean(xs) > 1.4 * statistics.median(xs)  # a long tail: mean ≈ 1.65 × median
    assert as_lengths(7) == Uniform(7, 7) and as_lengths((2, 9)) == Uniform(2, 9)
    reqs = poisson_workload(200, rate=1.0, seed=0, output_len=ln, source="random", vocab_size=5)
    assert len({r.max_new_tokens for r in reqs}) > 20


def test_request_params():
    r = Request(prompt=[1, 2, 3], max_new_tokens=9, arrival_s=0.0)
    p = r.params()
    assert (p.max_new_tokens, p.temperature, p.ignore_eos) == (9, 0.0, True)
    assert r.params(temperature=0.7, seed=1).temperature == 0.7
    assert r.prompt_len == 3


@pytest.mark.parametrize("kwargs, match", [
    (dict(n=0, rate=1.0), "n must be"),
    (dict(n=3, rate=0.0), "rate"),
    (dict(n=3, rate=-1.0), "rate"),
    (dict(n=3, rate=1.0, source="wiki"), "source"),
    (dict(n=3, rate=1.0, source="random"), "vocab_size"),
    (dict(n=3, rate=1.0, burstiness=0.0), "burstiness"),
    (dict(n=3, rate=1.0, prompt_len=(10, 5)), "prompt_len"),
    (dict(n=3, rate=1.0, output_len=0), "output_len"),
    (dict(n=3, rate=1.0, system_prompt_len=-1), "system_prompt_len"),
    (dict(n=3, rate=1.0, seed=-1), "seed"),
    (dict(n=3, rate=1.0, prompt_len=10**6), "do not fit"),
])
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        poisson_workload(**kwargs)


def test_bad_length_spec_types():
    with pytest.raises(TypeError, match="output_len"):
        poisson_workload(3, 1.0, output_len=[1, 2])
    with pytest.raises(ValueError, match="sigma"):
        LogNormal(10, 0, 1, 5)
