"""Quantization: int8/int4 layers (weight-only, W8A8, the default per shape), bytes, int8 KV."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import minifer as mf
from conftest import lively_model, on_device
from minifer.quantization import (
    QuantizedLinear,
    fused_available,
    model_bytes,
    pack_int4,
    quantization_summary,
    quantize,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)
from minifer_course.quality import greedy_agreement, max_logit_diff

# QUANT-1 is about weight-only int8: torch's fused kernel where this torch has one
FUSED8 = "fused" if fused_available(8) else "reference"


@pytest.fixture(scope="module")
def reference():
    return mf.GPT.from_config("reference", seed=0)


def _linear(n: int = 96, k: int = 256, seed: int = 0, bias: bool = True) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.normal_(0, 0.05)
        if bias:
            lin.bias.normal_(0, 0.1)
    return lin


# ---- tensor-level quantizers -----------------------------------------------------------------
def test_int8_error_at_most_half_a_step_per_row():
    w = torch.randn(64, 128)
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (64,)
    assert int(q.abs().max()) == 127  # each row's largest weight uses the full range
    err = (q.float() * scale[:, None] - w).abs()
    assert (err <= scale[:, None] / 2 + 1e-6).all()


def test_int4_pack_unpack_round_trip_is_exact():
    q = torch.randint(0, 16, (37, 64), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (37, 32) and packed.dtype == torch.uint8  # two values per byte
    assert torch.equal(unpack_int4(packed), q)
    assert torch.equal(pack_int4(unpack_int4(packed)), packed)


def test_int4_error_at_most_half_a_step_per_group():
    w = torch.randn(16, 128)
    lin = _linear(16, 128, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    layer = QuantizedLinear.from_linear(lin, 4, group_size=32, impl="reference")
    _, scale, _ = quantize_int4(w, 32)
    err = (layer.dequantize() - w).abs().reshape(16, 4, 32)
    assert (err <= scale[..., None] / 2 + 1e-5).all()
    assert layer.qweight.numel() == 16 * 128 // 2


def test_pack_errors():
    with pytest.raises(ValueError, match="even number"):
        pack_int4(torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        pack_int4(torch.full((2, 2), 16, dtype=torch.uint8))


# ---- layers: fused vs reference ----------------------------------------------------------------
@pytest.mark.parametrize("bits,group", [(8, 128), (4, 32), (4, 64), (4, 128)])
def test_reference_path_close_to_float_layer(bits, group):
    lin = _linear()
    x = torch.randn(5, 256)
    layer = QuantizedLinear.from_linear(lin, bits, group_size=group, impl="reference")
    y, ref = layer(x), lin(x)
    tol = {8: 0.02, 4: 0.3}[bits]  # relative to the output's scale
    assert (y - ref).abs().max() <= tol * ref.abs().max()
    # the reference path is exactly dequantize-then-matmul
    assert torch.allclose(y, x @ layer.dequantize().T + lin.bias, atol=1e-5)


@pytest.mark.parametrize("bits,group", [(8, 128), (4, 32), (4, 64), (4, 128)])
def test_fused_matches_reference_path(bits, group):
    if not fused_available(bits):
        pytest.skip(f"no fused int{bits} kernel in this torch")
    lin = _linear()
    x = torch.randn(2, 3, 256)  # 3-D input: batch, tokens, features
    ref = QuantizedLinear.from_linear(lin, bits, group_size=group, impl="reference")
    fused = QuantizedLinear.from_linear(lin, bits, group_size=group, impl="fused")
    y_ref, y_fused = ref(x), fused(x)
    assert y_fused.shape == (2, 3, 96) and y_fused.dtype == torch.float32
    # same integers; the fused kernel rounds activations (and scales) to bf16
    assert torch.allclose(y_fused, y_ref, atol=0.02, rtol=0.02)
    # and the fused layout holds the same weights
    assert torch.allclose(fused.dequantize(), ref.dequantize(), atol=2e-3, rtol=1e-2)
    assert fused.weight_nbytes == ref.weight_nbytes


def test_quantized_linear_reports_its_bytes():
    lin = _linear(96, 256)
    l8 = QuantizedLinear.from_linear(lin, 8, impl="reference")
    assert l8.weight_nbytes == 96 * 256 and l8.scale_nbytes == 96 * 4 and l8.bias_nbytes == 96 * 4
    l4 = QuantizedLinear.from_linear(lin, 4, group_size=64, impl="reference")
    assert l4.weight_nbytes == 96 * 128
    assert l4.scale_nbytes == 2 * 96 * (256 // 64) * 4  # a scale and a zero per group, fp32
    assert l4.nbytes == l4.weight_nbytes + l4.scale_nbytes + l4.bias_nbytes
    assert "int4" in repr(l4)


# ---- whole models --------------------------------------------------------------------------------
def test_quant1_bytes_on_reference_model(reference):
    fp32 = model_bytes(reference)
    assert fp32.linear_weights == 25_690_112 * 4  # incl. the output head
    assert round(fp32.linear / 1e6, 1) == 102.8
    int8 = model_bytes(quantize(reference, "int8", impl="reference"))
    assert int8.linear_weights == 25_690_112
    assert int8.scales == (8 * (1536 + 512 + 2048 + 512) + 1024) * 4  # one fp32 scale per row
    assert round(int8.linear / 1e6, 1) == 25.8
    assert round(fp32.linear / int8.linear, 1) == 4.0
    assert int8.embeddings == fp32.embeddings and int8.norms == fp32.norms  # left in float
    assert int8.biases == fp32.biases
    bf16 = model_bytes(quantize(reference, "bf16"))
    assert bf16.total * 2 == fp32.total  # QUANT-5


def test_quant1_quality_on_reference_model(reference):
    prompt = list(b"Once upon a time")
    weight_only = quantize(reference, "int8", impl="reference")  # fp32 activations
    assert max_logit_diff(reference, weight_only, prompt) < 0.05  # every position
    fused = quantize(reference, "int8", impl=FUSED8)  # + bf16 activations in the fused kernel
    assert max_logit_diff(reference, fused, prompt, last_only=True) < 0.05
    for q in (weight_only, fused):
        assert greedy_agreement(reference, q, prompt, n=8).identical


@pytest.mark.filterwarnings("ignore:the fused int4 kernel rejects")
def test_input_model_untouched(tiny):
    before = {k: v.clone() for k, v in tiny.state_dict().items()}
    for p in ("int8", "int4", "bf16"):
        q = quantize(tiny, p, group_size=32)
        assert q is not tiny
    assert all(isinstance(m, nn.Linear) for m in (tiny.lm_head, tiny.transformer.h[0].mlp.c_fc))
    after = tiny.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert next(tiny.parameters()).dtype == torch.float32


@pytest.mark.filterwarnings("ignore:the fused int4 kernel rejects")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "int8", "int4"])
def test_quantized_tiny_model_generates_close_to_fp32(tiny, precision, device):
    tiny = on_device(tiny, device)
    q = quantize(tiny, precision, group_size=32)
    ids = torch.tensor([list(b"hello world")], device=device)
    with torch.inference_mode():
        ref, out = tiny(ids), q(ids).float()
    spread = ref.abs().max()
    tol = {"fp32": 0, "bf16": 0.05, "fp16": 0.01, "int8": 0.05, "int4": 0.5}[precision]
    assert (out - ref).abs().max() <= tol * spread
    assert len(mf.generate(q, ids, mf.SamplingParams(temperature=0, max_new_tokens=4))[0]
               .token_ids) == 4


def test_int4_unsupported_shape_falls_back_per_layer(tiny):
    # Without a fused int4 kernel (e.g. torch 2.4 on a CPU) every layer falls back, and says so once.
    expected = r"lm_head \(257, 32\)" if fused_available(4) else "fused int4 kernel unavailable"
    with pytest.warns(RuntimeWarning, match=expected):
        q = quantize(tiny, "int4", group_size=32)
    if fused_available(4):
        assert q.transformer.h[0].mlp.c_fc.impl == "fused"
    assert q.lm_head.impl == "reference"  # N = 257 is not a multiple of 16


@pytest.mark.filterwarnings("ignore:the fused int4 kernel rejects")
def test_int4_quality_worse_than_int8(tiny):
    ids = list(b"the quick brown fox")
    d8 = max_logit_diff(tiny, quantize(tiny, "int8"), ids)
    d4 = max_logit_diff(tiny, quantize(tiny, "int4", group_size=32), ids)
    assert 0 < d8 < d4


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_tied_head_is_quantized_as_a_copy(precision):
    """GPT-2's head reads the whole embedding matrix every step: it gets an integer copy, while
    the embedding lookup keeps the float matrix."""
    cfg = mf.GPTConfig.preset("tiny").replace(tie_embeddings=True)
    model = mf.GPT.from_config(cfg)
    q = quantize(model, precision, group_size=32, impl="reference")
    assert isinstance(q.lm_head, QuantizedLinear) and q.lm_head.bits == int(precision[3:])
    wte = q.transformer.wte.weight
    assert wte.dtype == torch.float32 and torch.equal(wte, model.transformer.wte.weight)
    assert model.lm_head.weight is model.transformer.wte.weight  # the input keeps its tie
    b = model_bytes(q)
    assert b.embeddings == (257 + 128) * 32 * 4  # the float table, once
    untied = quantize(mf.GPT.from_config(cfg.replace(tie_embeddings=False)), precision,
                      group_size=32, impl="reference")
    assert b.linear_weights == model_bytes(untied).linear_weights  # as an untied model's head
    x = torch.randn(5, 32)  # the head alone, within the layer bounds above
    with torch.inference_mode():
        y, ref = q.lm_head(x), model.lm_head(x)
    assert (y - ref).abs().max() <= {"int8": 0.02, "int4": 0.3}[precision] * ref.abs().max()


@pytest.mark.parametrize("impl", ["fused", "auto"])
def test_tied_head_kept_float_where_only_the_reference_path_takes_it(monkeypatch, impl):
    """Rebuilding an embedding-sized matrix at every step would be slower than the float head."""
    from minifer import quantization as qm

    if not fused_available(8):
        pytest.skip("no fused int8 kernel in this torch")
    cfg = mf.GPTConfig.preset("tiny").replace(tie_embeddings=True)
    real_f, real_i = qm.fused_problem, qm.integer_problem
    monkeypatch.setattr(qm, "fused_problem", lambda bits, n, *a: "no" if n == 257 else real_f(
        bits, n, *a))
    monkeypatch.setattr(qm, "integer_problem", lambda n, *a: "no" if n == 257 else real_i(n, *a))
    q = quantize(mf.GPT.from_config(cfg), "int8", impl=impl)
    assert isinstance(q.lm_head, nn.Linear) and q.lm_head.weight is q.transformer.wte.weight
    assert isinstance(q.transformer.h[0].mlp.c_fc, QuantizedLinear)


def test_tied_head_kept_float_and_shared_without_the_head():
    cfg = mf.GPTConfig.preset("tiny").replace(tie_embeddings=True)
    q = quantize(mf.GPT.from_config(cfg), "int8", include_lm_head=False)
    assert isinstance(q.lm_head, nn.Linear)
    assert q.lm_head.weight is q.transformer.wte.weight
    assert model_bytes(q).embeddings == (257 + 128) * 32 * 4  # the head counted once
    no_head = quantize(mf.GPT.from_config("tiny"), "int8", include_lm_head=False)
    assert isinstance(no_head.lm_head, nn.Linear)


def test_int8_tied_head_quality_on_reference_shape():
    """QUANT-1's bounds hold with the tied head quantized too (the reference shape, tied)."""
    tied = mf.GPT.from_config(mf.GPTConfig.preset("reference").replace(tie_embeddings=True),
                              seed=0)
    prompt = list(b"Once upon a time")
    weight_only = quantize(tied, "int8", impl="reference")
    assert isinstance(weight_only.lm_head, QuantizedLinear)
    assert max_logit_diff(tied, weight_only, prompt) < 0.05  # every position
    fused = quantize(tied, "int8", impl=FUSED8)
    assert max_logit_diff(tied, fused, prompt, last_only=True) < 0.05
    for q in (weight_only, fused):
        assert greedy_agreement(tied, q, prompt, n=8).identical


