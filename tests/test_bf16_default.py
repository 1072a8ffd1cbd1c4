"""A bf16 model gets the fast layers by default where the CPU has them (`hooks.prepare_bf16`):
``quantize(model, "bf16")`` and a checkpoint loaded in bf16 are prepacked where oneDNN packs
bf16, plain with the speed-ups off, on another device or a CPU without it; both give the same
greedy tokens and logits within bf16 rounding; weights stay ordinary parameters (state dicts,
training, in-place changes); fp32, fp16, int8 and int4 are untouched."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn as nn

import minifer as mf
from minifer import fast, hooks
from minifer.fast import layout
from minifer.fast.prepack import PackedLinear, prepack, prepack_problem, prepare_bf16

BF16_PROBLEM = prepack_problem(torch.bfloat16)
needs_bf16_pack = pytest.mark.skipif(BF16_PROBLEM is not None,
                                     reason=f"oneDNN cannot pack bf16 here: {BF16_PROBLEM}")
# packed and plain bf16 models sum in another order, each rounding to bf16 (8 significant bits):
# their logits may differ by a few bf16 steps of the largest logit; 2% of it bounds that
BOUND = 0.02


@pytest.fixture(autouse=True, scope="module")
def fp32_layers_plain():
    """These tests are about bf16: the fp32 models they start from keep plain `nn.Linear` layers
    on every CPU (`fast.layout` packs fp32 layers where MKL runs its generic code)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(layout, "mkl_generic", lambda: False)
        yield


@pytest.fixture(scope="module")
def tiny(fp32_layers_plain):
    return mf.GPT.from_config("tiny", seed=0).eval()


def _packed(model: nn.Module) -> int:
    return sum(isinstance(m, PackedLinear) for m in model.modules())


def _plain(model: nn.Module) -> int:
    return sum(type(m) is nn.Linear for m in model.modules())


@pytest.fixture(scope="module")
def shakespeare():
    return mf.load_pretrained("shakespeare")


@pytest.fixture
def tied():
    return mf.GPT.from_config(mf.GPTConfig.preset("tiny").replace(tie_embeddings=True)).eval()


def test_the_seam_holds_the_fast_bf16_layers_and_disabled_takes_them_out():
    assert hooks.prepare_bf16 is prepare_bf16
    with fast.disabled():
        assert hooks.prepare_bf16 is not prepare_bf16
        model = nn.Sequential(nn.Linear(8, 4)).bfloat16()
        hooks.prepare_bf16(model)
        assert type(model[0]) is nn.Linear


@needs_bf16_pack
def test_a_bf16_model_is_prepacked_by_default(tied):
    model = mf.quantize(tied, "bf16")
    n = 4 * tied.config.n_layer + 1
    assert _packed(model) == n and _plain(model) == 0
    assert _packed(tied) == 0  # the input model is not changed
    head = model.lm_head
    assert head.weight is model.transformer.wte.weight  # a tied head stays tied
    for m in model.modules():
        if isinstance(m, PackedLinear):  # row-major: the one-row kernel reads the weight itself
            assert m.weight.dtype == torch.bfloat16 and m.weight.is_contiguous()
    assert mf.model_bytes(model) == mf.model_bytes(mf.quantize(tied, "fp16"))  # bytes a step reads


@needs_bf16_pack
def test_fp32_layers_on_onednn_are_prepacked_in_bf16_too(monkeypatch):
    """Where MKL runs generic code (an AMD CPU), `fast.layout` makes fp32 layers `PackedLinear`s
    on their own weight (``batch_size=0``). In bf16 they are packed for oneDNN like plain ones:
    left on the row-major weight, oneDNN re-blocked it at every call of several rows (bf16
    decode at batch 16 took 1.5x as long on an EPYC)."""
    monkeypatch.setattr(layout, "mkl_generic", lambda: True)
    fp32 = mf.GPT.from_config("tiny", seed=0).eval()
    n = 4 * fp32.config.n_layer + 1
    assert [m.batch_size for m in fp32.modules() if isinstance(m, PackedLinear)] == [0] * n
    model = mf.quantize(fp32, "bf16")
    assert [m.batch_size for m in model.modules() if isinstance(m, PackedLinear)] == [1] * n
    assert all(m.batch_size == 0 for m in fp32.modules() if isinstance(m, PackedLinear))
    x = torch.arange(12).reshape(4, 3)
    with torch.inference_mode(), fast.disabled():
        plain = mf.quantize(mf.GPT.from_config("tiny", seed=0).eval(), "bf16")(x).float()
    with torch.inference_mode():
        packed = model(x).float()
    assert (packed - plain).abs().max() <= BOUND * plain.abs().max()


