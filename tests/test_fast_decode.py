"""The fast decode paths compute what the reference paths compute.

Eager lean step (filled slots only) == fixed-shape step (every slot, masked) == compiled step ==
the checked forward pass, with and without left padding, for plain and grouped-query attention
and the int8 cache; the baselines the benchmark compares against give the same greedy tokens.
No timing here: that lives in `python -m minifer_course.bench decode --table`.
"""

from __future__ import annotations

import shutil

import pytest
import torch

import minifer as mf
from conftest import on_device
from minifer.fast.compiled import compiled_decode
from minifer.fast.decode import LeanStep
from minifer_course.bench.baselines import MinifierDecoder, TextbookEngine, hf_available

GREEDY = mf.SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
PROMPTS = [[72, 101, 108, 108, 111], [7], list(range(40, 75)), [200, 3, 3, 3, 250, 1, 9]]


def _greedy_steps(model, prompts, steps: int, how: str, kv_dtype=None) -> list[list[int]]:
    """Greedy tokens of a left-padded batch, decoding with `how`: "forward" (the checked,
    variable-shape forward pass), "eager" (the lean step) or "fixed" (the fixed-shape step)."""
    B, T = len(prompts), max(map(len, prompts))
    ids = torch.zeros(B, T, dtype=torch.long, device=next(model.parameters()).device)
    for b, p in enumerate(prompts):
        ids[b, T - len(p):] = torch.tensor(p)
    cache = mf.StaticKVCache.for_model(model, B, T + steps, dtype=kv_dtype)
    cache.reset([T - len(p) for p in prompts])
    out = []
    with torch.inference_mode():
        tok = mf.prefill(model, ids, cache).argmax(-1)
        for _ in range(steps):
            out.append(tok)
            if how == "forward":
                logits = model(tok.view(-1, 1), cache=cache)[:, -1]
            else:
                step = LeanStep(fixed_shape=how == "fixed")
                logits = mf.decode_step(model, tok, cache, step=step)
            tok = logits.argmax(-1)
    return torch.stack(out, 1).tolist()


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_lean_and_fixed_shape_steps_equal_the_forward_pass(model, kv_dtype, device):
    model = on_device(model, device)  # the fixed-shape step is what a CUDA graph captures
    ref = _greedy_steps(model, PROMPTS, 20, "forward", kv_dtype)
    assert _greedy_steps(model, PROMPTS, 20, "eager", kv_dtype) == ref
    assert _greedy_steps(model, PROMPTS, 20, "fixed", kv_dtype) == ref
    assert len({t for row in ref for t in row}) > 5  # varied output, not one repeated token


def test_fixed_shape_logits_match_eager_closely(tiny):
    """Same math over more (masked) slots: logits agree to fp32 rounding."""
    ids = torch.tensor([PROMPTS[2]])
    logits = {}
    for fixed in (False, True):
        cache = mf.StaticKVCache.for_model(tiny, 1, 64)
        with torch.inference_mode():
            tok = mf.prefill(tiny, ids, cache).argmax(-1)
            logits[fixed] = mf.decode_step(tiny, tok, cache, step=LeanStep(fixed_shape=fixed))
    assert torch.allclose(logits[False], logits[True], atol=1e-5, rtol=0)


def test_lean_step_keeps_the_cache_consistent(tiny):
    cache = mf.StaticKVCache.for_model(tiny, 2, 16)
    lean, fixed = LeanStep(), LeanStep(fixed_shape=True)
    with torch.inference_mode():
        tok = mf.prefill(tiny, torch.tensor([[1, 2, 3], [4, 5, 6]]), cache).argmax(-1)
        mf.decode_step(tiny, tok, cache, step=lean)
        assert cache.pos == 4 and lean.writer.slot.item() == 3 and lean.writer.kv_len == 4
        cache.rollback(1)
        a = mf.decode_step(tiny, tok, cache, step=lean)
        cache.rollback(1)
        b = mf.decode_step(tiny, tok, cache, step=fixed)
        assert fixed.writer.kv_len is None  # every slot, through the mask
        other = mf.StaticKVCache.for_model(tiny, 2, 16)
        mf.prefill(tiny, torch.tensor([[1, 2, 3], [4, 5, 6]]), other)
        c = mf.decode_step(tiny, tok, other, step=lean)  # a new cache: a new writer
        assert lean.writer.cache is other
    assert torch.equal(a.argmax(-1), b.argmax(-1)) and torch.equal(a, c)
    with pytest.raises(ValueError, match="KV cache full"):
        cache.pos = cache.max_len
        mf.decode_step(tiny, tok, cache, step=lean)


