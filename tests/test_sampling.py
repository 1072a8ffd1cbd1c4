"""SamplingParams validation and the logits processors (penalty → temperature → top-k → top-p)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minifer import SamplingParams, generate
from minifer.fast.argmax import first_argmax
from minifer.sampling import (
    apply_repetition_penalty,
    apply_top_k,
    apply_top_p,
    make_generators,
    process_logits,
    sample,
)

FAST = settings(max_examples=25, deadline=None)

# distinct float32 logits: no ties, so "the k largest" and "the smallest set" are unique
logit_lists = st.lists(st.floats(-30, 30, width=32), min_size=2, max_size=64, unique=True)


# ---- SamplingParams ------------------------------------------------------------------------
def test_defaults():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty) == (1.0, 0, 1.0, 1.0)
    assert p.stop == () and p.seed is None and not p.greedy
    assert SamplingParams(temperature=0).greedy


@pytest.mark.parametrize("name, value", [
    ("temperature", -0.1),
    ("temperature", float("nan")),
    ("temperature", "1"),
    ("temperature", True),
    ("temperature", None),
    ("top_p", 0),
    ("top_p", 0.0),
    ("top_p", -0.5),
    ("top_p", 1.01),
    ("top_p", float("nan")),
    ("top_p", False),
    ("top_k", -1),
    ("top_k", 2.0),
    ("top_k", 2.5),
    ("top_k", True),
    ("top_k", "5"),
    ("repetition_penalty", 0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", float("nan")),
    ("max_new_tokens", 0),
    ("max_new_tokens", -5),
    ("max_new_tokens", 3.0),
    ("max_new_tokens", True),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop", [3]),
    ("seed", 1.5),
    ("seed", True),
    ("seed", "7"),
])
def test_bad_parameters_raise_value_error_naming_the_parameter(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("name, value", [
    ("temperature", 0), ("temperature", 0.0), ("temperature", 2), ("top_p", 1), ("top_p", 1e-6),
    ("top_k", 0), ("top_k", 1), ("repetition_penalty", 0.5), ("max_new_tokens", 1), ("seed", 0),
])
def test_edge_values_are_accepted(name, value):
    assert getattr(SamplingParams(**{name: value}), name) == value


def test_stop_is_normalised_to_a_tuple():
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop=None).stop == ()
    p = SamplingParams(stop=["a"])
    assert isinstance(p.stop, tuple)
    with pytest.raises(AttributeError):
        p.temperature = 0.5


# ---- top-k / top-p -------------------------------------------------------------------------
@FAST
@given(values=logit_lists, data=st.data())
def test_top_k_keeps_exactly_the_k_largest(values, data):
    logits = torch.tensor([values])
    k = data.draw(st.integers(1, len(values)), label="k")
    out = apply_top_k(logits, k)
    kept = set(torch.isfinite(out[0]).nonzero().flatten().tolist())
    assert kept == set(torch.topk(logits[0], k).indices.tolist())
    assert torch.equal(out[0, list(kept)], logits[0, list(kept)])  # kept logits unchanged
    assert torch.equal(apply_top_k(logits, 0), logits)  # 0 = off


@FAST
@given(values=logit_lists, p=st.floats(0.001, 1.0))
def test_top_p_keeps_the_smallest_set_reaching_p(values, p):
    logits = torch.tensor([values])
    out = apply_top_p(logits, p)
    keep = torch.isfinite(out[0])
    probs = torch.tensor(values, dtype=torch.float64).softmax(-1)
    kept, dropped = probs[keep], probs[~keep]
    assert keep.any()
    if dropped.numel():
        assert kept.min() >= dropped.max()  # the most likely tokens
    assert kept.sum() >= p - 1e-5  # reaches p ...
    assert kept.sum() - kept.min() < p + 1e-5  # ... and no smaller top set does
    assert torch.equal(out[0, keep], logits[0, keep])


def test_top_p_examples():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    finite = lambda out: torch.isfinite(out[0]).tolist()  # noqa: E731
    assert finite(apply_top_p(logits, 0.5)) == [True, False, False, False]
    assert finite(apply_top_p(logits, 0.51)) == [True, True, False, False]
    assert finite(apply_top_p(logits, 0.9)) == [True, True, True, False]
    assert finite(apply_top_p(logits, 1e-6)) == [True, False, False, False]  # top one always kept
    assert torch.equal(apply_top_p(logits, 1.0), logits)


def test_top_k_then_top_p_order():
    # top-k first (keeps 0.5, 0.3, 0.15 → renormalised 0.526, 0.316, 0.158), then top-p 0.8
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    out = process_logits(logits, SamplingParams(top_k=3, top_p=0.8))
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]


# ---- repetition penalty, temperature, greedy -----------------------------------------------
def test_repetition_penalty_lowers_seen_tokens_positive_and_negative():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0]])
    seen = torch.tensor([[True, True, False, False, False]])
    out = apply_repetition_penalty(logits, seen, 2.0)
    assert out.tolist() == [[1.0, -2.0, 0.5, -3.0, 1.0]]  # CTRL: ÷ if positive, × if negative
    for i in (0, 1):  # each seen token alone becomes less likely
        only = torch.zeros_like(seen)
        only[0, i] = True
        before = logits.softmax(-1)[0, i]
        after = apply_repetition_penalty(logits, only, 1.3).softmax(-1)[0, i]
        assert after < before
    assert apply_repetition_penalty(logits, seen, 1.0) is logits  # 1 = off


@FAST
@given(values=logit_lists, penalty=st.floats(1.01, 5.0), data=st.data())
def test_repetition_penalty_never_raises_a_seen_logit(values, penalty, data):
    logits = torch.tensor([values])
    seen = torch.tensor([data.draw(st.lists(st.booleans(), min_size=len(values),
                                            max_size=len(values)))])
    out = apply_repetition_penalty(logits, seen, penalty)
    assert (out[seen] <= logits[seen]).all()
    # Strictly lower wherever float32 can represent the change (a subnormal x/penalty may
    # round back to x).
    moved = seen & (logits.abs() >= torch.finfo(torch.float32).tiny)
    assert (out[moved] < logits[moved]).all()
    assert torch.equal(out[~seen], logits[~seen])


def test_temperature_to_zero_approaches_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g)
    top2 = logits.topk(2, dim=-1).values
    logits[:, logits.argmax(-1)[0]] += 0  # (random logits have a clear winner per row:)
    assert (top2[:, 0] - top2[:, 1] > 0.005).all()
    best = logits.argmax(-1)
    prev = logits.softmax(-1).gather(1, best[:, None])
    for t in (0.5, 0.1, 0.01, 0.001, 1e-4):
        p = process_logits(logits, SamplingParams(temperature=t)).softmax(-1)
        p_best = p.gather(1, best[:, None])
        assert (p_best >= prev - 1e-6).all()  # more and more mass on the argmax
        prev = p_best
    assert (prev > 0.99).all()


def test_temperature_scales_logits():
    logits = torch.tensor([[1.0, 2.0, 4.0]])
    assert torch.equal(process_logits(logits, SamplingParams(temperature=2.0)),
                       logits / 2)
    assert torch.equal(process_logits(logits, SamplingParams(temperature=0)), logits)


@FAST
@given(values=logit_lists, k=st.integers(0, 5), p=st.floats(0.05, 1.0))
def test_greedy_is_argmax(values, k, p):
    logits = torch.tensor([values, values[::-1]])
    params = SamplingParams(temperature=0, top_k=k, top_p=p, seed=3)
    assert torch.equal(sample(logits, params), logits.argmax(-1))
    assert make_generators(params, 2, torch.device("cpu")) is None  # greedy needs no RNG


@FAST
@given(rows=st.integers(1, 4), vocab=st.integers(1, 300), chunk=st.integers(1, 40),
       levels=st.integers(1, 6), specials=st.lists(st.sampled_from([math.inf, -math.inf, math.nan]),
                                                   max_size=3), seed=st.integers(0, 999))
def test_first_argmax_is_torch_argmax(rows, vocab, chunk, levels, specials, seed):
    """The chunked argmax picks what torch's argmax picks: the first maximum, with ties (few
    distinct values), ±inf, NaN, a short last chunk and rows of one chunk or less."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(levels, (rows, vocab), generator=g).float()
    for i, value in enumerate(specials):
        logits.view(-1)[(seed * (i + 7)) % logits.numel()] = value
    assert torch.equal(first_argmax(logits, chunk), logits.argmax(-1))