def test_with_the_speed_ups_off_a_bf16_model_is_plain(tied):
    with fast.disabled():
        model = mf.quantize(tied, "bf16")
    assert _packed(model) == 0 and _plain(model) == 4 * tied.config.n_layer + 1
    assert model.lm_head.weight.dtype == torch.bfloat16


@pytest.mark.filterwarnings("ignore:the fused int4 kernel rejects")  # tiny's 257-row head
def test_other_precisions_are_untouched(tiny):
    for precision in ("fp32", "fp16", "int8", "int4"):
        assert _packed(mf.quantize(tiny, precision)) == 0, precision


def test_a_cpu_whose_onednn_cannot_pack_bf16_keeps_plain_layers(tiny, monkeypatch):
    P = importlib.import_module("minifer.fast.prepack")
    monkeypatch.setattr(P, "prepack_problem", lambda dtype=torch.float32: "no AVX-512 here")
    monkeypatch.setattr(P.AVX2, "available", lambda: False)  # nor minifer's AVX2 kernel
    model = mf.quantize(tiny, "bf16")
    assert _packed(model) == 0 and _plain(model) > 0


def test_where_onednn_cannot_pack_bf16_the_avx2_kernel_takes_the_layers(tiny, monkeypatch):
    """No second copy: each layer multiplies by its own row-major weight on `fast.avx2`."""
    P = importlib.import_module("minifer.fast.prepack")
    if not P.AVX2.available():
        pytest.skip(f"no AVX2 kernel here: {P.AVX2.error or P.AVX2.problem()}")
    monkeypatch.setattr(P, "prepack_problem", lambda dtype=torch.float32: "no AVX-512 here")
    model = mf.quantize(tiny, "bf16")
    layers = [m for m in model.modules() if isinstance(m, P.PackedLinear)]
    assert len(layers) == _packed(model) > 0 and all(m.batch_size == 0 for m in layers)
    with torch.inference_mode():
        model(torch.arange(6).reshape(2, 3))
    assert all(m._packed is None or m._packed.data_ptr() == m.weight.data_ptr() for m in layers)


def test_another_device_keeps_plain_layers():
    model = mf.GPT.from_config("tiny", device="meta").to(torch.bfloat16)
    prepare_bf16(model)
    assert _packed(model) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_cuda_bf16_model_is_plain(tiny):
    assert _packed(mf.quantize(mf.quantize(tiny, "fp32").cuda(), "bf16")) == 0


@needs_bf16_pack
def test_a_checkpoint_loaded_in_bf16_is_prepacked_too():
    model, _ = mf.load_pretrained("shakespeare", dtype=torch.bfloat16)
    assert _packed(model) == 4 * model.config.n_layer + 1
    model, _ = mf.load_pretrained("shakespeare")
    assert _packed(model) == 0  # fp32 as stored: as it was


@needs_bf16_pack
def test_a_hugging_face_model_in_bf16_is_prepacked_too():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    state = {k: v.to(torch.bfloat16) for k, v in hf.state_dict().items()}
    model = mf.GPT.from_hf_state(cfg.to_dict(), state)  # the stored dtype: bf16
    assert _packed(model) == 4 * 2 + 1 and _plain(model) == 0
    assert _packed(mf.GPT.from_hf(hf)) == 0  # fp32: as it was


