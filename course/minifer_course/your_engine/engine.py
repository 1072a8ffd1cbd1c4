"""Lesson 08's scheduler, with every earlier piece plugged in: your serving engine.

Requests wait, are admitted while there are seats and free blocks, and then run one step at a
time, all of them in **one forward call** per step (`model.forward`): a newcomer feeds its
prompt (a prefill), a running request its last token (a decode step), and a greedy request,
when the engine has a draft model, its last token and k drafts to verify (lesson 10). When a
running request needs a block and none is free, the latest arrival is **preempted**: its blocks
go back to the pool and it recomputes its tokens when it is admitted again (vLLM's recompute
mode). Each request samples with its own generator (lesson 06), so a seed gives the same tokens
alone, batched, or preempted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from minifer.tokenizer import encode_prompt

from .model import KVPool, Row, forward
from .paging import Allocator
from .sampler import pick
from .speculative import greedy_verify


@dataclass
class Request:
    id: str
    prompt: list[int]
    params: object  # minifer's SamplingParams: temperature, top_k, top_p, seed, max_new_tokens, ...
    order: int  # arrival rank
    out: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose K/V are in the pool
    drafted: int = 0  # the same, in the draft model's pool
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    seen: torch.Tensor | None = None  # tokens seen so far, for the repetition penalty

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out


@dataclass
class Output:
    """What one step gave a request: its new tokens, and why it finished (None: it goes on)."""

    id: str
    tokens: list[int]
    finish_reason: str | None


class Engine:
    def __init__(self, model, tokenizer, *, num_blocks: int = 64, block_size: int = 16,
                 max_num_seqs: int = 8, draft=None, k: int = 4) -> None:
        self.model, self.tok, self.draft, self.k = model, tokenizer, draft, k
        self.vocab = tokenizer.vocab_size  # the model's rows past it are padding
        self.eos = {tokenizer.eos_token_id, *getattr(tokenizer, "more_eos_token_ids", ())}
        self.pool = KVPool(model, num_blocks, block_size)
        self.draft_pool = None if draft is None else KVPool(draft, num_blocks, block_size)
        self.blocks = Allocator(num_blocks, block_size)  # one table per request, for both pools
        self.max_num_seqs = max_num_seqs
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.arrivals = 0
        self.log: list[dict] = []  # per step: who ran how, who was preempted, blocks in use
        self.forward_s = 0.0  # seconds inside forward calls (the target's and the draft's)

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, prompt, params, request_id: str | None = None) -> str:
        ids = encode_prompt(self.tok, prompt) if isinstance(prompt, str) else list(prompt)
        if params.stop or params.logit_bias:
            raise ValueError("stop strings and logit_bias are not in this engine (yet)")
        need = len(ids) + params.max_new_tokens - 1
        if need > self.model.config.context_length or -(-need // self.blocks.block_size) > self.pool.num_blocks:
            raise ValueError(f"{need} tokens do not fit the context or the pool")
        r = Request(request_id or f"req-{self.arrivals}", ids, params, self.arrivals)
        if params.temperature > 0:  # its own generator: its draws never depend on the batch
            r.generator = torch.Generator()
            r.generator.manual_seed(params.seed) if params.seed is not None else r.generator.seed()
        if params.repetition_penalty != 1.0:
            r.seen = torch.zeros(self.vocab, dtype=torch.bool)
            r.seen[ids] = True  # the prompt counts as seen
        self.arrivals += 1
        self.waiting.append(r)
        return r.id

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def speculates(self, r: Request) -> int:
        """How many drafts `r` verifies in its next decode step (0: a plain decode step)."""
        p = r.params
        if self.draft is None or p.temperature != 0 or p.repetition_penalty != 1.0:
            return 0  # greedy only: under sampling the rule is lesson 10's section 5
        return min(self.k, p.max_new_tokens - len(r.out) - 1)

    # ---- lesson 08: who runs in this step ----------------------------------------------
    def schedule(self) -> tuple[list[tuple[Request, str]], list[str]]:
        """Running requests first (oldest first), each with room for its next tokens, preempting
        the latest arrival while a block is missing; then admissions, in arrival order."""
        plan, preempted = [], []
        for r in list(self.running):
            if r not in self.running:
                continue  # preempted a moment ago
            kk = self.speculates(r)
            while not self.blocks.grow(r.id, len(r.tokens) + kk) and r in self.running:
                victim = self.running[-1]
                self.preempt(victim)
                preempted.append(victim.id)
            if r in self.running:
                plan.append((r, "verify" if kk else "decode"))
        while not preempted and self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting[0]
            if not self.blocks.grow(r.id, len(r.tokens)):
                break  # strict arrival order: no one jumps the queue
            self.running.append(self.waiting.pop(0))
            plan.append((r, "prefill"))
        return plan, preempted

    def preempt(self, r: Request) -> None:
        self.blocks.release(r.id)
        r.computed = r.drafted = 0  # its K/V are gone: recomputed when admitted again
        self.running.remove(r)
        self.waiting = sorted([*self.waiting, r], key=lambda w: w.order)

    # ---- one step: plan, one forward call, sample, record ---------------------------------
    def step(self) -> list[Output]:
        plan, preempted = self.schedule()
        drafts = self.propose([r for r, kind in plan if kind == "verify"])
        rows = [Row(r.tokens[r.computed:] + drafts.get(r.id, []), r.computed,
                    self.blocks.tables[r.id], all_logits=r.id in drafts) for r, _ in plan]
        t0 = time.perf_counter()
        logits = forward(self.model, self.pool, rows) if rows else []
        self.forward_s += time.perf_counter() - t0
        outputs = []
        for (r, kind), lg in zip(plan, logits):
            r.computed = len(r.tokens)
            if kind == "verify":  # lesson 10: keep the agreeing drafts and the target's own token
                accepted, new = greedy_verify(drafts[r.id], lg[:, :self.vocab].argmax(-1).tolist())
                r.computed += accepted  # the rejected drafts' slots are overwritten later
                r.drafted = min(r.drafted, r.computed)
            else:
                new = [pick(lg[-1, :self.vocab], r.params, r.seen, r.generator)]
            outputs.append(self.append(r, new))
        self.log.append({"ran": {r.id: kind for r, kind in plan}, "preempted": preempted,
                         "blocks": self.blocks.num_used, "waiting": [r.id for r in self.waiting]})
        return outputs

    def propose(self, reqs: list[Request]) -> dict[str, list[int]]:
        """Each request's greedy drafts from the draft model, all requests in each draft call;
        the draft's pool shares the target's block tables. First each feeds what the draft lacks."""
        drafts = {r.id: [] for r in reqs}
        for _ in range(max((self.speculates(r) for r in reqs), default=0)):
            todo = [r for r in reqs if len(drafts[r.id]) < self.speculates(r)]
            rows = [Row((r.tokens + drafts[r.id])[r.drafted:], r.drafted, self.blocks.tables[r.id])
                    for r in todo]
            t0 = time.perf_counter()
            for r, row, lg in zip(todo, rows, forward(self.draft, self.draft_pool, rows)):
                r.drafted = row.start + len(row.tokens)
                drafts[r.id].append(int(lg[-1, :self.vocab].argmax()))
            self.forward_s += time.perf_counter() - t0
        return drafts

    def append(self, r: Request, new: list[int]) -> Output:
        """Append a step's tokens to `r` until one finishes it; a finished request leaves."""
        taken = []
        for t in new:
            r.out.append(t)
            taken.append(t)
            if r.seen is not None:
                r.seen[t] = True
            if t in self.eos and not r.params.ignore_eos:
                r.finish_reason = "eos"
            elif len(r.out) >= r.params.max_new_tokens:
                r.finish_reason = "length"
            if r.finish_reason:
                self.blocks.release(r.id)
                self.running.remove(r)
                break
        return Output(r.id, taken, r.finish_reason)

    # ---- offline: every prompt to the end --------------------------------------------------
    def generate(self, prompts, params) -> list[list[int]]:
        """Each prompt's new tokens, in order (`params`: one for all, or one per prompt)."""
        params = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        out: dict[str, list[int]] = {i: [] for i in ids}
        while self.has_unfinished():
            for o in self.step():
                out[o.id] += o.tokens
        return [out[i] for i in ids]
