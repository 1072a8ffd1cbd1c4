"""`minifer_course.your_engine`, the learner's engine assembled (lesson 14): it gives minifer's
tokens exactly — greedy and seeded sampling, alone and batched, through preemption, in int8, with
a draft model, over HTTP — and imports nothing of minifer's engine for its mechanism."""

from __future__ import annotations

import copy
import inspect
import json
import re
import urllib.error
import urllib.request

import pytest
import torch

import minifer as mf
from minifer.engine.block_manager import BlockManager
from minifer.quantization import QuantizedLinear
from minifer_course import your_engine as E
from minifer_course.lessons import capstone as L

PROMPTS = ["ROMEO:\n", "JULIET:\nO Romeo, Romeo", "KING HENRY:\nOnce more unto the breach",
           "HAMLET:\nTo be", "First Citizen:\nBefore we proceed any further, hear me speak.\n"]
POOL = dict(num_blocks=10, block_size=8, max_num_seqs=3)  # too small for all: preemptions


def params(n: int = 24) -> list[mf.SamplingParams]:
    """Greedy and seeded sampling, alternately (top-k, top-p and the penalty on some)."""
    return [mf.SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True) if i % 2 == 0 else
            mf.SamplingParams(temperature=0.8, top_k=40 * (i % 3), top_p=0.9, seed=i,
                              repetition_penalty=1.0 + 0.1 * (i % 3), max_new_tokens=n,
                              ignore_eos=True) for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def shakespeare():
    return mf.load_pretrained("shakespeare")


@pytest.fixture(scope="module")
def draft():
    return mf.load_pretrained("shakespeare-draft")[0]


@pytest.fixture(scope="module")
def alone(shakespeare):
    model, tok = shakespeare
    return [mf.generate(model, p, sp, tok)[0].token_ids for p, sp in zip(PROMPTS, params())]


def test_imports_nothing_of_minifers_engine():
    imports = {line.split()[1] for name in E.FILES for line in
               inspect.getsource(getattr(E, name)).splitlines()
               if line.startswith(("import ", "from "))}
    assert {i for i in imports if i.startswith("minifer")} == {"minifer", "minifer.tokenizer"}
    server = inspect.getsource(E.server)
    assert set(re.findall(r"mf\.(\w+)", server)) == {"SamplingParams"}  # its only use of minifer


def test_loop_and_cache_give_generates_tokens(shakespeare):
    model, tok = shakespeare
    ids = tok.encode("ROMEO:\nBut soft")
    greedy = mf.SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    theirs = mf.generate(model, [ids], greedy)[0].token_ids
    assert E.greedy_loop(model, ids, 12, tok.vocab_size) == theirs
    assert E.greedy_cached(model, ids, 12, tok.vocab_size) == theirs


def test_generate_until_stops_at_eos_like_minifer(shakespeare):
    model, tok = shakespeare
    ids = tok.encode("ROMEO:\n")
    first = E.greedy_loop(model, ids, 6, tok.vocab_size)
    mine, why = E.generate_until(model, ids, 20, tok.vocab_size, eos_id=first[3])
    assert (mine, why) == (first[:4], "eos")


def test_sampler_draws_minifers_tokens(shakespeare):
    model, tok = shakespeare
    V = tok.vocab_size
    logits = E.prefill(model, tok.encode("JULIET:\n"), E.Cache(model, 16))[:V]
    seen = torch.zeros(V, dtype=torch.bool)
    seen[tok.encode("JULIET:\n")] = True
    for p in (mf.SamplingParams(temperature=0.7, top_k=20, top_p=0.9),
              mf.SamplingParams(temperature=1.3, repetition_penalty=1.4),
              mf.SamplingParams(temperature=0, top_k=5, repetition_penalty=2.0)):
        for s in range(6):
            mine = E.pick(logits, p, seen, torch.Generator().manual_seed(s))
            theirs = mf.sampling.sample(logits[None], p, seen[None], [torch.Generator().manual_seed(s)])
            assert mine == int(theirs[0]), (p, s)
        assert torch.equal(E.my_sampler(logits, seen, p.temperature or 1.0, p.top_k, p.top_p,
                                         p.repetition_penalty),
                           mf.sampling.process_logits(logits[None], mf.SamplingParams(
                               temperature=p.temperature or 1.0, top_k=p.top_k, top_p=p.top_p,
                               repetition_penalty=p.repetition_penalty), seen[None])[0])


