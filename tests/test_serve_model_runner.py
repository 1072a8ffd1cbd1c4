"""The step's two new pieces: `ModelRunner` packs decode rows and prompt chunks into one forward
call (`PackedBatch`) with the logits of separate calls, and `Scheduler.postprocess` records a
step (tokens computed, blocks named, tokens appended, requests finished)."""

from __future__ import annotations

import pytest
import torch

from conftest import packed_batch
from minifer import LLMEngine, SamplingParams
from minifer.engine.block_manager import BlockManager
from minifer.engine.kv_pool import PackedBatch, PagedKVPool
from minifer.fast import paged
from minifer.fast.paged import PlannedAttention, group_rows


def _prompts(n_tokens, seed=4):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in n_tokens]


def _setup(model, prompts, cached, block_size=4):
    """A pool whose row i holds the K/V of ``prompts[i][:cached[i]]`` (one call per row)."""
    bm, pool = BlockManager(128, block_size), PagedKVPool.for_model(model, 128, block_size)
    for i, p in enumerate(prompts):
        bm.allocate(i, p)
        if cached[i]:
            model(torch.tensor([p[:cached[i]]]),
                  cache=packed_batch(pool, [bm.tables[i]], [0], [cached[i]], read="slots"))
    return bm, pool


@pytest.mark.parametrize("read", ["blocks", "slots", "kernel"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@torch.inference_mode()
def test_a_packed_step_of_decode_rows_and_prompt_chunks_equals_separate_calls(model, block_size,
                                                                            read):
    """Three decode rows (different contexts), a whole prompt and a prompt's second chunk in one
    call: each row's last-token logits, and every K/V it writes, equal those of a separate call
    per row (to 1e-6 of the logits' scale; the argmax exactly)."""
    prompts = _prompts([6, 18, 10, 13, 21])
    cached = [5, 17, 9, 0, 7]  # rows 0-2 decode their last prompt token; 3 prefills; 4 resumes
    feed = [p[c:] for p, c in zip(prompts, cached)]
    bm, pool = _setup(model, prompts, cached, block_size)
    tables = [bm.tables[i] for i in range(len(prompts))]
    ref = [model(torch.tensor([f]), cache=packed_batch(pool, [t], [c], [len(f)], read="slots"))[0]
           for t, c, f in zip(tables, cached, feed)]
    ref_kv = [x.clone() for x in pool.k + pool.v]

    bm, pool = _setup(model, prompts, cached, block_size)
    batch = packed_batch(pool, tables, cached, [len(f) for f in feed], read=read)
    ids = torch.tensor([[t for f in feed for t in f]])
    logits = model(ids, cache=batch)
    assert logits.shape == (len(prompts), model.config.vocab_size)
    ref = torch.stack(ref)
    scale = ref.abs().max()
    assert (logits - ref).abs().max() <= 1e-6 * scale
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))
    for a, b in zip(pool.k + pool.v, ref_kv):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()


@torch.inference_mode()
def test_packed_batch_logits_rows_and_refusals(tiny):
    prompts = _prompts([3, 9])
    bm, pool = _setup(tiny, prompts, [2, 0])
    tables = [bm.tables[0], bm.tables[1]]
    batch = PackedBatch(pool, tables, [2, 0], [1, 9], logits_rows=[1])
    assert batch.positions.tolist() == [[2, *range(9)]] and batch.logits_index.tolist() == [9]
    first = tiny(torch.tensor([[prompts[0][2], *prompts[1]]]), cache=batch)
    assert first.shape == (1, 257)
    # a decode row after a prompt chunk (any order): each row's logits as before
    again = tiny(torch.tensor([[*prompts[1], prompts[0][2]]]),
                 cache=PackedBatch(pool, tables[::-1], [0, 2], [9, 1], logits_rows=[0]))
    assert (again - first).abs().max() <= 1e-6 * first.abs().max()
    with pytest.raises(ValueError, match="at least one token"):
        PackedBatch(pool, tables, [2, 0], [1, 0])
    with pytest.raises(ValueError, match="cannot hold"):
        PackedBatch(pool, tables, [2, 600], [1, 9])
    with pytest.raises(ValueError, match=r"shape \(1, 10\)"):
        tiny(torch.tensor([[1] * 9]), cache=PackedBatch(pool, tables, [2, 0], [1, 9]))


def _engine(model, **kw):
    return LLMEngine(model, max_num_seqs=4, block_size=4, enable_chunked_prefill=True,
                     max_num_batched_tokens=16, **kw)


def test_every_step_is_one_forward_call_whatever_it_mixes(tiny):
    eng = _engine(tiny)
    for p in _prompts([5, 20, 9, 30, 3]):
        eng.add_request(p, SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))
    mixed = 0
    while eng.has_unfinished():
        calls = eng.runner.num_forward_calls
        eng.step()
        assert eng.runner.num_forward_calls == calls + 1
        mixed += bool(eng.last_step.decode and eng.last_step.prefill)
    assert mixed >= 1  # decode rows and prompt chunks did share a call
    assert eng.runner.forward_time_s > 0
    assert eng.num_decode_tokens == 5 * 5  # each request feeds back 5 of its 6 tokens
    assert eng.num_prefill_tokens == 5 + 20 + 9 + 30 + 3
    assert eng.block_manager.num_used_blocks == 0


