"""Speculative decoding in the engine: a draft model proposes, the step's one call verifies.

With a `draft_model` (`EngineConfig`), `LLMEngine.step` runs its plan through `SpeculativeStep`:

1. **Look-ahead**: each decoding request (one sampled token to feed back) gets up to k slots
   for drafts, within the step's token budget, its `max_new_tokens` and the free blocks (no one
   is preempted for a guess). A request before its `min_tokens` decodes plainly.
2. **Draft**: the draft's K/V live in a pool of its own indexed by the same block tables (token
   i has the same slot in both). It feeds what it has not seen (a whole prompt at a request's
   first round), then drafts one position per packed call for all rows.
3. **Verify**: one target call, packed like any step, each drafting row's ``[pending, d1..dk]``
   fed like a prompt chunk with logits at every position. `minifer.speculative.verify`
   (`speculative_generate`'s rule) keeps the longest agreeing prefix plus one token of the
   target's: greedy output is the target's own; sampled output follows its distribution (the
   request's generator draws for both models; which sample depends on the drafts it got).
4. **Record**: the scheduler records each row's tokens until one finishes it; `num_computed`
   counts the accepted ones, so rejected positions are overwritten when fed again, and the
   blocks held only for them are freed.
"""

from __future__ import annotations

import time

import torch

from .. import hooks
from ..sampling import mask_padded_vocab
from ..speculative import SpecStats, draft_token, verify
from .config import EngineConfig
from .kv_pool import PackedBatch, PagedKVPool
from .model_runner import ModelRunner
from .options import record_logprobs
from .request import Request, RequestOutput, Status
from .scheduler import Chunk, Scheduler, SchedulerOutput

__all__ = ["SpeculativeStep"]

Drafts = tuple[torch.Tensor, "torch.Tensor | None"]  # a row's drafts (k,), their q (k, V) or None