@needs_bf16_pack
def test_packed_and_plain_bf16_give_the_same_greedy_tokens(shakespeare):
    """The shipped model, batch 3 (oneDNN's packed product) and batch 1 (the one-row kernel,
    same tokens or parting only at a near-tie); a decode step's logits at one row within `BOUND`."""
    model, tok = shakespeare
    packed = mf.quantize(model, "bf16")
    with fast.disabled():
        plain = mf.quantize(model, "bf16")
    assert _packed(packed) and not _packed(plain)
    prompts = [tok.encode("ROMEO:"), tok.encode("To be, or not"), tok.encode("Good morrow")]
    params = mf.SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    ref = [c.token_ids for c in mf.generate(plain, prompts, params)]
    assert [c.token_ids for c in mf.generate(packed, prompts, params)] == ref
    for p in prompts:  # one row: the kernel where there is one, beside plain's one row
        [want] = [c.token_ids for c in mf.generate(plain, [p], params)]
        [got] = [c.token_ids for c in mf.generate(packed, [p], params)]
        _same_or_near_tie(plain, p, got, want)
    ids = torch.tensor([prompts[1]])
    with torch.inference_mode():
        want = plain(ids).float()
        assert (packed(ids).float() - want).abs().max() <= BOUND * want.abs().max()
        want = plain(ids[:, :1]).float()  # one row: the kernel where there is one
        assert (packed(ids[:, :1]).float() - want).abs().max() <= BOUND * want.abs().max()


def _same_or_near_tie(model, prompt: list[int], got: list[int], want: list[int]) -> None:
    """`got` == `want`, or where they first part the two tokens' logits, recomputed from the
    shared prefix, are within `BOUND` of the largest: a near-tie that bf16's rounding decides
    either way (`tests/test_exactness.py`), as torch 2.4's bf16 product at one row does."""
    if got == want:
        return
    i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + want[:i]]))[0, -1].float()
    gap = (logits[got[i]] - logits[want[i]]).abs()
    assert gap <= BOUND * logits.abs().max(), (i, got[i], want[i], gap.item())


@needs_bf16_pack
def test_state_dicts_and_parameters_are_the_plain_models(tied):
    packed = mf.quantize(tied, "bf16")
    with fast.disabled():
        plain = mf.quantize(tied, "bf16")
    assert [n for n, _ in packed.named_parameters()] == [n for n, _ in plain.named_parameters()]
    sd, plain_sd = packed.state_dict(), plain.state_dict()
    assert sd.keys() == plain_sd.keys()
    assert all(torch.equal(sd[k], plain_sd[k]) for k in sd)
    other = mf.quantize(mf.GPT.from_config(tied.config, seed=1), "bf16")
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        packed(ids)  # packed from the first weights
    packed.load_state_dict(other.state_dict())
    with torch.inference_mode():
        want = other(ids).float()
        assert (packed(ids).float() - want).abs().max() <= BOUND * want.abs().max()


@needs_bf16_pack
def test_a_weight_changed_in_place_is_packed_again(tied):
    """An optimizer step changes the weights in place: the next call packs them again (at
    several rows and at one)."""
    packed = mf.quantize(tied, "bf16")
    ids = torch.tensor([[5, 6, 7]])
    with torch.inference_mode():
        before = packed(ids).float(), packed(ids[:, :1]).float()
    packed.train()
    opt = torch.optim.SGD(packed.parameters(), lr=1.0)
    loss = packed(ids).float().logsumexp(-1).sum()  # with gradients: `F.linear`
    loss.backward()
    assert all(p.grad is not None for p in packed.parameters() if p.requires_grad)
    opt.step()
    packed.eval()
    with fast.disabled():
        plain = mf.quantize(tied, "bf16")
    plain.load_state_dict(packed.state_dict())
    with torch.inference_mode():
        for rows, old in zip((ids, ids[:, :1]), before):
            want, got = plain(rows).float(), packed(rows).float()
            assert (got - want).abs().max() <= BOUND * want.abs().max()
            assert (got - old).abs().max() > BOUND * want.abs().max()  # it did change


@needs_bf16_pack
def test_prepack_of_the_default_bf16_model_packs_it_again(tiny):
    assert _packed(prepack(mf.quantize(tiny, "bf16"))) == _packed(prepack(tiny))
    with fast.disabled():
        plain = mf.quantize(tiny, "bf16")
    assert _packed(prepack(plain)) == _plain(plain)


@needs_bf16_pack
def test_the_compiled_step_of_the_default_bf16_model_gives_the_eager_tokens(tiny):
    """Inside `torch.compile` a packed layer is `F.linear` (inductor's freezing packs it)."""
    model = mf.quantize(tiny, "bf16")
    params = mf.SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    eager = mf.generate(model, [[1, 2, 3]], params)[0].token_ids
    assert mf.generate(model, [[1, 2, 3]], params, compile=True)[0].token_ids == eager
