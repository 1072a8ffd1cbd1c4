"""Tensor parallelism: the split is exact, the accounting adds up, processes never outlive a run.

Two kinds of test:
- in one process, N ranks run as N threads that all-reduce through a shared buffer: fast, and
  they check the sharding math itself (even, GQA, uneven splits, sampling);
- a few real runs of N CPU processes over gloo (`run_local`), including runs that fail on
  purpose, after which every worker must be gone.

fp32 tolerance: a rank's partial sums are added in a different order than the single-process
matmul adds them, so logits agree to rounding only; we allow 1e-4 absolute (logits are O(1..10)
here), while the greedy tokens must be identical.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

import minifer as mf
from minifer.distributed.parallel import (
    Comm,
    WorkerError,
    config_digest,
    generate_tp,
    launch,
    rank_cache,
    run_local,
    running,
    shard_gpt,
    shard_plan,
    weight_bytes,
)
from minifer.distributed.parallel.layers import sharded_parameter_names

LOGIT_ATOL = 1e-4
GREEDY = mf.SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)


# ---- N ranks as threads in this process ---------------------------------------------------
class ThreadComm:
    """The `Comm` interface for N threads: all-reduce = sum of everyone's tensor, in rank order."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size)
        self.slots: list[torch.Tensor | None] = [None] * world_size

    def for_rank(self, rank: int) -> _RankComm:
        return _RankComm(self, rank)


class _RankComm:
    def __init__(self, shared: ThreadComm, rank: int) -> None:
        self.shared, self.rank, self.world_size = shared, rank, shared.world_size
        self.reset()

    def reset(self) -> None:
        self.calls, self.bytes, self.seconds = 0, 0, 0.0

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        s = self.shared
        s.slots[self.rank] = t.clone()
        s.barrier.wait()
        everyone = list(s.slots)
        s.barrier.wait()
        self.calls += 1
        self.bytes += t.numel() * t.element_size()
        return everyone

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        everyone = self._exchange(t)
        t.copy_(torch.stack(everyone).sum(0))
        return t

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        t.copy_(self._exchange(t)[src])
        return t


def run_threads(model, world: int, prompts, params, allow_uneven=False, keep_logits=True):
    """Shard `model` over `world` thread-ranks and generate; returns the rank reports."""
    shared = ThreadComm(world)
    reports, errors = [None] * world, []

    def rank_main(rank: int) -> None:
        try:
            comm = shared.for_rank(rank)
            plan = shard_plan(model.config, world, rank, allow_uneven=allow_uneven)
            local = shard_gpt(copy.deepcopy(model), plan, comm.all_reduce)
            reports[rank] = generate_tp(local, plan, comm, prompts, params,
                                        eos_token_id=model.config.eos_token_id,
                                        keep_logits=keep_logits)
        except BaseException as err:  # pragma: no cover - surfaced below
            errors.append(err)
            shared.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return reports


def reference(model, prompts, params):
    """Single-process tokens and per-step logits of row 0 (the plain model, no sharding)."""
    cache = mf.StaticKVCache.for_model(model, 1, len(prompts[0]) + params.max_new_tokens)
    out, logits = [], []
    with torch.inference_mode():
        lg = model(torch.tensor(prompts), cache=cache, last_only=True)[:, -1]
        for _ in range(params.max_new_tokens):
            logits.append(lg[0].clone())
            tok = lg.argmax(-1)
            out.append(int(tok))
            lg = model(tok.view(1, 1), cache=cache)[:, -1]
    return out, torch.stack(logits)


PROMPT = [[72, 101, 108, 108, 111, 44, 32]]  # "Hello, "


