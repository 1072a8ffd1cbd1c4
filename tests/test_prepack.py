"""`prepack`: linear layers on weights prepacked for oneDNN give `F.linear`'s results up to float
rounding, the shipped model's greedy tokens unchanged, through `generate` and `LLMEngine`;
tied weights stay tied; clear errors for what cannot be packed."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn as nn

import minifer as mf
from conftest import engine_reading
from minifer.fast.prepack import PackedLinear, prepack, prepack_problem

pytestmark = pytest.mark.skipif(prepack_problem() is not None, reason=str(prepack_problem()))


@pytest.fixture(scope="module")
def shakespeare():
    return mf.load_pretrained("shakespeare")


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("bias", [True, False])
def test_a_packed_layer_equals_f_linear(dtype, tol, bias):
    if (why := prepack_problem(dtype)) is not None:
        pytest.skip(why)
    torch.manual_seed(0)
    lin = nn.Linear(96, 200, bias=bias).to(dtype)
    packed = PackedLinear.from_linear(lin, batch_size=4)
    assert packed.weight is lin.weight  # shared, not copied
    with torch.inference_mode():
        for shape in [(1, 96), (7, 96), (2, 5, 96)]:  # decode rows, a batch, a prompt
            x = torch.randn(shape).to(dtype)
            ref, got = lin(x), packed(x)
            assert got.shape == ref.shape and got.dtype == dtype
            assert (got.float() - ref.float()).abs().max() <= tol * ref.float().abs().max()


def test_gradients_use_the_plain_weight():
    lin = nn.Linear(8, 4)
    packed = PackedLinear.from_linear(lin)
    packed(torch.randn(3, 8)).sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.shape == (4, 8)


def test_the_shipped_models_greedy_tokens_are_unchanged(shakespeare):
    model, tok = shakespeare
    packed = prepack(model)
    assert sum(isinstance(m, PackedLinear) for m in packed.modules()) == 4 * 6 + 1
    assert not any(type(m) is nn.Linear for m in packed.modules())
    assert not any(a is b for a, b in zip(packed.modules(), model.modules()))  # a copy
    prompts = [tok.encode("ROMEO:"), tok.encode("To be, or not"), tok.encode("Good morrow")]
    params = mf.SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    ref = [c.token_ids for c in mf.generate(model, prompts, params)]
    assert [c.token_ids for c in mf.generate(packed, prompts, params)] == ref
    engine = engine_reading("kernel", packed, tok, max_num_seqs=4)
    assert [o.token_ids for o in engine.generate(prompts, params)] == ref


def test_tied_weights_stay_tied_and_moves_repack():
    model = mf.GPT.from_config(mf.GPTConfig.preset("tiny").replace(tie_embeddings=True)).eval()
    assert model.config.tie_embeddings and model.lm_head.weight is model.transformer.wte.weight
    packed = prepack(model)
    head = packed.lm_head
    assert head.weight is packed.transformer.wte.weight  # still one tensor
    assert head._packed is not None
    packed.to(torch.float32)
    assert head._packed is None  # rebuilt on the next call
    ids = torch.tensor([[1, 2, 3]])
    with torch.inference_mode():
        assert (packed(ids) - model(ids)).abs().max() <= 1e-5 * model(ids).abs().max()
    assert head._packed is not None


def test_what_cannot_be_packed_gets_a_clear_error(tiny):
    with pytest.raises(ValueError, match="no nn.Linear"):
        prepack(mf.quantize(tiny, "int8"))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        prepack(mf.quantize(tiny, "fp16"))
    with pytest.raises(ValueError, match="batch_size"):
        prepack(tiny, batch_size=0)


def test_a_cpu_whose_onednn_cannot_pack_bf16_gets_a_clear_error(monkeypatch):
    """oneDNN packs bf16 only with AVX-512 or AVX-NE-CONVERT (not on an AVX2-only CPU)."""
    P = importlib.import_module("minifer.fast.prepack")

    def refuse(w, batch_size):
        if w.dtype == torch.bfloat16:
            raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support "
                               "avx_ne_convert or avx512bw, avx512vl and avx512dq")
        return real(w, batch_size)

    real = torch.ops.mkldnn._reorder_linear_weight
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    why = P.prepack_problem.__wrapped__(torch.bfloat16)
    assert "bfloat16" in why and "avx512bw" in why
    assert P.prepack_problem.__wrapped__(torch.float32) is None
    monkeypatch.setattr(P, "prepack_problem", P.prepack_problem.__wrapped__)
    with pytest.raises(ValueError, match="failed in torch.bfloat16.*avx512bw"):
        PackedLinear.from_linear(nn.Linear(16, 8).bfloat16())
    assert isinstance(PackedLinear.from_linear(nn.Linear(16, 8)), PackedLinear)


def test_a_packed_model_is_packed_again_for_another_batch_size(tiny):
    # (a model built on a CPU where `fast.layout` packs fp32 layers by default is packed already)
    twice = prepack(prepack(tiny), batch_size=16)
    assert {m.batch_size for m in twice.modules() if isinstance(m, PackedLinear)} == {16}
    ids = torch.tensor([[1, 2, 3]])
    with torch.inference_mode():
        assert (twice(ids) - tiny(ids)).abs().max() <= 1e-5 * tiny(ids).abs().max()