def test_errors(tiny):
    with pytest.raises(ValueError, match=r"unknown precision 'int3'.*fp32.*int4"):
        quantize(tiny, "int3")
    with pytest.raises(ValueError, match="group_size=48 does not divide in_features=32"):
        quantize(tiny, "int4", group_size=48)
    with pytest.raises(ValueError, match="even integer"):
        quantize(tiny, "int4", group_size=0)
    with pytest.raises(ValueError, match="impl"):
        quantize(tiny, "int8", impl="fast")
    with pytest.raises(ValueError, match="bits"):
        QuantizedLinear.from_linear(_linear(), 3)


def test_fused_request_without_kernel_is_a_clear_error(tiny, monkeypatch):
    from minifer import quantization as qm

    monkeypatch.setattr(qm, "fused_available", lambda *a, **k: False)
    with pytest.raises(RuntimeError, match="impl='reference'"):
        quantize(tiny, "int4", group_size=32, impl="fused")
    with pytest.warns(RuntimeWarning, match="reference path"):
        q = quantize(tiny, "int4", group_size=32)
    assert q.lm_head.impl == "reference"


# ---- the int8 KV cache -------------------------------------------------------------------------
def test_int8_kv_cache_halves_the_bytes_of_fp16():
    kw = dict(n_layer=32, batch_size=1, n_kv_head=8, head_dim=128, max_len=16)
    fp16 = mf.StaticKVCache(**kw, dtype=torch.float16)
    int8 = mf.StaticKVCache(**kw, dtype="int8")
    assert fp16.bytes_per_token == 131_072  # KV-6: LLaMA-3-8B, 128 KB per token
    assert int8.bytes_per_token == 32 * 2 * 8 * (128 + 2)  # int8 values + one fp16 scale per head
    assert int8.bytes_per_token / fp16.bytes_per_token == pytest.approx(0.5, abs=0.01)
    assert int8.nbytes == int8.bytes_per_token * 16
    assert "int8" in repr(int8)