def test_first_argmax_on_a_vocabulary_of_gpt2s_size():
    logits = torch.randn(16, 50257, generator=torch.Generator().manual_seed(2))
    logits[3, 50256] = logits[5, 0] = logits[7, 25000] = 100.0  # the last, first, a middle entry
    logits[9, 100] = logits[9, 40000] = 100.0  # a tie: the first one wins
    assert torch.equal(first_argmax(logits), logits.argmax(-1))
    assert first_argmax(logits)[9] == 100


def test_top_k_1_sampling_is_greedy():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    assert torch.equal(sample(logits, SamplingParams(top_k=1)), logits.argmax(-1))


# ---- drawing tokens ------------------------------------------------------------------------
@FAST
@given(values=logit_lists, k=st.integers(0, 8), p=st.floats(0.05, 1.0),
       seed=st.integers(0, 2**31 - 1))
def test_sampled_tokens_lie_in_the_top_k_top_p_support(values, k, p, seed):
    logits = torch.tensor([values]).expand(200, -1)
    params = SamplingParams(temperature=0.7, top_k=k, top_p=p, seed=seed)
    support = torch.isfinite(process_logits(logits[:1], params))[0]
    gens = [torch.Generator().manual_seed(seed + i) for i in range(200)]
    tokens = sample(logits, params, generators=gens)
    assert tokens.shape == (200,)
    assert support[tokens].all()


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).log().expand(20_000, -1)
    torch.manual_seed(0)
    counts = torch.bincount(sample(logits, SamplingParams()), minlength=4) / 20_000
    assert torch.allclose(counts, torch.tensor([0.1, 0.2, 0.3, 0.4]), atol=0.015)