def test_generate_decodes_with_the_lean_step_unless_the_speed_ups_are_off(tiny):
    from minifer import hooks

    cache = mf.StaticKVCache.for_model(tiny, 1, 8)
    assert isinstance(hooks.decode_function(tiny, cache, False), LeanStep)
    with mf.fast.disabled():
        assert hooks.decode_function(tiny, cache, False) is None
        assert hooks.decode_function(tiny, cache, True) is None


def test_generate_batched_equals_alone_and_recomputed(model, device):
    model = on_device(model, device)
    batched = [c.token_ids for c in mf.generate(model, PROMPTS, GREEDY)]
    alone = [mf.generate(model, [p], GREEDY)[0].token_ids for p in PROMPTS]
    recomputed = [c.token_ids for c in mf.generate(model, PROMPTS, GREEDY, use_cache=False)]
    assert batched == alone == recomputed


def test_compile_argument_is_checked(tiny):
    with pytest.raises(ValueError, match="compile"):
        mf.generate(tiny, [1, 2], GREEDY, compile="fastest")
    with pytest.raises(ValueError, match="use_cache"):
        mf.generate(tiny, [1, 2], GREEDY, compile=True, use_cache=False)
    with pytest.raises(ValueError, match="compile mode"):
        compiled_decode(tiny, "turbo")


def _inductor_can_run() -> str | None:
    """Why torch.compile cannot run its CPU backend here (None if it can)."""
    if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        return "torch.compile's CPU backend (inductor) needs a C++ compiler; none found"
    try:
        import torch._inductor  # noqa: F401
    except Exception as err:  # pragma: no cover - depends on the torch build
        return f"torch.compile's inductor backend is unavailable: {err}"
    return None


_COMPILED_RUN = """
import json, sys
import minifer as mf
from conftest import lively_model
prompts, greedy = json.loads(sys.argv[1]), mf.SamplingParams(**json.loads(sys.argv[2]))
device = sys.argv[3]  # on CUDA, compile=True is "reduce-overhead": the step as a CUDA graph
preset = sys.argv[4]  # GPT-2-style "tiny" or Llama-style "tiny-llama" (rotary, RMSNorm, SwiGLU, GQA)
tiny = lively_model(preset).to(device)
eager = [c.token_ids for c in mf.generate(tiny, prompts, greedy)]
compiled = [c.token_ids for c in mf.generate(tiny, prompts, greedy, compile=True)]
again = [c.token_ids for c in mf.generate(tiny, prompts[:2], greedy, compile=True)]
# the CPU step froze tiny's weights into its graph: new weights loaded in place must be seen
tiny.load_state_dict(lively_model(preset, seed=1).state_dict())  # in place: graphs see it
eager_new = [c.token_ids for c in mf.generate(tiny, prompts[:2], greedy)]
compiled_new = [c.token_ids for c in mf.generate(tiny, prompts[:2], greedy, compile=True)]
print(json.dumps({"eager": eager, "compiled": compiled, "again": again,
                  "eager_new": eager_new, "compiled_new": compiled_new}))
"""


@pytest.mark.skipif(_inductor_can_run() is not None, reason=str(_inductor_can_run()))
@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_compiled_step_gives_identical_greedy_tokens(device, preset):
    """The compiled fixed-shape step (inductor on the CPU; compiling takes ~1 min on 2 busy
    cores; on CUDA captured as a CUDA graph) gives the eager step's greedy tokens exactly,
    padded batch included.

    It runs in a child process: code that inductor compiles may switch the process's floating
    point to flush subnormals to zero, which would leak into every later test.
    """
    import json
    import pathlib
    import subprocess
    import sys

    params = {"temperature": 0, "max_new_tokens": GREEDY.max_new_tokens, "ignore_eos": True}
    assert GREEDY == mf.SamplingParams(**params)
    out = subprocess.run([sys.executable, "-c", _COMPILED_RUN, json.dumps(PROMPTS),
                          json.dumps(params), device, preset], capture_output=True, text=True, timeout=900,
                         cwd=pathlib.Path(__file__).parent)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["compiled"] == got["eager"]
    assert got["again"] == got["eager"][:2]  # a new request reuses the compiled step
    assert got["eager_new"] != got["eager"][:2]  # the new weights decode other tokens ...
    assert got["compiled_new"] == got["eager_new"]  # ... and the frozen step follows them