def test_int8_kv_cache_update_within_half_a_step():
    cache = mf.StaticKVCache(2, 2, 3, 16, 10, dtype=torch.int8)
    torch.manual_seed(0)
    k, v = torch.randn(2, 3, 4, 16), torch.randn(2, 3, 4, 16)
    k_out, v_out = cache.update(0, k, v)
    assert k_out.shape == (2, 3, 4, 16) and k_out.dtype == torch.float32
    step = k.abs().amax(-1, keepdim=True) / 127
    assert ((k_out - k).abs() <= step / 2 * 1.01 + 1e-6).all()
    assert ((v_out - v).abs() <= v.abs().amax(-1, keepdim=True) / 254 * 1.01 + 1e-6).all()
    cache.advance(4)
    k2 = torch.randn(2, 3, 1, 16)
    k_out, _ = cache.update(0, k2, k2)
    assert k_out.shape == (2, 3, 5, 16)  # the whole valid prefix, dequantized


def test_int8_kv_cache_generation_within_tolerance(tiny, tiny_gqa, device):
    for model in (on_device(tiny, device), on_device(tiny_gqa, device)):
        ids = torch.tensor([list(b"To be or not")], device=device)
        with torch.inference_mode():
            full = model(ids)
            cache = mf.StaticKVCache.for_model(model, 1, 32, dtype="int8")
            assert cache.quantized and cache.k[0].dtype == torch.int8
            step_logits = torch.stack([model(ids[:, i:i + 1], cache=cache)[0, 0]
                                       for i in range(ids.shape[1])])
        # stated tolerance: logits within 2% of their spread of the float model's
        assert (step_logits - full[0]).abs().max() <= 0.02 * full.abs().max()