def test_same_seed_same_generators_same_tokens():
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(seed=11)
    a = [sample(logits, params, generators=make_generators(params, 3, torch.device("cpu")))
         for _ in range(2)]
    assert torch.equal(a[0], a[1])
    assert make_generators(SamplingParams(), 3, torch.device("cpu")) is None  # no seed


def test_generate_same_seed_same_tokens_different_seeds_differ(tiny):
    def run(seed):
        params = SamplingParams(temperature=1.0, max_new_tokens=20, seed=seed, ignore_eos=True)
        return generate(tiny, [[1, 2, 3]], params)[0].token_ids

    assert run(5) == run(5)
    runs = {tuple(run(s)) for s in range(5)}
    assert len(runs) == 5


def test_generated_tokens_lie_in_the_support_of_the_processed_logits(tiny):
    """End to end: every sampled token is inside top-k ∩ top-p of the model's logits then."""
    params = SamplingParams(temperature=1.5, top_k=5, top_p=0.6, repetition_penalty=1.3,
                            max_new_tokens=24, seed=1, ignore_eos=True)
    prompt = [10, 20, 30, 40]
    toks = generate(tiny, [prompt], params)[0].token_ids
    assert len(toks) == 24
    seq = list(prompt)
    with torch.inference_mode():
        for t in toks:
            logits = tiny(torch.tensor([seq]))[:, -1]
            seen = torch.zeros(1, tiny.config.vocab_size, dtype=torch.bool)
            seen[0, seq] = True
            support = torch.isfinite(process_logits(logits, params, seen))[0]
            assert 1 <= int(support.sum()) <= 5
            assert support[t], f"token {t} outside the support {support.nonzero().flatten()}"
            seq.append(t)
    assert len(set(toks)) > 1


def test_top_p_nan_free_with_extreme_logits():
    logits = torch.tensor([[1e4, -1e4, 0.0, float("-inf")]])
    out = process_logits(logits, SamplingParams(top_p=0.5, top_k=3))
    assert not out.isnan().any()
    assert torch.isfinite(out[0]).tolist() == [True, False, False, False]
    assert math.isclose(out.softmax(-1)[0, 0].item(), 1.0)


def test_draw_is_inverse_cdf_on_torch_rand():
    """The token a seed gives is the same on every torch version: `draw` uses only torch.rand's
    stream (stable across releases, unlike torch.multinomial's algorithm) and a cumulative sum."""
    from minifer.sampling import draw

    probs = torch.tensor([[0.1, 0.0, 0.2, 0.7], [0.5, 0.5, 0.0, 0.0]])
    u = torch.rand((2, 1), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    expected = [next(i for i, c in enumerate(row.double().cumsum(0)) if c > x * row.sum())
                for row, x in zip(probs, u[:, 0])]
    assert draw(probs, torch.Generator().manual_seed(3)).tolist() == expected
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.stack([draw(probs[0], g) for _ in range(4000)]), minlength=4)
    assert counts[1] == 0  # a zero weight is never drawn
    assert (counts.double() / 4000 - probs[0].double()).abs().max() < 0.03  # in proportion


