"""minifer.sequence: one request's state, and the checks every loop shares."""

from __future__ import annotations

import pytest
import torch

import minifer as mf
from conftest import lively_model
from minifer import SamplingParams, generate, speculative_generate, stream
from minifer.sequence import Sequence, prepare


@pytest.fixture(scope="module")
def draft():
    return lively_model("tiny-gqa", seed=1)


def test_append_finishes_on_eos_length_and_stop(tok):
    p = SamplingParams(max_new_tokens=3)
    s = Sequence(0, [1, 2], p, eos_ids={9})
    assert [s.append(t, 0.1 * i).finish_reason for i, t in enumerate([5, 6, 7])] == [None, None, "length"]
    assert s.finished and s.output_ids == [5, 6, 7] and s.num_tokens == 5 and s.max_len == 4
    with pytest.raises(RuntimeError, match="already finished"):
        s.append(1, 1.0)
    e = Sequence(0, [1], p, eos_ids={9})
    assert e.append(9, 0.0).finish_reason == "eos"
    several = Sequence(0, [1], p, eos_ids={9, 11})  # any of a model's end-of-sequence ids
    assert several.append(11, 0.0).finish_reason == "eos"
    ignore = Sequence(0, [1], SamplingParams(max_new_tokens=3, ignore_eos=True), eos_ids={9})
    assert ignore.append(9, 0.0).finish_reason is None
    st = Sequence(0, [1], SamplingParams(max_new_tokens=10, stop=["lo"]), tok)
    events = [st.append(t, 0.0) for t in tok.encode("hel")]
    assert "".join(ev.text for ev in events) == "he"  # "l" held back: it may start "lo"
    last = st.append(tok.encode("o")[0], 0.0)
    assert last.finish_reason == "stop" and st.result.text == "he"  # "helo" cut at "lo"


def test_prepare_builds_one_sequence_per_prompt(tiny, tok):
    req = prepare(tiny, ["ab", [1, 2, 3]], SamplingParams(max_new_tokens=2), tok)
    assert [s.prompt_ids for s in req.sequences] == [tok.encode("ab"), [1, 2, 3]]
    assert [s.index for s in req.sequences] == [0, 1] and req.vocab == tok.vocab_size
    assert req.device == torch.device("cpu")


@pytest.mark.parametrize("call, exc, match", [
    (lambda m, t: generate(m, [1, 2], "greedy"), TypeError, "params must be a SamplingParams"),
    (lambda m, t: generate(m, "hi", SamplingParams(), "bytes"), TypeError, "tokenizer must be"),
    (lambda m, t: generate(m, [5, [1, 2]]), ValueError, "mixes token ids and nested prompts"),
    (lambda m, t: generate(m, [[1, None]]), ValueError, "token ids must be integers"),
    (lambda m, t: generate(m, [[1, 2], 3.5]), ValueError, "mixes token ids"),
    (lambda m, t: generate(m, "a\ud800b", SamplingParams(), t), ValueError, "lone surrogate"),
    (lambda m, t: generate(m, [[1, 2], {"a": 1}]), ValueError, "mixes token ids"),
    (lambda m, t: generate(m, [[1, 2], {1, 2}]), ValueError, "mixes token ids"),
    (lambda m, t: speculative_generate(m, m, [1], accept="yes"), TypeError, "accept must be"),
])
def test_wrong_types_name_the_parameter(tiny, tok, call, exc, match):
    with pytest.raises(exc, match=match):
        call(tiny, tok)


def test_token_ids_may_be_numpy_or_tensor_scalars(tiny):
    np = pytest.importorskip("numpy")
    p = SamplingParams(temperature=0, max_new_tokens=3)
    ref = generate(tiny, [[1, 2, 3]], p)[0].token_ids
    assert generate(tiny, [np.int64(1), np.int32(2), 3], p)[0].token_ids == ref
    assert generate(tiny, [torch.tensor(1), torch.tensor(2), 3], p)[0].token_ids == ref


def test_logit_bias_that_bans_every_token_is_rejected(tiny, tok):
    bans = {t: float("-inf") for t in range(tok.vocab_size)}
    with pytest.raises(ValueError, match="logit_bias bans every token"):
        generate(tiny, "a", SamplingParams(logit_bias=bans), tok)


def test_every_loop_shares_the_length_check(tiny, draft):
    ctx = tiny.config.context_length
    p = SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True)
    full = [1] * ctx  # fits: the one new token is never fed back
    want = generate(tiny, full, p)[0].token_ids
    assert speculative_generate(tiny, draft, full, p, k=3)[0].token_ids == want
    assert len(list(stream(tiny, full, p))) == 1
    for run in (lambda: generate(tiny, full, SamplingParams(max_new_tokens=2)),
                lambda: speculative_generate(tiny, draft, full, SamplingParams(max_new_tokens=2))):
        with pytest.raises(ValueError, match="prompt tokens \\+ max_new_tokens - 1"):
            run()


def test_speculative_at_the_edge_of_the_context_equals_generate(tiny, draft):
    ctx = tiny.config.context_length
    p = SamplingParams(temperature=0, max_new_tokens=9, ignore_eos=True)
    prompt = [3, 4, 5, 6] * ((ctx - 8) // 4)
    prompt = prompt + [1] * (ctx - 8 - len(prompt))
    want = generate(tiny, prompt, p)[0].token_ids
    for d in (draft, mf.PromptLookupDrafter()):
        assert speculative_generate(tiny, d, prompt, p, k=4)[0].token_ids == want


def test_min_tokens_bans_every_end_of_sequence_id():
    import torch

    from minifer.engine.options import ban_early_eos

    seq = Sequence(0, [1], SamplingParams(max_new_tokens=4), eos_ids={3, 5})
    seq.min_tokens = 2
    logits = torch.zeros(1, 8)
    ban_early_eos(logits, [seq])
    assert logits[0].isinf().nonzero().flatten().tolist() == [3, 5]
