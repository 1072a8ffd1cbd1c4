"""Speculative decoding in the serving engine: a draft model proposes, the step's one call checks.

With a `draft_model` (`EngineConfig`), the draft (its K/V in a pool of its own, under the same
block tables) proposes its argmax for each decoding request, one packed call per position; the
target's one call feeds each ``[pending, d1..dk]`` and `minifer.speculative.verify` keeps the
drafts it agrees with, plus a token of its own: greedy output is the plain engine's, and a
sampled request accepts d with probability p(d) (a deterministic proposal): p's distribution."""

from __future__ import annotations

import itertools
import time

import torch

from ..sampling import mask_padded_vocab
from ..speculative import SpecStats, verify
from .config import EngineConfig
from .kv_pool import PackedBatch, PagedKVPool
from .model_runner import ModelRunner
from .options import ban_early_eos, record_logprobs
from .request import Request, RequestOutput, Status
from .scheduler import Chunk, Scheduler, SchedulerOutput

__all__ = ["SpeculativeStep"]


class SpeculativeStep:
    """`LLMEngine.step` with a draft model (the module doc). `stats`: a `SpecStats` over all
    steps, a round being one request's verification in one step."""

    def __init__(self, config: EngineConfig, runner: ModelRunner, scheduler: Scheduler) -> None:
        self.draft, self.k = config.draft_model, config.num_speculative_tokens
        self.runner, self.scheduler = runner, scheduler
        self.pool = PagedKVPool.for_model(self.draft, config.num_blocks, config.block_size,
                                          device=runner.device)
        self.stats = SpecStats(k=self.k, drafter="draft model")

    def step(self, plan: SchedulerOutput) -> list[RequestOutput]:
        """Run `plan` (some chunks) with speculation: one output per request that produced tokens."""
        due = [j for j, c in enumerate(plan.chunks) if c.completes]
        with torch.inference_mode():
            drafts = self.propose(plan)
            logits = self.check(plan.chunks, drafts).split([len(drafts.get(j, ())) + 1 for j in due])
            tokens = [self.keep(plan.chunks[j].request, lg, drafts.get(j, []))
                      for j, lg in zip(due, logits)]
        return self.record(plan, due, drafts, tokens)

    def propose(self, plan: SchedulerOutput) -> dict[int, list[int]]:
        """Up to k drafts for each decoding chunk (by index in ``plan.chunks``) past its `min_tokens`,
        within the budget left, its `max_new_tokens` and the free blocks, their slots taken: the
        draft's argmax, one packed call per position, the first feeding what it has not seen."""
        want, bm = {}, self.scheduler.bm
        budget = self.scheduler.max_num_batched_tokens - plan.num_tokens
        for j, c in enumerate(plan.chunks):
            req, out = c.request, c.request.seq.output_ids
            if not c.decodes or len(out) < req.seq.min_tokens:
                continue  # before min_tokens its end-of-sequence token is banned: plain
            k = min(self.k, budget, req.params.max_new_tokens - len(out) - 1)
            while k > 0 and not bm.can_append(req.request_id, req.num_tokens + k):
                k -= 1  # no one is preempted for a guess
            if k > 0:
                bm.append_slots(req.request_id, req.num_tokens + k)
                want[j], budget = k, budget - k
        drafts: dict[int, list[int]] = {j: [] for j in want}
        for i in range(max(want.values(), default=0)):
            live = [j for j in want if want[j] > i]
            rows = [plan.chunks[j] for j in live]
            starts = [c.request.num_draft_computed if i == 0 else c.start + i for c in rows]
            feeds = [c.request.tokens[s:] if i == 0 else drafts[j][-1:]
                     for j, c, s in zip(live, rows, starts)]
            ids, batch = self.packed(self.pool, rows, starts, feeds)
            logits = self.draft(torch.tensor([ids], device=self.pool.device), cache=batch)
            mask_padded_vocab(logits, min(c.request.vocab for c in rows))  # (one vocabulary)
            for j, t in zip(live, logits.argmax(dim=-1).tolist()):
                drafts[j].append(t)
            self.stats.draft_passes += 1
        return drafts

    def check(self, chunks: list[Chunk], drafts: dict[int, list[int]]) -> torch.Tensor:
        """The target's one call over every chunk, a drafting one with its drafts: the logits at
        each due chunk's last token and at its drafts, in order (the runner counts and times it)."""
        run = self.runner
        feeds = [c.request.tokens[c.start:c.start + c.num_new] + drafts.get(j, [])
                 for j, c in enumerate(chunks)]
        ends = list(itertools.accumulate(map(len, feeds)))
        index = [p for j, c in enumerate(chunks) if c.completes
                 for p in range(ends[j] - 1 - len(drafts.get(j, ())), ends[j])]
        ids, batch = self.packed(run.pool, chunks, [c.start for c in chunks], feeds, index)
        return run.forward(chunks, ids, batch)

    @staticmethod
    def packed(pool: PagedKVPool, chunks: list[Chunk], starts: list[int], feeds: list[list[int]],
               index: list[int] | None = None) -> tuple[list[int], PackedBatch]:
        """The ids and cache of one packed call feeding each chunk's `feeds` at `starts` over
        `pool`: logits at each row's last token, or at the packed positions `index`."""
        batch = PackedBatch(pool, [c.block_table for c in chunks], starts, [len(f) for f in feeds])
        if index is not None:
            batch.logits_index = torch.tensor(index, dtype=torch.long, device=pool.device)
        return [t for f in feeds for t in f], batch

    def keep(self, req: Request, logits: torch.Tensor, drafts: list[int]) -> list[int] | Exception:
        """The tokens `req` keeps from its logits ``(k+1, V)``: the drafts the target agrees
        with, then its own (no drafts: a token sampled as without a draft, `min_tokens` kept);
        or the exception checking raised (this request's alone)."""
        try:
            mask_padded_vocab(logits, req.vocab)
            raw = logits.clone() if req.logprobs is not None else None
            ban_early_eos(logits[:1], [req.seq])  # (a request before min_tokens has no drafts)
            a, nxt = verify(logits, torch.tensor(drafts, dtype=torch.long, device=logits.device),
                            None, req.params, None if req.seen is None else req.seen[None],
                            req.generator)
            tokens = drafts[:int(a)] + [int(nxt)]
        except Exception as err:  # noqa: BLE001 - this request's failure, no one else's
            return err
        record_logprobs(raw, [req] * len(tokens), tokens)  # if asked; cut to those recorded later
        if req.seen is not None:
            req.seen[tokens] = True
        if drafts:
            self.stats.add_round(len(tokens) - 1, len(drafts))
        return tokens

    def record(self, plan: SchedulerOutput, due: list[int], drafts: dict[int, list[int]],
               tokens: list) -> list[RequestOutput]:
        """The scheduler's `postprocess` of each due chunk's first token, then of a drafting
        request's others one by one while it runs: one output per request."""
        now, chunks = time.perf_counter(), plan.chunks
        outputs = self.scheduler.postprocess(
            plan, [t if isinstance(t, Exception) else t[0] for t in tokens], now)
        where = {o.request_id: i for i, o in enumerate(outputs)}
        for j, toks in zip(due, tokens):
            req = chunks[j].request
            if j not in drafts or isinstance(toks, Exception):
                continue
            delta = outputs[where[req.request_id]].delta
            for t in toks[1:]:  # each fed one more token: the kept draft before `t`
                if req.status is Status.RUNNING:
                    step = SchedulerOutput([Chunk(req, req.num_computed, 1)])
                    delta += self.scheduler.postprocess(step, [t], now)[0].delta
            if req.logprobs is not None:
                del req.logprobs[len(req.seq.output_ids):]
            req.num_draft_computed = chunks[j].start + min(len(toks), len(drafts[j]))
            outputs[where[req.request_id]] = req.output(delta)
        return outputs
