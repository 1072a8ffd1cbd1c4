"""Property-based tests: whatever a user passes to `SamplingParams`, `process_logits` or `sample`,
it either works or raises ValueError/TypeError — never another exception, never NaN, never a crash.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from minifer.sampling import SamplingParams, make_generators, process_logits, sample

PROPS = settings(max_examples=100, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
INF = float("inf")
FIELDS = ("temperature", "top_k", "top_p", "repetition_penalty", "max_new_tokens", "stop", "seed",
          "ignore_eos", "logit_bias")

numpy_scalars = st.one_of(
    st.integers(-(2**31), 2**31 - 1).map(np.int32),
    st.integers(0, 2**64 - 1).map(np.uint64),
    st.floats(width=32).map(np.float32),
    st.floats().map(np.float64),
    st.booleans().map(np.bool_),
)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-(2**70), 2**70), st.floats(),
    st.sampled_from([0, 1, 0.5, 1e-45, 5e-324, 1e308, 2**64 - 1, 2**64, -1, INF, -INF]),
    st.text(max_size=4), st.binary(max_size=4), st.complex_numbers(max_magnitude=2),
    numpy_scalars,
)
anything = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.tuples(inner, inner),
                            st.dictionaries(scalars, inner, max_size=3), st.frozensets(scalars)),
    max_leaves=6,
)


@PROPS
@given(kwargs=st.dictionaries(st.sampled_from(FIELDS), anything, max_size=4))
def test_sampling_params_either_valid_or_value_or_type_error(kwargs):
    try:
        p = SamplingParams(**kwargs)
    except (ValueError, TypeError):
        return
    # what was accepted is stored normalised: Python numbers, a tuple of str, an int -> float dict
    assert type(p.temperature) in (int, float) and p.temperature >= 0
    assert type(p.top_k) is int and p.top_k >= 0
    assert type(p.top_p) in (int, float) and 0 < p.top_p <= 1
    assert type(p.repetition_penalty) in (int, float) and p.repetition_penalty > 0
    assert type(p.max_new_tokens) is int and p.max_new_tokens >= 1
    assert isinstance(p.stop, tuple) and all(isinstance(s, str) and s for s in p.stop)
    assert p.seed is None or (type(p.seed) is int and 0 <= p.seed < 2**64)
    assert all(type(t) is int and t >= 0 and type(b) is float and not math.isnan(b)
               for t, b in p.logit_bias.items())
    make_generators(p, 2, torch.device("cpu"))  # torch takes the seed


# ---- process_logits / sample ----------------------------------------------------------------
logit_values = st.one_of(
    st.floats(-30, 30, width=32),
    st.sampled_from([0.0, INF, -INF, float("nan"), 3e38, -3e38, 1e-40, 1e20, -1e20]),
)
temperatures = st.one_of(st.sampled_from([0, 5e-324, 1e-300, 1e-45, 1e-38, 1e-6, 0.5, 1, 2,
                                          1e38, 1e300, INF]),
                         st.floats(0, 100))
biases = st.dictionaries(
    st.integers(0, 12),
    st.one_of(st.floats(-50, 50), st.sampled_from([INF, -INF, 1e300, -1e300, 3e38, -3e38])),
    max_size=6)


@st.composite
def sampling_cases(draw):
    B = draw(st.integers(1, 3))
    V = draw(st.integers(1, 12))
    rows = draw(st.lists(st.lists(logit_values, min_size=V, max_size=V), min_size=B, max_size=B))
    params = SamplingParams(
        temperature=draw(temperatures), top_k=draw(st.integers(0, 14)),
        top_p=draw(st.one_of(st.floats(1e-9, 1.0), st.just(1.0))),
        repetition_penalty=draw(st.one_of(st.floats(1e-3, 1e3),
                                          st.sampled_from([1.0, 1e-300, 1e300, INF]))),
        logit_bias=draw(biases), seed=draw(st.integers(0, 2**64 - 1)))
    seen = draw(st.one_of(st.none(), st.lists(st.booleans(), min_size=B * V, max_size=B * V)))
    logits = torch.tensor(rows, dtype=torch.float32)
    if seen is not None:
        seen = torch.tensor(seen).view(B, V)
    return logits, params, seen


def _expected_error(logits: torch.Tensor, params: SamplingParams) -> bool:
    """Must this input be refused? NaN logits, a bias past the vocabulary, or an empty row."""
    V = logits.shape[1]
    if any(t >= V for t in params.logit_bias):
        return True
    x = logits.clone()
    for t, b in params.logit_bias.items():  # a ±inf bias sets the logit, even over a NaN
        b32 = torch.tensor(b, dtype=torch.float32)
        x[:, t] = b32 if torch.isinf(b32) else x[:, t] + b32
    return bool(x.isnan().any() or (x == -INF).all(dim=-1).any())


@PROPS
@given(case=sampling_cases())
def test_process_logits_and_sample_never_nan_never_a_raw_error(case):
    logits, params, seen = case
    refused = _expected_error(logits, params)
    try:
        out = process_logits(logits, params, seen)
    except ValueError:
        if not refused:  # an extreme repetition_penalty can empty a row too
            assume(params.repetition_penalty != 1.0 and seen is not None)
        return
    assert not refused
    assert not out.isnan().any() and not (out == INF).any()
    support = out > -INF
    assert support.any(dim=-1).all()  # something left in every row
    gens = make_generators(params, logits.shape[0], torch.device("cpu"))
    tokens = sample(logits, params, seen, gens)
    assert tokens.shape == (logits.shape[0],)
    assert support[torch.arange(logits.shape[0]), tokens].all()  # drawn from the support


@settings(PROPS, max_examples=30)
@given(case=sampling_cases())
def test_sampling_reproducible_with_a_seed(case):
    logits, params, seen = case
    assume(not _expected_error(logits, params) and not params.greedy)
    try:
        a = sample(logits, params, seen, make_generators(params, logits.shape[0],
                                                          torch.device("cpu")))
    except ValueError:
        return
    b = sample(logits, params, seen, make_generators(params, logits.shape[0], torch.device("cpu")))
    assert torch.equal(a, b)


@pytest.mark.parametrize("logits, seen", [
    (torch.zeros(5), None),  # 1-D
    (torch.zeros(1, 0), None),  # no vocabulary
    (torch.zeros(2, 3, dtype=torch.long), None),  # not floats
    ([[0.0, 1.0]], None),  # not a tensor
    (torch.zeros(2, 3), torch.zeros(2, 4, dtype=torch.bool)),  # mask of another shape
    (torch.zeros(2, 3), torch.zeros(2, 3)),  # mask not bool
])
def test_bad_shapes_are_value_errors(logits, seen):
    with pytest.raises(ValueError, match="logits|seen"):
        sample(logits, SamplingParams(repetition_penalty=1.2), seen)


def test_wrong_number_of_generators():
    params = SamplingParams(seed=1)
    with pytest.raises(ValueError, match="generators"):
        sample(torch.zeros(3, 4), params, generators=make_generators(params, 2, "cpu"))