def test_allocator_hands_out_blocks_like_minifers_block_manager():
    mine, theirs = E.Allocator(12, 4), BlockManager(12, 4)
    for op, seq, n in [("+", "A", 6), ("+", "B", 3), ("+", "A", 9), ("+", "B", 5), ("-", "A", 0),
                       ("+", "C", 10)]:
        if op == "-":
            mine.release(seq)
            theirs.free(seq)
        elif seq in theirs.tables:
            assert mine.grow(seq, n)
            theirs.append_slots(seq, n)
        else:
            assert mine.grow(seq, n)
            theirs.allocate(seq, [0] * n)
        assert mine.tables == theirs.tables and len(mine.free) == theirs.num_free_blocks
    assert not mine.grow("D", 4 * 9) and "D" not in mine.tables  # too big: nothing taken


def test_engine_batched_with_preemption_equals_alone_and_minifers_schedule(shakespeare, alone):
    model, tok = shakespeare
    engine = E.Engine(model, tok, **POOL)
    mine = engine.generate(PROMPTS, params())
    assert mine == alone
    assert sum(len(e["preempted"]) for e in engine.log) > 0
    assert not engine.blocks.tables and len(engine.blocks.free) == POOL["num_blocks"]
    theirs = mf.LLMEngine(model, tok, **POOL)
    for p, sp in zip(PROMPTS, params()):
        theirs.add_request(p, sp)
    steps, outs = [], {}
    while theirs.has_unfinished():
        outs.update((o.request_id, o.token_ids) for o in theirs.step() if o.finished)
        s = theirs.last_step
        steps.append((sorted([r for r, _ in s.prefill] + s.decode), s.preempted))
    assert [outs[f"req-{i}"] for i in range(len(PROMPTS))] == alone
    assert [(sorted(e["ran"]), e["preempted"]) for e in engine.log] == steps


def test_engine_stops_at_every_eos_id_as_minifer_does(shakespeare):
    model, tok = shakespeare
    greedy = mf.SamplingParams(temperature=0, max_new_tokens=30)
    first = mf.generate(model, PROMPTS, greedy, tok)
    stopping = copy.copy(tok)
    stopping.eos_token_id = first[1].token_ids[5]  # a token the answers make: some stop early
    theirs = [c.token_ids for c in mf.generate(model, PROMPTS, greedy, stopping)]
    assert any(len(t) < 30 for t in theirs)
    assert E.Engine(model, stopping, **POOL).generate(PROMPTS, greedy) == theirs


def test_int8_layer_and_engine_equal_minifers_reference_int8(shakespeare):
    model, tok = shakespeare
    lin = model.transformer.h[0].mlp.c_fc
    x = torch.randn(3, lin.in_features, generator=torch.Generator().manual_seed(0))
    assert torch.equal(E.Int8Linear(lin)(x), QuantizedLinear.from_linear(lin, 8, impl="reference")(x))
    int8 = E.quantized(model)
    assert isinstance(int8.lm_head, E.Int8Linear) and isinstance(model.lm_head, torch.nn.Linear)
    reference = mf.quantize(model, "int8", impl="reference")
    alone8 = [mf.generate(reference, p, sp, tok)[0].token_ids for p, sp in zip(PROMPTS, params())]
    assert E.Engine(int8, tok, **POOL).generate(PROMPTS, params()) == alone8