@torch.inference_mode()
def test_execute_returns_tokens_in_the_order_of_the_chunks(tiny):
    """Packing sorts decode rows first; the tokens still come back in the caller's order."""
    eng = _engine(tiny)
    for p in _prompts([5, 7, 4]):
        eng.add_request(p, SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
    eng.step()  # all three prompts
    eng.add_request(_prompts([6], seed=9)[0], SamplingParams(temperature=0, max_new_tokens=4))
    plan = eng.scheduler.schedule()
    assert [c.num_new for c in plan.chunks] == [1, 1, 1, 6]
    forward = eng.runner.execute(plan.chunks)
    assert len(set(forward)) == 4  # distinct: a mix-up would show
    backward = eng.runner.execute(plan.chunks[::-1])  # the same K/V, written again
    assert backward == forward[::-1]
    eng.scheduler.postprocess(plan, forward)
    assert [r.seq.output_ids[-1] for r in eng.scheduler.running] == forward


def test_postprocess_records_the_step(tiny):
    """Tokens computed move on, a partial prompt chunk samples nothing, finished requests leave
    and free their blocks, prefix blocks are named, and the step's clock is the caller's."""
    eng = _engine(tiny, enable_prefix_caching=True)
    sch, bm = eng.scheduler, eng.block_manager
    short, long_ = _prompts([5, 20])
    a = eng.add_request(short, SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True))
    b = eng.add_request(long_, SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True))
    ra, rb = eng.requests[a], eng.requests[b]
    plan = sch.schedule()
    assert [(c.request.request_id, c.start, c.num_new) for c in plan.chunks] == [(a, 0, 5),
                                                                                (b, 0, 11)]
    assert plan.due == [plan.chunks[0]] and plan.chunks[1].block_table == bm.block_table(b)
    with pytest.raises(ValueError, match="one token per due chunk"):
        sch.postprocess(plan, [1, 2])
    free = bm.num_free_blocks
    outs = sch.postprocess(plan, [42], now=123.0)
    assert (ra.num_computed, rb.num_computed) == (5, 11)
    assert [(o.request_id, o.token_ids, o.finished, o.finish_reason) for o in outs] == [
        (a, [42], True, "length")]
    assert ra.metrics.token_times == [123.0] and ra.metrics.finished_time == 123.0
    assert ra not in sch.running and rb in sch.running and rb.seq.output_ids == []
    assert bm.num_free_blocks == free + 2  # a's two blocks (5 tokens of 4)
    named = [bm.blocks[i].hash is not None for i in bm.block_table(b)]
    assert named == [True, True, False, False, False]  # 11 of 22 tokens computed: 2 full blocks


@torch.inference_mode()
def test_block_reads_equal_slot_reads(model):
    """The block-table path and the slot-gather reference: the same attention to float
    rounding, on rows whose last blocks are partly filled."""
    prompts = _prompts([7, 23, 2, 16, 30])
    cached = [6, 22, 1, 0, 9]
    bm, pool = _setup(model, prompts, cached)  # blocks of 4 tokens
    tables = [bm.tables[i] for i in range(len(prompts))]
    num_new = [len(p) - c for p, c in zip(prompts, cached)]
    ids = torch.tensor([[t for p, c in zip(prompts, cached) for t in p[c:]]])
    nh, hd = model.config.n_head, model.config.head_dim
    q = torch.randn(1, nh, ids.shape[1], hd, generator=torch.Generator().manual_seed(0))
    k = torch.randn(1, model.config.kv_heads, ids.shape[1], hd)
    got = {r: packed_batch(pool, tables, cached, num_new, read=r).attend(0, q, k, k)
           for r in ("blocks", "slots", "kernel")}
    assert (got["blocks"] - got["slots"]).abs().max() <= 1e-6
    assert (got["kernel"] - got["slots"]).abs().max() <= 1e-6
    split = PackedBatch(pool, tables, cached, num_new)
    split.attention = PlannedAttention(split, group_cost=0)  # one call per length
    assert len(split.attention.groups) == 3  # decode rows of 7, 23 and 2 tokens: 2, 6, 1 blocks
    assert (split.attend(0, q, k, k) - got["slots"]).abs().max() <= 1e-6
    with pytest.raises(ValueError, match="read must be one of"):
        packed_batch(pool, tables, cached, num_new, read="pages")


def test_the_slot_reference_path_gives_the_same_tokens(tiny):
    prompts = _prompts([5, 20, 9, 30, 3], seed=11)
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    outs = []
    for read in ("blocks", "slots", "kernel"):
        with paged.read(read):
            eng = _engine(tiny)
        outs.append([o.token_ids for o in eng.generate(prompts, params)])
    assert outs[0] == outs[1] == outs[2]


def test_decode_rows_are_grouped_by_length_when_padding_costs_more_than_a_call():
    assert group_rows([5, 200, 7, 190], 16, 128) == [[1, 3], [0, 2]]
    assert group_rows([5, 200, 7, 190], 16, 10_000) == [[0, 1, 2, 3]]  # calls too dear
    assert group_rows([30, 40, 20], 16, 0) == [[1], [0, 2]]  # 3 blocks; 2 and 2 share a call
    assert sorted(i for g in group_rows(list(range(1, 40)), 4, 8) for i in g) == list(range(39))
