"""The analytic claims (PD-*, KV-*, BATCH-2/3, MET-2, QUANT-2/5), recomputed with minifer_course.roofline.

Each figure is asserted to the rounding the claim prints it with.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from minifer_course import roofline as rl
from minifer_course.roofline import (
    BYTES_PER_VALUE,
    GB,
    HARDWARE,
    MODELS,
    GiB,
    Hardware,
    KiB,
    MiB,
    ModelSpec,
    critical_batch,
    decode_time,
    e2e_latency,
    kv_bytes_per_token,
    kv_cache_bytes,
    kv_cache_gib,
    kv_crossover_tokens,
    kv_tokens_fit,
    max_batch,
    mbu,
    mfu,
    prefill_time,
    ridge_point,
    roofline_table,
    tokens_per_second,
    weight_bytes,
)

ILL = Hardware.preset("illustrative")
L8B = ModelSpec.preset("llama-3-8b")


def r(x: float, nd: int = 0) -> float:
    return round(x, nd)


# ---------------------------------------------------------------- PD: prefill versus decode

def test_pd4_h100_reads_6_74b_in_4ms_and_computes_in_0_014ms():
    step = decode_time("6.74b", "h100")
    assert r(step.weight_bytes / GB, 1) == 13.5
    assert r(step.read_s * 1e3, 1) == 4.0
    assert r(step.compute_s * 1e3, 3) == 0.014
    assert step.bound == "memory"


def test_pd5_8b_model_decode_step():
    step = decode_time(L8B, ILL)
    assert step.flops == 2 * 8e9 == 16e9  # ~2N FLOPs per token: 16 GFLOP
    assert step.weight_bytes == 16e9  # 16 GB (decimal)
    assert r(step.read_s * 1e3, 2) == 5.33
    assert r(step.compute_s * 1e3, 3) == 0.016
    assert r(step.tokens_per_s_per_user) == 188


def test_pd5_more_flops_does_not_help_a_single_user():
    faster = dataclasses.replace(ILL, flops={"bf16": 1e18})
    assert decode_time(L8B, faster).tpot_s == decode_time(L8B, ILL).tpot_s


def test_pd6_arithmetic_intensity_and_ridge_point():
    assert decode_time(L8B, ILL).arithmetic_intensity == 1.0  # 2 FLOPs per 2-byte weight
    assert r(ridge_point(ILL)) == 333
    assert ridge_point("illustrative", "bf16") == pytest.approx(1000 / 3)


def test_pd7_prefill_of_2000_tokens_is_compute_bound():
    p = prefill_time(L8B, ILL, prompt_tokens=2000)
    assert p.flops == 32e12  # 32 TFLOP
    assert r(p.compute_s * 1e3) == 32
    assert r(p.read_s * 1e3, 1) == 5.3
    assert p.bound == "compute" and p.ttft_s == p.compute_s
    # ... while 2,000 *output* tokens for one user take over 10 s.
    assert 2000 * decode_time(L8B, ILL).tpot_s > 10


PD8 = [  # batch, TPOT ms (2 decimals), bound, total tokens/s (as printed)
    (1, 5.33, "memory", 188),
    (8, 5.33, "memory", 1_500),
    (32, 5.33, "memory", 6_000),
    (128, 5.33, "memory", 24_000),
    (256, 5.33, "memory", 48_000),
    (512, 8.19, "compute", 62_500),
    (1024, 16.38, "compute", 62_500),
]


def test_pd8_roofline_table():
    rows = roofline_table(L8B, ILL, [b for b, *_ in PD8])
    for row, (batch, tpot_ms, bound, total) in zip(rows, PD8, strict=True):
        assert row.batch == batch
        assert r(row.tpot_ms, 2) == tpot_ms
        assert row.bound == bound
        assert r(row.tokens_per_s_total) == total


def test_pd9_batch1_uses_a_sliver_of_compute_and_fewer_bytes_is_what_helps():
    step = decode_time(L8B, ILL)
    assert step.mfu < 0.05  # the claim says "~5%"; the pure roofline gives 1/333 = 0.3%
    assert r(step.mfu, 4) == 0.003
    half_bytes = decode_time(L8B, ILL, precision="int8")
    assert half_bytes.tpot_s == pytest.approx(step.tpot_s / 2)


def test_pd10_mbu_and_mfu():
    assert mbu(weight_bytes=7e9 * 2, kv_bytes=0, tpot_s=0.014, peak_bandwidth=2e12) == (
        pytest.approx(0.5))
    # The same with LLaMA-7B's real 6.74B parameters: 0.96 TB/s, 48% (the claim's "~").
    llama = weight_bytes("llama-7b", "bf16")
    assert r(llama / 0.014 / 1e12, 2) == 0.96
    assert r(mbu(llama, 0, 0.014, 2e12), 2) == 0.48
    assert mfu(500e12, 1e15) == 0.5
    p = prefill_time(L8B, ILL, 2000)
    assert mfu(p.flops / p.ttft_s, ILL.peak_flops("bf16")) == pytest.approx(p.mfu) == 1.0


def test_pd11_kv_reads_and_attention_make_tpot_grow_with_context():
    plain = [decode_time(L8B, ILL, batch=8, context=c).tpot_s for c in (0, 4096, 32768)]
    assert plain[0] == plain[1] == plain[2]  # the simple model ignores context
    full = [decode_time(L8B, ILL, batch=8, context=c, include_kv=True,
                        include_attention=True).tpot_s for c in (0, 4096, 32768)]
    assert full[0] == plain[0] < full[1] < full[2]
    step = decode_time(L8B, ILL, batch=8, context=4096, include_kv=True)
    assert step.kv_bytes == 8 * 4096 * 131_072
    attn = decode_time(L8B, ILL, context=10, include_attention=True)
    assert attn.flops == 16e9 + 4 * 32 * 32 * 128 * 10


# ---------------------------------------------------------------- KV: the KV cache

def test_kv4_reference_model_fp32():
    assert kv_bytes_per_token("reference", "fp32") == 32_768
    assert kv_bytes_per_token("reference", 4) == 32_768


def test_kv5_llama_7b():
    per_token = kv_bytes_per_token("llama-7b", "fp16")
    assert per_token == 524_288 and per_token / MiB == 0.5
    assert kv_cache_bytes("llama-7b", 4096) / GiB == 2.0
    assert kv_cache_bytes("llama-7b", 32768) / GiB == 16.0


def test_kv6_llama_3_8b():
    assert kv_bytes_per_token(L8B, "fp16") == 131_072 == 128 * KiB
    assert kv_bytes_per_token(L8B, "int8") == 64 * KiB
    assert kv_cache_bytes(L8B, 4096) / MiB == 512
    assert kv_cache_bytes(L8B, 32768) / GiB == 4
    assert kv_cache_bytes(L8B, 131072) / GiB == 16
    assert kv_cache_bytes(L8B, 4096, batch=32) / GiB == 16
    assert [weight_bytes(L8B, p) / GB for p in ("fp16", "int8", "int4")] == [16, 8, 4]


def test_kv7_a100_cache_capacity_in_both_units():
    a100 = Hardware.preset("a100-80gb")
    free = a100.memory_bytes - weight_bytes(L8B, "fp16")
    assert free == 64e9  # 80 GB − 16 GB (decimal)
    # The claim's 512K tokens reads the 64 as binary GiB: 64 GiB / 128 KiB.
    assert kv_tokens_fit(L8B, 64 * GiB) == 524_288
    # With decimal bytes throughout the same arithmetic gives 488,281 tokens.
    assert kv_tokens_fit(L8B, free) == 488_281
    # Either way: 32 × 4K (128K tokens) fit, 32 × 32K (1M tokens) do not.
    assert max_batch(L8B, a100, 4096) >= 32
    assert max_batch(L8B, a100, 32768) < 32
    assert max_batch(L8B, a100, 4096) == 119 and max_batch(L8B, a100, 32768) == 14


def test_kv8_80_layers_8_kv_heads_both_readings_of_32k():
    spec = ModelSpec.preset("80L-8kv")
    per_token = kv_bytes_per_token(spec, "bf16")
    assert per_token == 327_680 and r(per_token / 1e6, 2) == 0.33
    assert r(kv_cache_bytes(spec, 32_768) / GB, 2) == 10.74  # "~10.7 GB"
    assert r(kv_cache_bytes(spec, 32_768, batch=8) / GB, 1) == 85.9  # "~86 GB"
    assert kv_cache_bytes(spec, 32_768) / GiB == 10.0  # the same number in binary units
    assert r(kv_cache_bytes(spec, 32_000) / GB, 1) == 10.5
    assert r(kv_cache_bytes(spec, 32_000, batch=8) / GB, 1) == 83.9
    for tokens in (32_000, 32_768):  # either way 8 requests exceed an 80 GB accelerator
        assert kv_cache_bytes(spec, tokens, batch=8) > HARDWARE["h100"].memory_bytes


def test_kv9_gqa_is_8x_smaller_than_mha():
    gqa, mha = MODELS["llama-2-70b"], MODELS["llama-2-70b-mha"]
    assert (gqa.n_head, gqa.n_kv_head, gqa.gqa_group) == (64, 8, 8)
    assert kv_bytes_per_token(mha) / kv_bytes_per_token(gqa) == 8
    assert kv_bytes_per_token(gqa) == 327_680


def test_kv10_kv_cache_gib():
    assert kv_cache_gib(layers=32, kv_heads=8, head_dim=128, tokens=4096, batch=4,
                        bytes_per_value=2) == 2.0
    assert kv_cache_gib(32, 8, 128, tokens=16384, batch=16) == 32.0


def test_kv11_cache_outgrows_the_weights():
    w = weight_bytes(L8B, "bf16")
    assert kv_cache_bytes(L8B, 4096, batch=32) > w  # large batch: 17.2 GB > 16 GB
    assert kv_cache_bytes("llama-7b", 32768) > weight_bytes("llama-7b")  # long context
    t = kv_crossover_tokens(L8B, batch=1)
    assert t == 122_071
    assert kv_cache_bytes(L8B, t) > w >= kv_cache_bytes(L8B, t - 1)
    assert kv_crossover_tokens(L8B, batch=32) == 3815


# ---------------------------------------------------------------- BATCH, MET, QUANT

def test_batch2_per_user_speed_flat_until_the_ridge():
    assert r(critical_batch(L8B, ILL)) == 333
    per_user = [decode_time(L8B, ILL, batch=b).tokens_per_s_per_user for b in (1, 64, 333)]
    assert per_user[0] == per_user[1] == per_user[2]
    assert decode_time(L8B, ILL, batch=334).tokens_per_s_per_user < per_user[0]
    assert decode_time(L8B, ILL, batch=333).bound == "memory"
    assert decode_time(L8B, ILL, batch=334).bound == "compute"


def test_batch3_kv_cache_limits_the_batch_before_compute():
    for hw in ("illustrative", "a100-80gb", "h100"):
        assert max_batch(L8B, hw, 4096) < critical_batch(L8B, hw)


def test_met2_e2e_latency_and_tokens_per_second():
    assert e2e_latency(0.3, 0.02, 500) == pytest.approx(10.3)
    assert e2e_latency(0.3, 0.02, 500, first_token_in_ttft=True) == pytest.approx(10.28)
    assert tokens_per_second(0.1) == pytest.approx(10)
    assert tokens_per_second(0.1, batch=8) == pytest.approx(80)


def test_quant2_int4_weights_change_tpot_not_ttft():
    bf16, int4 = (decode_time(L8B, ILL, precision=p) for p in ("bf16", "int4"))
    assert int4.tpot_s == pytest.approx(bf16.tpot_s / 4)
    p16, p4 = (prefill_time(L8B, ILL, 2000, precision=p) for p in ("bf16", "int4"))
    assert p4.ttft_s == p16.ttft_s  # compute-bound, same 16-bit matmuls
    assert r(critical_batch(L8B, ILL, "int4")) == 83  # int4 turns compute-bound 4x sooner


def test_quant5_fp32_is_twice_the_bytes_and_time_when_bandwidth_bound():
    fp32, bf16 = (decode_time(L8B, ILL, precision=p) for p in ("fp32", "bf16"))
    assert fp32.weight_bytes == 2 * bf16.weight_bytes
    assert fp32.tpot_s == pytest.approx(2 * bf16.tpot_s)


# ---------------------------------------------------------------- presets and configs

def test_presets_are_named_and_unknown_names_list_the_choices():
    for name in MODELS:
        assert ModelSpec.preset(name) is MODELS[name]
    for name in HARDWARE:
        assert Hardware.preset(name) is HARDWARE[name]
    with pytest.raises(ValueError, match="llama-3-8b"):
        ModelSpec.preset("gpt-9")
    with pytest.raises(ValueError, match="this_machine"):
        Hardware.preset("tpu-v9")
    assert MODELS["reference"].params == 26_792_960
    assert HARDWARE["h100"].peak_flops("bf16") == 989e12
    assert HARDWARE["a100-80gb"].bandwidth == 2.039e12
    assert HARDWARE["a100-80gb"].memory_bytes == 80e9


def test_peak_flops_fallbacks():
    assert ILL.peak_flops("fp32") == 1e15  # only a 16-bit figure is known
    assert ILL.peak_flops("int4") == 1e15
    h100 = HARDWARE["h100"]
    assert h100.peak_flops("int4") == h100.peak_flops("int8")  # no int4 figure: int8
    only_fp32 = Hardware("x", bandwidth=1e9, flops={"fp32": 1e9}, memory_bytes=1e9)
    assert only_fp32.peak_flops("bf16") == 1e9
    with pytest.raises(ValueError, match="precision"):
        h100.peak_flops("fp8")


def test_from_config_duck_typing():
    cfg = SimpleNamespace(n_layer=8, n_head=8, n_kv_head=None, n_embd=512, vocab_size=1024,
                          context_length=1024, num_params=lambda: 26_792_960)
    spec = ModelSpec.from_config(cfg, name="ref")
    assert spec == dataclasses.replace(MODELS["reference"], name="ref")
    gqa = SimpleNamespace(n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
    assert ModelSpec.from_config(gqa, params=1000).n_kv_head == 2
    with pytest.raises(ValueError, match="params"):
        ModelSpec.from_config(gqa)
    with pytest.raises(ValueError, match="n_embd"):
        ModelSpec.from_config(SimpleNamespace(n_layer=1, n_head=1))


def test_from_config_matches_the_engines_gptconfig():
    config = pytest.importorskip("minifer.config")
    cfg = config.GPTConfig(vocab_size=1024, context_length=1024, n_layer=8, n_head=8, n_embd=512)
    spec = ModelSpec.from_config(cfg)
    assert spec.params == 26_792_960
    assert kv_bytes_per_token(spec, "fp32") == 32_768


def test_roofline_is_pure_python_and_the_engine_never_imports_plotly():
    # The module imports neither torch nor plotly (it never measures: minifer_course.bench.probes
    # does), only minifer's pure-Python checks and config arithmetic; the package `minifer` may
    # import torch, but never plotly or ipywidgets.
    tree = ast.parse(inspect.getsource(rl))
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = {a.name.split(".")[0] for n in top if isinstance(n, ast.Import) for a in n.names}
    names |= {(n.module or "").split(".")[0] for n in top if isinstance(n, ast.ImportFrom)}
    assert not names & {"torch", "numpy", "plotly", "ipywidgets"}, names
    engine = {n.module for n in top if isinstance(n, ast.ImportFrom) and n.module.startswith("minifer")}
    assert engine <= {"minifer.checks", "minifer.config"}, engine
    code = ("import sys, minifer_course.roofline; "
            "bad = {'plotly', 'ipywidgets'} & set(sys.modules); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("call, words", [
    (lambda: weight_bytes(L8B, "fp8"), ["bytes_per_param", "bf16", "int4"]),
    (lambda: kv_bytes_per_token(L8B, "int3"), ["bytes_per_value", "fp16"]),
    (lambda: kv_bytes_per_token(L8B, -1), ["bytes_per_value", "> 0"]),
    (lambda: kv_cache_bytes(L8B, -5), ["tokens", ">= 0"]),
    (lambda: kv_cache_bytes(L8B, 5, batch=-1), ["batch", ">= 0"]),
    (lambda: kv_cache_gib(0, 8, 128, 1, 1), ["layers", ">= 1"]),
    (lambda: decode_time(L8B, ILL, batch=0), ["batch", ">= 1"]),
    (lambda: decode_time(L8B, ILL, context=-1), ["context", ">= 0"]),
    (lambda: decode_time(L8B, ILL, precision="fp64"), ["precision", "fp32"]),
    (lambda: decode_time(L8B, ILL, kv_precision="fp64"), ["kv_precision", "int8"]),
    (lambda: decode_time(L8B, "tpu"), ["unknown hardware", "h100"]),
    (lambda: decode_time("gpt-9", ILL), ["unknown model", "reference"]),
    (lambda: prefill_time(L8B, ILL, prompt_tokens=0), ["prompt_tokens", ">= 1"]),
    (lambda: max_batch(L8B, ILL, context=0), ["context", ">= 1"]),
    (lambda: mbu(1e9, 0, 0, 1e12), ["tpot_s", "> 0"]),
    (lambda: mbu(-1, 0, 1, 1e12), ["weight_bytes", ">= 0"]),
    (lambda: mfu(1.0, 0), ["peak_flops", "> 0"]),
    (lambda: e2e_latency(-0.1, 0.02, 5), ["ttft_s", ">= 0"]),
    (lambda: e2e_latency(0.1, 0.02, -5), ["output_tokens", ">= 0"]),
    (lambda: tokens_per_second(0), ["tpot_s", "> 0"]),
    (lambda: ModelSpec("x", 1e9, 2, 8, 3, 64, 512), ["n_kv_head", "divide"]),
    (lambda: ModelSpec("x", -1, 2, 8, 8, 64, 512), ["params", "> 0"]),
    (lambda: Hardware("x", bandwidth=0, flops={"bf16": 1}, memory_bytes=1), ["bandwidth"]),
    (lambda: Hardware("x", bandwidth=1, flops={"fp64": 1}, memory_bytes=1), ["flops", "bf16"]),
    (lambda: kv_tokens_fit(L8B, float("nan")), ["free_bytes"]),
])
def test_bad_input_names_the_parameter_and_the_allowed_values(call, words):
    with pytest.raises(ValueError) as err:
        call()
    for word in words:
        assert word in str(err.value)


def test_weights_that_do_not_fit_leave_room_for_no_sequence():
    assert max_batch("llama-2-70b", "h100", 1024) == 0  # 140 GB of weights > 80 GB


# ---------------------------------------------------------------- properties

specs = st.sampled_from(list(MODELS.values()))
hardware = st.sampled_from(list(HARDWARE.values()))
precisions = st.sampled_from(list(BYTES_PER_VALUE))
small = st.integers(min_value=0, max_value=10_000)
positive = st.integers(min_value=1, max_value=4096)


@given(spec=specs, tokens=small, batch=small, k=st.integers(1, 16), p=precisions)
def test_kv_bytes_linear_in_tokens_and_batch(spec, tokens, batch, k, p):
    base = kv_cache_bytes(spec, tokens, batch, p)
    assert kv_cache_bytes(spec, tokens * k, batch, p) == k * base
    assert kv_cache_bytes(spec, tokens, batch * k, p) == k * base
    assert base == kv_bytes_per_token(spec, p) * tokens * batch


@given(layers=st.integers(1, 128), kv_heads=st.integers(1, 64), head_dim=st.integers(1, 256),
       tokens=small, batch=small, k=st.integers(1, 8))
def test_kv_gib_linear_in_every_shape_factor(layers, kv_heads, head_dim, tokens, batch, k):
    base = kv_cache_gib(layers, kv_heads, head_dim, tokens, batch)
    assert kv_cache_gib(layers * k, kv_heads, head_dim, tokens, batch) == pytest.approx(k * base)
    assert kv_cache_gib(layers, kv_heads * k, head_dim, tokens, batch) == pytest.approx(k * base)
    assert kv_cache_gib(layers, kv_heads, head_dim * k, tokens, batch) == pytest.approx(k * base)
    spec = ModelSpec("s", 1e9, layers, kv_heads, kv_heads, head_dim, kv_heads * head_dim)
    assert kv_cache_bytes(spec, tokens, batch) / GiB == pytest.approx(base)


@given(spec=specs, hw=hardware, b1=positive, b2=positive, context=small, p=precisions,
       kv=st.booleans(), attn=st.booleans())
def test_tpot_and_total_throughput_never_fall_as_batch_grows(spec, hw, b1, b2, context, p,
                                                            kv, attn):
    lo, hi = sorted((b1, b2))
    a = decode_time(spec, hw, lo, context, p, include_kv=kv, include_attention=attn)
    b = decode_time(spec, hw, hi, context, p, include_kv=kv, include_attention=attn)
    assert a.tpot_s <= b.tpot_s
    assert a.tokens_per_s_total <= b.tokens_per_s_total * (1 + 1e-12)
    assert a.tokens_per_s_per_user >= b.tokens_per_s_per_user


@given(spec=specs, hw=hardware, batch=positive, context=small, p=precisions,
       kv=st.booleans(), attn=st.booleans())
def test_bound_switches_at_the_ridge_point(spec, hw, batch, context, p, kv, attn):
    step = decode_time(spec, hw, batch, context, p, include_kv=kv, include_attention=attn)
    ridge = ridge_point(hw, step.compute_precision)
    ai = step.arithmetic_intensity
    if not math.isclose(ai, ridge, rel_tol=1e-9):
        assert step.bound == ("compute" if ai > ridge else "memory")
    assert step.tpot_s == max(step.read_s, step.compute_s)
    assert max(step.mbu, step.mfu) == pytest.approx(1.0)
    assert step.flops / step.bytes_read == ai


@given(spec=specs, hw=hardware, batch=positive, tokens=st.integers(1, 8192))
def test_prefill_is_never_less_compute_heavy_than_decode(spec, hw, batch, tokens):
    p = prefill_time(spec, hw, tokens, batch)
    d = decode_time(spec, hw, batch)
    assert p.arithmetic_intensity == pytest.approx(tokens * d.arithmetic_intensity)
    assert p.ttft_s >= d.tpot_s


@given(spec=specs, hw=hardware, context=st.integers(1, 200_000), p=precisions)
def test_max_batch_fits_and_one_more_does_not(spec, hw, context, p):
    n = max_batch(spec, hw, context, p)
    kv_p = decode_time(spec, hw, 1, 0, p).kv_precision
    used = weight_bytes(spec, p) + kv_cache_bytes(spec, context, n, kv_p)
    if n > 0:
        assert used <= hw.memory_bytes
    more = weight_bytes(spec, p) + kv_cache_bytes(spec, context, n + 1, kv_p)
    assert more > hw.memory_bytes


@given(ttft=st.floats(0, 10), tpot=st.floats(0, 1), n=st.integers(1, 10_000))
def test_e2e_latency_is_ttft_plus_n_steps(ttft, tpot, n):
    assert e2e_latency(ttft, tpot, n) == pytest.approx(ttft + tpot * n)
    assert e2e_latency(ttft, tpot, n) >= e2e_latency(ttft, tpot, n, first_token_in_ttft=True)


def test_kv_transfer_of_one_prompt():
    """PD-12's transfer cost: a Llama-3-8B 4,096-token prompt's 16-bit K/V is 512 MiB."""
    nv = rl.kv_transfer("llama-3-8b", 4096, "nvlink-h100")
    eth = rl.kv_transfer("llama-3-8b", 4096, "ethernet-100g")
    assert nv.nbytes == eth.nbytes == 2 * 32 * 8 * 128 * 2 * 4096 == 512 * 2**20
    assert round(nv.ms, 2) == 1.19 and round(rl.kv_transfer("llama-3-8b", 4096, "pcie-5").ms, 1) == 8.4
    assert round(eth.ms) == 43 and eth.seconds == pytest.approx(10e-6 + 512 * 2**20 / 12.5e9)
    with pytest.raises(ValueError, match="prompt_tokens"):
        rl.kv_transfer("llama-3-8b", 0)