@pytest.mark.parametrize("preset,world", [("tiny", 2), ("tiny", 4), ("tiny-gqa", 2)])
def test_threads_greedy_equals_single_process(preset, world):
    model = mf.GPT.from_config(preset, seed=1)
    ref_tokens, ref_logits = reference(model, PROMPT, GREEDY)
    reports = run_threads(model, world, PROMPT, GREEDY)
    for r in reports:
        assert r.token_ids == [ref_tokens]
        got = torch.tensor(r.logits)
        assert torch.allclose(got, ref_logits, atol=LOGIT_ATOL, rtol=0), \
            (got - ref_logits).abs().max()
    assert mf.generate(model, PROMPT, GREEDY)[0].token_ids == ref_tokens  # same as the engine


def test_threads_uneven_split_and_sampling():
    """5 heads over 2 ranks (3 + 2), as the shipped model needs; seeded sampling on rank 0."""
    cfg = mf.GPTConfig(vocab_size=257, context_length=64, n_layer=2, n_head=5, n_embd=40)
    model = mf.GPT.from_config(cfg, seed=2)
    ref_tokens, _ = reference(model, PROMPT, GREEDY)
    reports = run_threads(model, 2, PROMPT, GREEDY, allow_uneven=True)
    assert [r.q_heads for r in reports] == [(0, 3), (3, 5)]
    assert all(r.token_ids == [ref_tokens] for r in reports)
    sampled = mf.SamplingParams(temperature=1.0, top_k=20, seed=7, max_new_tokens=8,
                                ignore_eos=True)
    a = run_threads(model, 2, PROMPT, sampled, allow_uneven=True, keep_logits=False)
    b = run_threads(model, 2, PROMPT, sampled, allow_uneven=True, keep_logits=False)
    assert a[0].token_ids == a[1].token_ids == b[0].token_ids  # broadcast + same seed
    assert a[0].token_ids == [mf.generate(model, PROMPT, sampled)[0].token_ids]  # as one process


def test_threads_batch_with_left_padding():
    model = mf.GPT.from_config("tiny-gqa", seed=3)
    prompts = [PROMPT[0], PROMPT[0][2:]]
    alone = [mf.generate(model, [p], GREEDY)[0].token_ids for p in prompts]
    reports = run_threads(model, 2, prompts, GREEDY, keep_logits=False)
    assert reports[0].token_ids == alone


@pytest.mark.parametrize("preset,world", [("tiny", 2), ("tiny", 4), ("tiny-gqa", 2)])
def test_sharded_weights_and_cache_are_one_nth(preset, world):
    model = mf.GPT.from_config(preset)
    full = dict(model.named_parameters())
    full_sharded = sum(full[n].numel() * 4 for n in sharded_parameter_names(model))
    full_kv = mf.StaticKVCache.for_model(model, 1, 32).nbytes
    for rank in range(world):
        plan = shard_plan(model.config, world, rank)
        local = shard_gpt(copy.deepcopy(model), plan, lambda t: t)
        wb = weight_bytes(local)
        assert wb["sharded"] * world == full_sharded
        assert wb["replicated"] == weight_bytes(model)["total"] - full_sharded
        assert rank_cache(local, plan, 1, 32).nbytes * world == full_kv


# ---- errors ---------------------------------------------------------------------------------
def test_split_errors():
    tiny, gqa = mf.GPTConfig.preset("tiny"), mf.GPTConfig.preset("tiny-gqa")
    with pytest.raises(ValueError, match="n_head=4 is not divisible by world_size=3"):
        shard_plan(tiny, 3, 0)
    with pytest.raises(ValueError, match="larger than the model's n_head=4"):
        shard_plan(tiny, 8, 0)
    with pytest.raises(ValueError, match="larger than the model's n_kv_head=2"):
        shard_plan(gqa, 4, 0)
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        shard_plan(tiny, 0, 0)
    with pytest.raises(ValueError, match="rank must lie in"):
        shard_plan(tiny, 2, 2)
    assert shard_plan(tiny, 3, 2, allow_uneven=True).q_heads == (3, 4)