class SpeculativeStep:
    """A scheduled step with a draft model (module doc). `stats`: a `SpecStats` over all steps,
    a round being one request's verification in one step."""

    def __init__(self, config: EngineConfig, runner: ModelRunner, scheduler: Scheduler) -> None:
        self.draft, self.k = config.draft_model, config.num_speculative_tokens
        self.runner, self.scheduler, pool = runner, scheduler, runner.pool
        self.pool = PagedKVPool.for_model(self.draft, pool.num_blocks, pool.block_size,
                                          device=pool.device)
        size = sum(p.numel() for p in self.draft.parameters())
        self.stats = SpecStats(k=self.k, drafter=f"draft model ({size:,} params)")

    def step(self, plan: SchedulerOutput) -> list[RequestOutput]:
        """Run `plan` with speculation: one output per request that produced tokens."""
        for req in plan.preempted:
            req.num_draft_computed = 0  # its blocks are gone: the draft recomputes too
        t0 = time.perf_counter()
        with torch.inference_mode():
            drafts = self.propose(plan.chunks, self.lookahead(plan))
            t1 = time.perf_counter()
            results = self.verify(plan.chunks, drafts)
        self.stats.draft_time_s += t1 - t0
        self.stats.target_time_s += time.perf_counter() - t1
        return self.record(plan, results, drafts)

    def lookahead(self, plan: SchedulerOutput) -> dict[int, int]:
        """Drafts per decoding chunk (by index in ``plan.chunks``; none: left out), their
        blocks taken."""
        budget = self.scheduler.max_num_batched_tokens - plan.num_tokens
        bm, rows = self.scheduler.bm, {}
        for j, c in enumerate(plan.chunks):
            seq, rid, n = c.request.seq, c.request.request_id, c.request.num_tokens
            if not c.decodes or len(seq.output_ids) < seq.min_tokens:
                continue
            k = min(self.k, budget, seq.params.max_new_tokens - len(seq.output_ids) - 1)
            while k > 0 and not bm.can_append(rid, n + k):
                k -= 1
            if k > 0:
                bm.append_slots(rid, n + k)  # slots for positions n .. n + k - 1 (the drafts')
                rows[j], budget = k, budget - k
        return rows

    def propose(self, chunks: list[Chunk], rows: dict[int, int]) -> dict[int, Drafts]:
        """Each row's drafts ``(k_r,)`` and, sampling, their distributions ``(k_r, V)``: one
        packed draft call per position; a row whose draft cannot be drawn stops there (the
        target's sampling then says why)."""
        toks: dict[int, list] = {j: [] for j in rows}
        qs: dict[int, list] = {j: [] for j in rows}
        seen = {j: chunks[j].request.seen for j in rows}
        seen = {j: None if m is None else m[None].clone() for j, m in seen.items()}  # (1, V)
        live = list(rows)
        for i in range(max(rows.values(), default=0)):
            logits = self._draft_call([chunks[j] for j in live], [toks[j] for j in live], i)
            for j, row in zip(live, logits):  # row: (V,)
                req = chunks[j].request
                try:
                    t, q = draft_token(mask_padded_vocab(row[None], req.vocab), req.params,
                                       seen[j], req.generator)
                except Exception:  # noqa: BLE001 - one request's, reported by the target's
                    rows[j] = i
                    continue
                toks[j] += [t]
                qs[j] += [] if q is None else [q]
                if seen[j] is not None:
                    seen[j][0, t] = True
            live = [j for j in live if rows[j] > i + 1]
            self.stats.draft_passes += 1
        return {j: (torch.stack(toks[j]), torch.stack(qs[j]) if qs[j] else None)
                for j in rows if rows[j] > 0}

    def _draft_call(self, chunks: list[Chunk], toks: list[list], i: int) -> torch.Tensor:
        """The draft's logits ``(rows, V)`` at draft position i: at i = 0 it feeds what it has
        not seen up to the pending token (at ``c.start``), later each row's last draft."""
        if i == 0:
            start = [c.request.num_draft_computed for c in chunks]
            feed = [c.request.tokens[s:] for c, s in zip(chunks, start)]
            ids = torch.tensor([t for f in feed for t in f], device=self.pool.device)
            num_new = [len(f) for f in feed]
        else:
            start, num_new = [c.start + i for c in chunks], [1] * len(chunks)
            ids = torch.stack([t[-1] for t in toks])
        batch = PackedBatch(self.pool, [c.block_table for c in chunks], start, num_new)
        return self.draft(ids.view(1, -1), cache=batch)

    def verify(self, chunks: list[Chunk], drafts: dict[int, Drafts]) -> list:
        """One target call over every chunk, the drafting rows with their drafts; for each
        chunk that completes its request, in order, its new tokens (or the exception)."""
        run, dev = self.runner, self.runner.device
        ids, num_new, index = [], [], []
        for j, c in enumerate(chunks):
            ids.append(torch.tensor(c.request.tokens[c.start:c.start + c.num_new], device=dev))
            k = len(drafts[j][0]) if j in drafts else 0
            ids += [drafts[j][0]] if k else []
            num_new.append(c.num_new + k)
            if c.completes:  # logits at the last token, or at pending, d1..dk
                index.extend(range(sum(num_new) - 1 - k, sum(num_new)))
        batch = PackedBatch(run.pool, [c.block_table for c in chunks], [c.start for c in chunks],
                            num_new)
        batch.logits_index = torch.tensor(index, dtype=torch.long, device=dev)
        run.count_tokens(chunks)
        t0 = time.perf_counter()
        with hooks.batch_invariant(run.model, run.invariant):
            logits = run.model(torch.cat(ids).view(1, -1), cache=batch)  # (len(index), V)
        run.forward_time_s += time.perf_counter() - t0
        run.num_forward_calls += 1
        return self._accept(chunks, drafts, logits)

    def _accept(self, chunks: list[Chunk], drafts: dict[int, Drafts], logits: torch.Tensor
                ) -> list:
        """Each due chunk's tokens from its logits rows: a plain row's sample, a drafting row's
        accepted drafts and the target's next token (one host transfer for all those)."""
        plain, rows, at = {}, {}, 0
        for j, c in enumerate(chunks):
            if c.completes:
                n = len(drafts[j][0]) + 1 if j in drafts else 1
                (rows if j in drafts else plain)[j], at = logits[at:at + n], at + n
        out = {}
        if plain:
            sampled = self.runner.sample([chunks[j].request for j in plain], torch.cat([*plain.values()]))
            out = {j: t if isinstance(t, Exception) else [t] for j, t in zip(plain, sampled)}
        verdicts = {j: self._verdict(chunks[j].request, lg, *drafts[j]) for j, lg in rows.items()}
        out.update((j, v) for j, v in verdicts.items() if isinstance(v, Exception))
        ok = [j for j in verdicts if j not in out]
        for j, (a, nxt) in zip(ok, torch.stack([verdicts[j] for j in ok]).tolist() if ok else []):
            req, out[j] = chunks[j].request, [*drafts[j][0][:a].tolist(), nxt]
            if req.logprobs is not None:  # cut to the tokens recorded, later
                record_logprobs(rows[j][:a + 1], [req] * (a + 1), out[j])
        return [out[j] for j, c in enumerate(chunks) if c.completes]

    @staticmethod
    def _verdict(req: Request, logits: torch.Tensor, d: torch.Tensor, q: torch.Tensor | None
                 ) -> torch.Tensor | Exception:
        """``[accepted, next token]`` on the device from a row's logits ``(k+1, V)`` (masked in
        place), or the exception sampling raised."""
        try:
            seen = None if req.seen is None else req.seen[None]
            a, nxt = verify(mask_padded_vocab(logits, req.vocab), d, q, req.params, seen,
                            req.generator)
            return torch.stack([a, nxt])
        except Exception as err:  # noqa: BLE001 - this request's failure, no one else's
            return err

    def record(self, plan: SchedulerOutput, results: list, drafts: dict[int, Drafts]
               ) -> list[RequestOutput]:
        """The scheduler's `postprocess` with each due chunk's first token, then a drafting
        row's others one by one while it runs; one output per request, the look-ahead freed."""
        now, due = time.perf_counter(), [(j, c) for j, c in enumerate(plan.chunks) if c.completes]
        outputs = self.scheduler.postprocess(
            plan, [r if isinstance(r, Exception) else r[0] for r in results], now)
        where = {o.request_id: i for i, o in enumerate(outputs)}
        for (j, c), toks in zip(due, results):
            if j in drafts and not isinstance(toks, Exception):
                i = where[c.request.request_id]
                outputs[i] = self._record_rest(c, toks, len(drafts[j][0]), outputs[i].delta, now)
        return outputs

    def _record_rest(self, c: Chunk, toks: list[int], k: int, delta: str, now: float
                     ) -> RequestOutput:
        req, bm = c.request, self.scheduler.bm
        for t in toks[1:]:
            if req.status is not Status.RUNNING:
                break
            req.num_computed += 1  # the accepted draft before `t` has its K/V
            if bm.enable_prefix_caching:
                bm.commit(req.request_id, req.tokens, req.num_computed)
            delta += self.scheduler.record(req, t, now).delta
        if req.logprobs is not None:
            del req.logprobs[len(req.seq.output_ids):]
        if req.seen is not None:
            req.seen[toks] = True
        if req.status is Status.RUNNING:
            bm.trim(req.request_id, req.num_tokens)
            req.num_draft_computed = c.start + min(len(toks), k)  # pending, d1.. (dk never fed)
        self.stats.add_round(len(toks) - 1, k)
        self.stats.tokens += len(toks)
        return req.output(delta)