# ---- edge inputs (issue 14): never NaN, never a raw torch error ------------------------------
INF = float("inf")


def _draws(logits, params, n=400, seed=0):
    rows = logits.expand(n, -1)
    gens = [torch.Generator().manual_seed(seed + i) for i in range(n)]
    return sample(rows, params, generators=gens)


@pytest.mark.parametrize("temperature", [0, 1e-45, 0.7, 1.0, 5.0, INF])
def test_plus_inf_bias_forces_the_token(temperature):
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=temperature, top_k=3, top_p=0.5, logit_bias={17: INF})
    out = process_logits(logits, params)
    assert not out.isnan().any() and not (out == INF).any()
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [17]
    assert set(_draws(logits, params).tolist()) == {17}


def test_several_plus_inf_biases_share_the_draw_evenly():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(logit_bias={3: INF, 40: INF, 7: -INF})
    counts = torch.bincount(_draws(logits, params, n=2000), minlength=50)
    assert set(counts.nonzero().flatten().tolist()) == {3, 40}
    assert abs(int(counts[3]) - 1000) < 120  # uniform over the forced tokens
    greedy = SamplingParams(temperature=0, logit_bias={3: INF, 40: INF})
    assert sample(logits, greedy).tolist() == [3]  # greedy: the lowest forced id


def test_plus_inf_bias_forces_the_token_in_generate(tiny):
    params = SamplingParams(max_new_tokens=6, seed=0, logit_bias={65: INF}, ignore_eos=True)
    assert generate(tiny, [[1, 2]], params)[0].token_ids == [65] * 6


def test_minus_inf_bias_on_every_token_is_a_value_error():
    logits = torch.randn(2, 5)
    ban_all = {t: -INF for t in range(5)}
    for temperature in (0, 1.0):
        with pytest.raises(ValueError, match="logit_bias"):
            sample(logits, SamplingParams(temperature=temperature, logit_bias=ban_all))
    # banning all but one leaves that one
    params = SamplingParams(logit_bias={t: -INF for t in range(4)})
    assert sample(logits, params).tolist() == [4, 4]


def test_minus_inf_bias_on_every_usable_token_of_a_padded_vocabulary(tiny):
    from minifer import GPT, ByteTokenizer
    model = GPT.from_config(tiny.config.replace(vocab_size=300))  # 257 usable, 43 padding
    params = SamplingParams(max_new_tokens=2, logit_bias={t: -INF for t in range(257)})
    with pytest.raises(ValueError, match="logit_bias"):
        generate(model, "hi", params, ByteTokenizer())


def test_an_empty_row_made_by_repetition_penalty_blames_it_not_logit_bias():
    """A -inf bias bans one token and the penalty sends every other (seen, negative) logit to
    -inf: the error names repetition_penalty, not logit_bias, which left tokens to draw."""
    logits = torch.tensor([[-5.0, -6.0, -7.0, -8.0]])
    seen = torch.ones_like(logits, dtype=torch.bool)
    for bias in ({0: -INF}, {}):
        params = SamplingParams(temperature=0, repetition_penalty=1e38, logit_bias=bias)
        with pytest.raises(ValueError, match="repetition_penalty=1e\\+38 drives every") as err:
            sample(logits, params, seen)
        assert "bans (-inf) every token" not in str(err.value)
        assert ("logit_bias does not ban" in str(err.value)) == bool(bias)
    with pytest.raises(ValueError, match="logit_bias bans \\(-inf\\) every token"):
        sample(logits, SamplingParams(repetition_penalty=1e38,
                                      logit_bias=dict.fromkeys(range(4), -INF)), seen)


@pytest.mark.parametrize("temperature", [1e-45, 1e-300, 1e-38])
def test_tiny_temperature_is_the_argmax_limit(temperature):
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(1)) * 10
    params = SamplingParams(temperature=temperature)
    out = process_logits(logits, params)
    assert not out.isnan().any()
    assert torch.equal(sample(logits, params), logits.argmax(-1))
    tied = torch.tensor([[3.0, 5.0, 5.0, -1.0]])  # the limit splits the mass between ties
    assert process_logits(tied, params).softmax(-1).tolist() == [[0.0, 0.5, 0.5, 0.0]]