def test_run_local_checks_before_starting_processes():
    model = mf.GPT.from_config("tiny")
    with pytest.raises(ValueError, match="not divisible"):
        run_local(model, PROMPT, world_size=3, params=GREEDY)
    with pytest.raises(ValueError, match="repetition_penalty"):
        run_local(model, PROMPT, 2, mf.SamplingParams(repetition_penalty=1.2))
    with pytest.raises(TypeError, match="model must be"):
        run_local(torch.nn.Linear(2, 2), PROMPT, 2)


def test_config_digest_tells_configs_apart():
    tiny, gqa = mf.GPTConfig.preset("tiny"), mf.GPTConfig.preset("tiny-gqa")
    opts = {"world_size": 2, "allow_uneven": False}
    assert config_digest(tiny, opts) == config_digest(mf.GPTConfig(**tiny.to_dict()), opts)
    assert config_digest(tiny, opts) != config_digest(gqa, opts)
    assert config_digest(tiny, opts) != config_digest(tiny, {**opts, "allow_uneven": True})


# ---- real processes -------------------------------------------------------------------------
def _gone(pid: int) -> bool:
    return not running([pid])


def test_two_processes_match_single_process():
    model = mf.GPT.from_config("tiny-gqa", seed=1)
    ref_tokens, ref_logits = reference(model, PROMPT, GREEDY)
    res = run_local(model, PROMPT, 2, GREEDY, keep_logits=True)
    assert res.token_ids == [ref_tokens]
    cfg = model.config
    for r in res.reports:
        assert r.token_ids == [ref_tokens]
        assert torch.allclose(torch.tensor(r.logits), ref_logits, atol=LOGIT_ATOL, rtol=0)
        assert r.allreduce_calls_per_step == 2 * cfg.n_layer
        assert r.allreduce_bytes_per_step == 2 * cfg.n_layer * 1 * cfg.n_embd * 4
        assert r.decode_steps == GREEDY.max_new_tokens - 1
        assert 0 <= r.decode_comm_s <= r.decode_s
    assert res.reports[0].weight_bytes == res.reports[1].weight_bytes
    assert all(_gone(p) for p in res.pids)


def test_four_processes_one_thread_each():
    model = mf.GPT.from_config("tiny", seed=4)
    ref_tokens, _ = reference(model, PROMPT, GREEDY)
    res = run_local(model, PROMPT, 4, GREEDY, threads=1)
    assert [r.token_ids for r in res.reports] == [[ref_tokens]] * 4
    assert [r.kv_heads for r in res.reports] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert all(_gone(p) for p in res.pids)


def test_failing_rank_ends_every_process():
    """Rank 1 dies at once (a bad argument); rank 0 would wait for it to join: both must go."""
    good = ["--model", "tiny", "--prompt", "Hi", "--max-new-tokens", "2", "--timeout", "60"]
    bad = ["--model", "tiny", "--dtype", "fp7"]
    with pytest.raises(WorkerError, match=r"(?s)failed ranks: \[1.*invalid choice: 'fp7'") as err:
        launch([good, bad], timeout_s=60)
    assert len(err.value.pids) == 2 and all(_gone(p) for p in err.value.pids)


def test_mismatched_configs_are_refused():
    args = ["--prompt", "Hi", "--max-new-tokens", "2", "--timeout", "60"]
    with pytest.raises(WorkerError, match="ranks disagree") as err:
        launch([["--model", "tiny", *args], ["--model", "tiny-gqa", *args]], timeout_s=60)
    assert all(_gone(p) for p in err.value.pids)  # both raised ValueError; both are gone


def test_timeout_ends_every_process():
    args = ["--model", "tiny", "--prompt", "Hi", "--max-new-tokens", "2"]
    with pytest.raises(WorkerError, match="timed out") as err:
        launch([args, args], timeout_s=0.2)
    assert all(_gone(p) for p in err.value.pids)


def test_comm_is_a_no_op_alone():
    """World size 1 never calls into torch.distributed for collectives."""
    comm = Comm.__new__(Comm)
    comm.world_size, comm.device, comm.group = 1, torch.device("cpu"), None
    comm.reset()
    t = torch.ones(3)
    assert comm.all_reduce(t) is t and comm.calls == 0