def test_int8_kv_cache_greedy_on_reference_model(reference):
    agree = greedy_agreement(reference, reference, list(b"Once upon a time"), n=8,
                             kv_dtype="int8")
    assert agree.identical


def test_float_cache_unchanged_and_bad_dtype():
    cache = mf.StaticKVCache(1, 1, 1, 4, 4)
    assert cache.dtype == torch.float32 and not cache.quantized
    assert cache.bytes_per_token == 2 * 4 * 4
    with pytest.raises(ValueError, match="int8"):
        mf.StaticKVCache(1, 1, 1, 4, 4, dtype=torch.int32)


def test_generate_passes_kv_dtype(tiny):
    params = mf.SamplingParams(temperature=0, max_new_tokens=6)
    a = mf.generate(tiny, [list(b"abc"), list(b"hello")], params)
    b = mf.generate(tiny, [list(b"abc"), list(b"hello")], params, kv_dtype="int8")
    assert [len(c.token_ids) for c in b] == [6, 6]
    assert [c.token_ids[0] for c in a] == [c.token_ids[0] for c in b]
    scaled = lively_model("tiny", seed=1)
    assert len(mf.generate(scaled, "hi", params, mf.ByteTokenizer(), kv_dtype="int8")[0]
               .token_ids) == 6


