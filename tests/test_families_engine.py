"""Every engine feature on the Llama, Qwen2 and Qwen3 families (tiny random models imported from
`transformers`, whose logits test_families.py checks): the fixed-shape decode step, the serving
engine (chunked prefill, preemption, prefix caching) equal to one request at a time,
int8/int4 weights and the int8 KV cache within the GPT-2 tests' bounds, speculative decoding
with a same-family draft equal to plain greedy, tensor parallelism on 2 ranks equal to 1."""

from __future__ import annotations

import pytest
import torch

import minifer as mf
from minifer import GPT, LLMEngine, SamplingParams, quantize
from minifer.speculative import ModelDrafter, speculative_generate

transformers = pytest.importorskip("transformers")
from test_families import VOCAB, hf_model  # noqa: E402  (after the importorskip)
from test_parallel import LOGIT_ATOL, reference, run_threads  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def family(request):
    return request.param, GPT.from_hf(hf_model(request.param))


def _prompts(n, lo, hi, seed, prefix=()):
    g = torch.Generator().manual_seed(seed)
    return [list(prefix) + torch.randint(3, VOCAB, (int(torch.randint(lo, hi + 1, (1,),
                                                                       generator=g)),),
                                         generator=g).tolist() for _ in range(n)]


def _alone(model, prompts, params=GREEDY):
    return [mf.generate(model, [p], params)[0].token_ids for p in prompts]


def test_fixed_shape_decode_step_equals_forward(family):
    """The fixed-shape lean step over the whole preallocated cache (the compiled/CUDA-graph
    step) gives the logits of a plain cached step: the rotation is applied at the slot's
    position."""
    from minifer.fast.decode import LeanStep

    _, m = family
    ids = torch.tensor([_prompts(1, 9, 9, 0)[0]])
    with torch.inference_mode():
        a = mf.StaticKVCache.for_model(m, 1, 16)
        b = mf.StaticKVCache.for_model(m, 1, 16)
        m(ids[:, :-1], cache=a)
        m(ids[:, :-1], cache=b)
        ref = m(ids[:, -1:], cache=a)[:, 0]
        got = mf.decode_step(m, ids[:, -1], b, step=LeanStep(fixed_shape=True))
    assert (got - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("kw", [
    dict(policy="continuous", max_num_seqs=6, enable_chunked_prefill=True,
         max_num_batched_tokens=16),
    dict(policy="continuous", max_num_seqs=8, block_size=4, num_blocks=24,
         enable_chunked_prefill=True, max_num_batched_tokens=12),  # preemption
    dict(policy="static", max_num_seqs=8, block_size=4, num_blocks=24),
], ids=["chunked", "preempt-chunked", "static-preempt"])
def test_serving_engine_equals_one_at_a_time(family, kw):
    _, m = family
    prompts = _prompts(10, 1, 40, seed=1)
    ref = _alone(m, prompts)
    assert len({tuple(r) for r in ref}) == len(ref)  # varied outputs: the test can fail
    assert [o.token_ids for o in LLMEngine(m, **kw).generate(prompts, GREEDY)] == ref


def test_prefix_caching_reuses_rotated_keys_at_the_same_positions(family):
    """A shared prefix's cached keys were rotated at the positions they are reused at."""
    _, m = family
    prompts = _prompts(6, 1, 10, seed=7, prefix=_prompts(1, 24, 24, seed=6)[0])
    ref = _alone(m, prompts)
    cached = LLMEngine(m, enable_prefix_caching=True, block_size=8, max_num_seqs=3)
    assert [o.token_ids for o in cached.generate(prompts, GREEDY)] == ref
    assert cached.block_manager.hit_blocks >= 3 * 3  # the 3 blocks of the prefix, 3 later prompts


@pytest.mark.filterwarnings("ignore:the fused int4 kernel rejects")
@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_quantized_weights_stay_close(family, precision):
    # init 0.1, not the 0.2 of the parity models: at 0.2 the activations are so large that a
    # GPT-2 of that init misses int8's 5% as well (it lands at 5.4%)
    m = GPT.from_hf(hf_model(family[0], initializer_range=0.1))
    q = quantize(m, precision, group_size=32)
    ids = torch.tensor([_prompts(1, 12, 12, 2)[0]])
    with torch.inference_mode():
        ref, out = m(ids), q(ids).float()
    tol = {"int8": 0.05, "int4": 0.5}[precision]  # the GPT-2 tests' bounds (test_quantize.py)
    assert (out - ref).abs().max() <= tol * ref.abs().max()
    assert len(mf.generate(q, ids, SamplingParams(temperature=0, max_new_tokens=4))[0]
               .token_ids) == 4


def test_int8_kv_cache_within_tolerance(family):
    _, m = family
    ids = torch.tensor([_prompts(1, 12, 12, 3)[0]])
    with torch.inference_mode():
        full = m(ids)
        cache = mf.StaticKVCache.for_model(m, 1, 32, dtype="int8")
        steps = torch.stack([m(ids[:, i:i + 1], cache=cache)[0, 0] for i in range(ids.shape[1])])
    assert (steps - full[0]).abs().max() <= 0.02 * full.abs().max()


def test_speculative_with_a_same_family_draft_equals_greedy(family):
    name, m = family
    draft = GPT.from_hf(hf_model(name, num_hidden_layers=1, hidden_size=32,
                                 intermediate_size=48, **({"head_dim": 8} if name == "qwen3"
                                                          else {})))
    for prompt in _prompts(3, 4, 12, seed=4):
        ref = mf.generate(m, [prompt], GREEDY)[0].token_ids
        for k in (2, 4):
            got = speculative_generate(m, ModelDrafter(draft), [prompt], GREEDY, k=k)[0]
            assert got.token_ids == ref


def test_tensor_parallel_two_ranks_equal_one(family):
    _, m = family
    prompt = [_prompts(1, 7, 7, 5)[0]]
    params = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    ref_tokens, ref_logits = reference(m, prompt, params)
    for r in run_threads(m, 2, prompt, params):
        assert r.token_ids == [ref_tokens]
        assert torch.allclose(torch.tensor(r.logits), ref_logits, atol=LOGIT_ATOL, rtol=0)


def test_tensor_parallel_two_processes_on_a_llama_preset():
    """Two real processes (gloo): the checkpoint the workers load carries the family switches."""
    from minifer.distributed.parallel import run_local

    model = GPT.from_config("tiny-llama", seed=1)
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    prompt = [[72, 101, 108, 108, 111, 44, 32]]
    ref_tokens, ref_logits = reference(model, prompt, params)
    res = run_local(model, prompt, 2, params, keep_logits=True)
    assert res.token_ids == [ref_tokens]
    for r in res.reports:
        assert torch.allclose(torch.tensor(r.logits), ref_logits, atol=LOGIT_ATOL, rtol=0)