def test_cpu_compiled_step_freezes_weights(tiny):
    """On the CPU the default compiled step freezes (and prepacks) the weights; other modes,
    which accelerators use, do not. Either way a ninth batch size or cache length compiles
    another graph instead of failing (torch's default limit is 8)."""
    from minifer.fast import compiled as generation

    frozen = compiled_decode(tiny)
    assert frozen is compiled_decode(tiny, "default")
    assert frozen is not compiled_decode(tiny, "max-autotune")
    assert generation._compiled["default", True] is frozen
    config = torch._dynamo.config
    limit = config.recompile_limit if hasattr(config, "recompile_limit") else config.cache_size_limit
    assert limit >= generation.RECOMPILE_LIMIT


def test_frozen_steps_are_dropped_when_weights_change(monkeypatch):
    """A frozen step holds a copy of the weights: a change in place (which torch's guards do not
    see) or a new tensor drops the compiled steps; the same weights keep them."""
    from conftest import lively_model
    from minifer.fast import compiled as generation

    resets = []
    monkeypatch.setattr(torch.compiler, "reset", lambda: resets.append(1))
    monkeypatch.setattr(generation, "_frozen_stamps", generation.weakref.WeakKeyDictionary())
    model = lively_model("tiny")
    generation.unfreeze_if_changed(model)
    generation.unfreeze_if_changed(model)
    assert resets == []
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight.add_(1.0)  # in place: the same storage
    generation.unfreeze_if_changed(model)
    assert resets == [1]
    generation.unfreeze_if_changed(model)
    assert resets == [1]
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    generation.unfreeze_if_changed(model)
    assert resets == [1, 1]


def test_textbook_engine_and_minifer_decoder_agree(tiny):
    prompt = torch.randint(0, 257, (3, 12), generator=torch.Generator().manual_seed(0))
    ref = [c.token_ids for c in mf.generate(tiny, prompt, mf.SamplingParams(
        temperature=0, max_new_tokens=10, ignore_eos=True))]
    for engine in (MinifierDecoder(tiny), TextbookEngine(tiny)):
        engine.start(prompt, 10)
        assert engine.decode(10).tolist() == ref
        assert engine.decode(10).tolist() == ref  # the unit can be repeated


@pytest.mark.skipif(not hf_available(), reason="missing package: transformers (minifer[hf])")
def test_transformers_baseline_agrees(make_lively):
    from minifer_course.bench.baselines import HFDecoder, to_hf

    model = make_lively("tiny", scale=5.0)
    prompt = torch.randint(0, 257, (2, 12), generator=torch.Generator().manual_seed(1))
    hf = to_hf(model)
    with torch.inference_mode():
        assert torch.allclose(hf(prompt).logits, model(prompt), atol=1e-4)
    ref = [c.token_ids for c in mf.generate(model, prompt, mf.SamplingParams(
        temperature=0, max_new_tokens=10, ignore_eos=True))]
    engine = HFDecoder(model)
    engine.start(prompt, 10)
    assert engine.decode(10).tolist() == ref
    assert engine.decode(10).tolist() == ref


def test_engine_table_runs_and_writes_json(tmp_path, capsys):
    """The benchmark's machinery on a tiny model (what it measures is not asserted)."""
    import json

    from minifer_course.bench.__main__ import main as bench_main

    out = tmp_path / "decode.json"
    assert bench_main(["decode", "--table", "--presets", "tiny", "--dtypes", "fp32", "bf16",
                       "--batches", "1", "2", "--table-prompt-tokens", "8",
                       "--table-new-tokens", "2", "--repeats", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "x floor" in text and "MBU" in text and "load average" in text
    data = json.loads(out.read_text())
    assert [(r["dtype"], r["batch"]) for r in data["rows"]] == [
        ("fp32", 1), ("fp32", 2), ("bf16", 1), ("bf16", 2)]
    row = data["rows"][0]
    assert row["step_s"] > 0 and row["floor_s"] > 0 and row["bytes_per_step"] > 0
    names = [b["name"] for b in row["baselines"]]
    assert "textbook" in names and ("transformers" in names) == hf_available()
    assert all(b["agreement"] == 1.0 for b in row["baselines"])  # fp32: identical tokens
    assert data["machine"]["torch"] == torch.__version__ and data["command"].startswith("python")