# ---- shapes the fused kernels cannot take (issue 14) -------------------------------------------
ODD = mf.GPTConfig(vocab_size=257, context_length=64, n_layer=2, n_head=4, n_embd=72)


def test_int8_odd_input_width_runs_and_matches_reference_in_a_subprocess():
    """`_weight_int8pack_mm` needs in_features % 16 == 0: past it, it read out of bounds
    (NaN/1e17 logits, then a segfault in generate). Run in a child process so that a crash fails
    this test instead of killing the test run."""
    import subprocess
    import sys
    code = """
import warnings, torch, minifer as mf
warnings.simplefilter("ignore")
cfg = mf.GPTConfig(vocab_size=257, context_length=64, n_layer=2, n_head=4, n_embd=72)
m = mf.GPT.from_config(cfg, seed=0)
q, r = mf.quantize(m, "int8"), mf.quantize(m, "int8", impl="reference")
ids = torch.randint(0, 257, (3, 12), generator=torch.Generator().manual_seed(0))
with torch.inference_mode():
    out, ref = q(ids), r(ids)
assert torch.isfinite(out).all(), "non-finite logits"
err = (out - ref).abs().max().item()
assert err <= 0.02 * ref.abs().max().item(), err
p = mf.SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
for prompt in ([1], [1, 2, 3], list(range(20))):
    assert len(mf.generate(q, prompt, p)[0].token_ids) == 8
print("OK")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, (proc.returncode, proc.stderr[-2000:])


def test_int8_fused_only_on_layers_the_kernel_takes():
    from minifer.quantization import fused_problem
    model = mf.GPT.from_config(ODD, seed=0)
    assert "16" in fused_problem(8, 216, 72)  # in_features 72: not a multiple of 16
    if not fused_available(8):
        pytest.skip("no fused int8 kernel in this torch")
    with pytest.warns(RuntimeWarning, match=r"c_attn \(216, 72\).*multiple of 16"):
        q = quantize(model, "int8", impl="fused")
    block = q.transformer.h[0]
    assert block.attn.c_attn.impl == "reference"  # K = 72
    assert q.lm_head.impl == "reference"
    assert block.mlp.c_proj.impl == "fused"  # K = 288 = 18 * 16
    with pytest.raises(ValueError, match="in_features=72.*multiple of 16"):
        QuantizedLinear.from_linear(_linear(16, 72), 8, impl="fused")


def test_fused_probe_tests_the_shape_it_is_used_on(monkeypatch):
    """A kernel that is right on the probe's usual shape but wrong on one layer's shape must not
    be used on that layer."""
    import sys
    qm = sys.modules["minifer.quantization"]
    real = qm._int8_mm

    def wrong_for_n_96(x, q, scale):
        y = real(x, q, scale)
        return y + 1.0 if q.shape[0] == 96 else y

    monkeypatch.setattr(qm, "_int8_mm", wrong_for_n_96)
    qm.fused_problem.cache_clear()
    try:
        if qm.fused_problem(8, 64, 256) is not None:
            pytest.skip("no fused int8 kernel in this torch")
        assert "differs" in qm.fused_problem(8, 96, 256)
        model = nn.Sequential(nn.Linear(256, 96), nn.Linear(96, 64))
        with pytest.warns(RuntimeWarning, match=r"0 \(96, 256\)"):
            q = quantize(model, "int8", impl="fused")
        assert q[0].impl == "reference" and q[1].impl == "fused"
    finally:
        qm.fused_problem.cache_clear()


@pytest.mark.parametrize("cfg,group", [("tiny", 8), ("tiny", 16), (ODD, 24), (ODD, 72)])
def test_int4_group_sizes_that_validate_also_run(cfg, group):
    """Group sizes the fused kernel does not take (it wants 32/64/128/256) run on the reference
    path instead of failing at the first forward."""
    model = mf.GPT.from_config(cfg, seed=0)
    # The warning names the group size, or (torch without a fused CPU int4 kernel, e.g. 2.4)
    # says the kernel is unavailable: either way every layer takes the reference path.
    with pytest.warns(RuntimeWarning, match="group_size|kernel unavailable"):
        q = quantize(model, "int4", group_size=group)
    r = quantize(model, "int4", group_size=group, impl="reference")
    ids = torch.randint(0, 257, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(q(ids), r(ids))  # every layer took the reference path
    assert len(mf.generate(q, [1, 2], mf.SamplingParams(temperature=0, max_new_tokens=3))[0]
               .token_ids) == 3
    with pytest.raises(ValueError, match="group_size.*32, 64, 128 or 256"):
        QuantizedLinear.from_linear(_linear(16, 96), 4, group_size=group if group != 72 else 24,
                                    impl="fused")


def test_int4_odd_group_sizes_still_rejected_clearly(tiny):
    with pytest.raises(ValueError, match="group_size=24 does not divide in_features=32.*8, 16, 32"):
        quantize(tiny, "int4", group_size=24)
    with pytest.raises(ValueError, match="group_size"):
        quantize(tiny, "int4", group_size=True)


@pytest.mark.filterwarnings("ignore:the fused int4 kernel rejects")
@pytest.mark.parametrize("preset", ["shakespeare", "shakespeare-draft", "reference", "tiny"])
def test_int4_default_group_size_quantizes_the_course_models(preset):
    from minifer.quantization import default_group_size
    model = mf.GPT.from_config(preset, seed=0)
    q = quantize(model, "int4")  # shakespeare: n_embd 320, which 128 does not divide
    groups = {m.group_size for m in q.modules() if isinstance(m, QuantizedLinear)}
    expected = {"shakespeare": 64, "shakespeare-draft": 64, "reference": 128, "tiny": 32}[preset]
    assert groups == {expected}
    assert default_group_size([768, 3072]) == 128  # GPT-2 small keeps the usual 128


def test_int4_default_group_size_error_names_sizes_that_work():
    model = mf.GPT.from_config(ODD, seed=0)  # in_features 72 and 288
    with pytest.raises(ValueError, match=r"group_size.*72.*288.*24"):
        quantize(model, "int4")


# ---- W8A8 on integer units (impl="integer") --------------------------------------------------
def _integer_problem() -> str | None:
    from minifer.quantization import integer_problem

    return integer_problem()


needs_integer = pytest.mark.skipif(_integer_problem() is not None,
                                   reason=f"no W8A8 integer path here: {_integer_problem()}")


@needs_integer
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_integer_layer_close_to_weight_only(rows):
    lin = _linear(192, 256)
    ref = QuantizedLinear.from_linear(lin, 8, impl="reference")
    integer = QuantizedLinear.from_linear(lin, 8, impl="integer")
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    want, got = ref(x), integer(x)
    assert got.dtype == torch.float32 and got.shape == want.shape
    # the activations are rounded to 7-8 bits with one scale per call: ~1% of the output's scale
    assert (got - want).abs().max() <= 0.03 * want.abs().max()
    # it stores the same integers as the weight-only layer (the pack is extra, not a buffer)
    assert integer.nbytes == ref.nbytes and torch.equal(integer.dequantize(), ref.dequantize())


@needs_integer
def test_integer_layer_scales_each_row_on_its_own():
    """One scale per token: a row of large activations in the batch does not cost the other rows
    their precision (with one scale for the whole input, the small row would round to ~0)."""
    lin = _linear(64, 256)
    ref = QuantizedLinear.from_linear(lin, 8, impl="reference")
    integer = QuantizedLinear.from_linear(lin, 8, impl="integer")
    gen = torch.Generator().manual_seed(0)
    small, large = torch.randn(1, 256, generator=gen), 1000 * torch.randn(1, 256, generator=gen)
    got = integer(torch.cat([small, large]))
    for row, x in enumerate((small, large)):
        want = ref(x)[0]
        assert (got[row] - want).abs().max() <= 0.03 * want.abs().max(), row
    assert torch.allclose(got[0], integer(small)[0], rtol=0.02, atol=0.03 * ref(small).abs().max())


@needs_integer
def test_integer_layer_survives_copy_load_and_move():
    import copy

    a, b = _linear(64, 128, seed=1), _linear(64, 128, seed=2)
    la = QuantizedLinear.from_linear(a, 8, impl="integer")
    lb = QuantizedLinear.from_linear(b, 8, impl="integer")
    x = torch.randn(3, 128)
    y_b = lb(x)
    assert torch.equal(copy.deepcopy(lb)(x), y_b)
    la(x)  # packs a's weights
    la.load_state_dict(lb.state_dict())  # new buffers: the stale pack must not be used
    assert torch.equal(la(x), y_b)
    assert torch.equal(lb.to("cpu")(x), y_b)


@needs_integer
def test_integer_int8_model_within_bounds_of_fp32_and_weight_only():
    """QUANT-3 for W8A8 on the shipped model: held-out perplexity barely moves, and the top-1
    token mostly agrees with fp32 — less often than weight-only int8 does (activation rounding)."""
    from minifer_course.quality import top1_agreement, validation_perplexity

    model, tok = mf.load_pretrained("shakespeare")
    text = mf.pretrained.load_validation_text()[:4000]
    ids = tok.encode(text)[:512]
    integer = quantize(model, "int8", impl="integer")
    weight_only = quantize(model, "int8", impl="reference")
    assert all(m.impl == "integer" for m in integer.modules() if isinstance(m, QuantizedLinear))
    fp32 = validation_perplexity(model, tok, text=text).nats_per_token
    w8a8 = validation_perplexity(integer, tok, text=text).nats_per_token
    assert abs(w8a8 - fp32) <= 0.005 * fp32  # measured: +0.01% over 30k chars (+0.01 ppl)
    agree_integer = top1_agreement(model, integer, ids)
    agree_weight_only = top1_agreement(model, weight_only, ids)
    # measured over these 512 tokens: 0.982 with 8-bit activations (VNNI), 0.994 weight-only
    assert agree_integer >= 0.95
    assert agree_weight_only >= agree_integer - 0.01
    out = mf.generate(integer, ["ROMEO:"], mf.SamplingParams(temperature=0, max_new_tokens=8),
                      tok)
    assert len(out[0].token_ids) == 8


def test_integer_path_is_int8_on_cpu_only(tiny):
    with pytest.raises(ValueError, match="bits=8"):
        QuantizedLinear.from_linear(_linear(), 4, impl="integer")
    with pytest.raises(ValueError, match="int8"):
        quantize(tiny, "int4", impl="integer")


def test_integer_path_is_for_the_cpu(tiny):
    from minifer.quantization import integer_problem

    assert integer_problem() is None
    assert "CPU only" in integer_problem(64, 256, "cuda")


def test_integer_layer_is_the_reference_at_every_batch_size_with_or_without_speed_ups():
    """W8A8 rounds each row with its own scale and sums exactly: a row's output is the same
    alone or in any batch, and the speed-ups' kernels give the reference's numbers bit for bit."""
    from minifer import fast
    from minifer.quantization import w8a8_reference

    lin = _linear(96, 256)
    layer = QuantizedLinear.from_linear(lin, 8, impl="integer")
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(3))
    want = w8a8_reference(x, layer.qweight, layer.scales, layer.bias)
    for rows in ((0, 9), (0, 1), (3, 5), (8, 9)):
        part = x[rows[0]:rows[1]]
        assert torch.equal(layer(part), want[rows[0]:rows[1]]), rows
        with fast.disabled():
            assert torch.equal(layer(part), want[rows[0]:rows[1]]), rows


# ---- int8 "auto": W8A8 where the CPU has int8 dot products, else weight-only -----------------
@pytest.mark.parametrize("dots", ["avx512_vnni", None])
def test_int8_auto_takes_w8a8_only_where_the_cpu_has_int8_dot_products(monkeypatch, dots):
    import minifer.quantization as q

    if not fused_available(8):
        pytest.skip("no fused int8 kernel in this torch")
    monkeypatch.setattr(q, "int8_dot_products", lambda: dots)
    model = nn.Sequential(nn.Linear(256, 96), nn.Linear(96, 64), nn.Linear(64, 96))
    auto = quantize(model, "int8")
    want = "integer" if dots else "fused"
    assert [m.impl for m in auto] == [want] * 3 and set(auto.int8_choices) == {"0", "1", "2"}
    summary = quantization_summary(auto)
    assert f"3 {q.IMPL_NAMES[want]}" in summary
    assert ("avx512_vnni" in summary) == bool(dots)


def test_int8_auto_without_dot_products_or_fused_kernel_takes_the_reference(monkeypatch):
    import minifer.quantization as q

    monkeypatch.setattr(q, "int8_dot_products", lambda: None)
    real_f = q.fused_problem
    monkeypatch.setattr(q, "fused_problem",
                        lambda bits, n, *a: "nope" if n == 48 else real_f(bits, n, *a))
    model = nn.Sequential(nn.Linear(64, 48))
    with pytest.warns(RuntimeWarning, match=r"int8 kernels reject the shape of 0 \(48, 64\)"):
        auto = quantize(model, "int8")
    assert auto[0].impl == "reference" and "fused: nope" in auto.int8_choices["0"].reason


def test_int8_auto_choice_depends_on_the_machine_only():
    from minifer.quantization import Int8Choice, int8_choice, int8_dot_products

    a, b = int8_choice(64, 256), int8_choice(64, 256)
    assert isinstance(a, Int8Choice) and a == b
    assert a.impl == ("integer" if int8_dot_products() else "fused")
    assert quantization_summary(nn.Linear(4, 4)) == "no quantized layers"


def test_int8_default_gives_each_prompt_the_same_tokens_batched_or_alone():
    """Five prompts of mixed lengths, 64 greedy tokens each, batched and one at a time, on the
    shipped model in the default int8 (which used to pick a kernel per batch size: all five
    differed). The same with the speed-ups off."""
    from minifer import fast

    model, tok = mf.load_pretrained("shakespeare")
    q = quantize(model, "int8")
    prompts = ["ROMEO:\n", "JULIET: O Romeo, Romeo! wherefore art thou", "KING HENRY:\nOnce more",
               "First Citizen:\nBefore we proceed any further, hear me speak.", "O"]
    params = mf.SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True)
    batched = [c.token_ids for c in mf.generate(q, prompts, params, tok, threads=1)]
    alone = [mf.generate(q, [p], params, tok, threads=1)[0].token_ids for p in prompts]
    assert batched == alone
    with fast.disabled():
        assert [c.token_ids for c in mf.generate(q, prompts[:2], params, tok)] == batched[:2]


@needs_integer
def test_int8_default_within_quant3_bounds_on_the_shipped_model():
    """Whichever kernel each layer gets here, the default int8 model keeps QUANT-3's bounds:
    perplexity within 0.5% of fp32 and top-1 agreement >= 0.9 on held-out text."""
    from minifer_course.quality import top1_agreement, validation_perplexity

    model, tok = mf.load_pretrained("shakespeare")
    text = mf.pretrained.load_validation_text()[:4000]
    auto = quantize(model, "int8")
    assert set(auto.int8_choices) == {n for n, m in auto.named_modules()
                                      if isinstance(m, QuantizedLinear)}
    fp32 = validation_perplexity(model, tok, text=text).nats_per_token
    assert abs(validation_perplexity(auto, tok, text=text).nats_per_token - fp32) <= 0.005 * fp32
    assert top1_agreement(model, auto, tok.encode(text)[:512]) >= 0.9