def test_huge_logits_do_not_overflow_a_small_temperature():
    logits = torch.tensor([[3e38, 1e38, 0.0, -3e38]])
    out = process_logits(logits, SamplingParams(temperature=0.5))
    assert not out.isnan().any()
    assert out.softmax(-1)[0].tolist() == [1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("temperature", [INF, 1e300])
def test_infinite_temperature_is_uniform_over_the_allowed_tokens(temperature):
    logits = torch.randn(1, 8, generator=torch.Generator().manual_seed(2))
    logits[0, 5:] = -INF  # a padded vocabulary, or banned tokens
    params = SamplingParams(temperature=temperature)
    out = process_logits(logits, params)
    assert not out.isnan().any()
    assert torch.equal(out.softmax(-1)[0, :5], torch.full((5,), 0.2))
    assert set(_draws(logits, params).tolist()) == {0, 1, 2, 3, 4}


def test_nan_logits_are_a_value_error():
    logits = torch.tensor([[0.0, float("nan"), 1.0]])
    for temperature in (0, 1.0):
        with pytest.raises(ValueError, match="NaN"):
            sample(logits, SamplingParams(temperature=temperature))


def test_bias_for_a_token_past_the_logits_is_a_value_error():
    with pytest.raises(ValueError, match=r"logit_bias.*token id 9.*\[0, 5\)"):
        process_logits(torch.zeros(1, 5), SamplingParams(logit_bias={9: 1.0}))


@pytest.mark.parametrize("name, value", [
    ("stop", 5),
    ("stop", b"END"),
    ("stop", {"a": 1}),
    ("logit_bias", "abc"),
    ("logit_bias", [(1, 2.0)]),
    ("logit_bias", {1: "x"}),
    ("logit_bias", {"a": 1.0}),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {1: float("nan")}),
    ("seed", 2**64),
    ("seed", -1),
    ("temperature", 1j),
    ("max_new_tokens", 2**100 + 0.5),
])
def test_wrong_types_raise_value_error_naming_the_parameter(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


def test_numpy_scalars_are_accepted_as_python_numbers():
    np = pytest.importorskip("numpy")
    p = SamplingParams(temperature=np.float32(0.5), top_p=np.float64(0.9), top_k=np.int64(3),
                       repetition_penalty=np.float16(1.5), max_new_tokens=np.int32(7),
                       seed=np.uint64(2**64 - 1), logit_bias={np.int64(4): np.float32(2.0)})
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.max_new_tokens) == (
        0.5, 0.9, 3, 1.5, 7)
    assert type(p.temperature) is float and type(p.top_k) is int
    assert type(p.max_new_tokens) is int and p.seed == 2**64 - 1 and type(p.seed) is int
    assert p.logit_bias == {4: 2.0} and type(next(iter(p.logit_bias))) is int
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=np.float64(3.0))  # a float is not a count, numpy or not
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=np.bool_(True))


def test_seed_range_is_what_torch_takes():
    for seed in (0, 2**63, 2**64 - 1):
        assert len(make_generators(SamplingParams(seed=seed), 1, torch.device("cpu"))) == 1


def test_logit_bias_none_and_mappings_are_accepted():
    from types import MappingProxyType
    assert SamplingParams(logit_bias=None).logit_bias == {}
    assert SamplingParams(logit_bias=MappingProxyType({3: -1})).logit_bias == {3: -1.0}


# ---- ties: top-k and top-p both keep every token tied with the boundary ------------------------
def test_top_p_keeps_all_tokens_tied_with_the_boundary_token():
    logits = torch.tensor([[2.0, 1.0, 2.0, 2.0, 0.0]])  # three tokens tied at the top
    # one of them alone already holds p = 0.1; the other two tie with it and are kept too
    assert torch.isfinite(apply_top_p(logits, 0.1))[0].tolist() == [True, False, True, True, False]
    assert torch.isfinite(apply_top_k(logits, 1))[0].tolist() == [True, False, True, True, False]
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0, -2.0]])
    p0 = logits.softmax(-1)[0, 0].item()  # the boundary falls on one of the tied 1.0s
    kept = torch.isfinite(apply_top_p(logits, p0 + 0.01))[0].tolist()
    assert kept == [True, True, True, True, False]
    assert torch.isfinite(apply_top_k(logits, 2))[0].tolist() == kept


@pytest.mark.parametrize("value", ["false", "true", 1, 0, None])
def test_ignore_eos_takes_only_a_bool(value):
    """A truthy string such as "false" used to switch it on."""
    with pytest.raises(ValueError, match="ignore_eos must be True or False"):
        SamplingParams(ignore_eos=value)
    assert SamplingParams(ignore_eos=True).ignore_eos is True