def test_speculative_loop_and_engine_give_the_targets_tokens(shakespeare, draft, alone):
    model, tok = shakespeare
    ids = tok.encode("ROMEO:\nBut soft")
    greedy = mf.SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    out, passes, rounds = E.my_speculative(model, draft, ids, 4, 40, tok.vocab_size)
    theirs = mf.speculative_generate(model, draft, [ids], greedy, k=4)[0]
    assert out == theirs.token_ids == mf.generate(model, [ids], greedy)[0].token_ids
    assert passes == theirs.stats.target_passes == len(rounds) + 1
    engine = E.Engine(model, tok, draft=draft, k=4, **POOL)
    assert engine.generate(PROMPTS, params()) == alone
    assert any(kind == "verify" for e in engine.log for kind in e["ran"].values())
    plain = E.Engine(model, tok, **POOL)
    plain.generate(PROMPTS, params())
    assert len(engine.log) < len(plain.log)


def test_server_streams_minifers_tokens_to_concurrent_clients(shakespeare, draft, alone):
    model, tok = shakespeare
    bodies = [dict(prompt=p, max_tokens=sp.max_new_tokens, temperature=sp.temperature, top_k=sp.top_k,
                   top_p=sp.top_p, seed=sp.seed, ignore_eos=True) for p, sp in zip(PROMPTS, params())
              if sp.repetition_penalty == 1.0]
    expected = [t for t, sp in zip(alone, params()) if sp.repetition_penalty == 1.0]
    with E.serve(E.Engine(model, tok, draft=draft, **POOL)) as url:
        assert url.startswith("http://127.0.0.1:")
        results = E.load(url, bodies, [0.01 * i for i in range(len(bodies))])
        whole = urllib.request.urlopen(urllib.request.Request(
            f"{url}/v1/completions", json.dumps(bodies[0]).encode(),
            {"Content-Type": "application/json"}), timeout=60)
        answer = json.loads(whole.read())["choices"][0]
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(urllib.request.Request(
                f"{url}/v1/completions", json.dumps({"prompt": "x", "temperature": -1}).encode(),
                {"Content-Type": "application/json"}), timeout=60)
        assert err.value.code == 400
    assert [r["tokens"] for r in results] == expected
    assert [r["text"] for r in results] == [tok.decode(t) for t in expected]
    assert all(r["ttft"] > 0 and len(r["itl"]) == r["events"] - 1 for r in results)
    assert answer["token_ids"] == expected[0] and answer["finish_reason"] == "length"


def test_read_events_parses_server_sent_events():
    lines = ['data: {"choices": [{"text": "a"}]}', "", 'data: {"choices": []}', "", "data: [DONE]", ""]
    assert E.read_events(lines) == [{"choices": [{"text": "a"}]}, {"choices": []}]
    with pytest.raises(AssertionError):
        E.read_events(lines[:2])  # no [DONE]: the stream was cut


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_tiny_checkpoints_run_in_your_engine_as_in_minifer(tmp_path, family):
    model, tok = mf.load_hf_checkpoint(L.write_tiny_checkpoint(tmp_path / family, family),
                                       dtype=torch.float32)
    assert model.config.positions == "rope" and model.config.qk_norm == (family == "qwen3")
    ps = params(16)
    alone = [mf.generate(model, p, sp, tok)[0].token_ids for p, sp in zip(PROMPTS, ps)]
    assert E.Engine(model, tok, **POOL).generate(PROMPTS, ps) == alone


def test_cached_checkpoint_finds_the_smallest_in_the_hub_layout(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert L.cached_checkpoint() is None
    sizes = {}
    for name, family in (("Org--a", "llama"), ("Org--b", "qwen3")):
        folder = L.write_tiny_checkpoint(tmp_path / f"models--{name}" / "snapshots" / "abc", family)
        sizes[folder] = (folder / "model.safetensors").stat().st_size
    assert len(set(sizes.values())) == 2 and L.cached_checkpoint() == min(sizes, key=sizes.get)
    assert L.cached_checkpoint(max_gb=1e-9) is None


def test_code_lines_skip_blanks_comments_and_docstrings():
    text = 'def f():\n    """Doc\n    more."""\n    # a comment\n\n    return 1  # counted\n'
    assert L.code_lines(text) == 2
    assert sum(r["lines"] for r in L.source_rows()) > sum(r["code lines"] for r in L.source_rows())
