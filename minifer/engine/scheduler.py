"""Which requests run in the next engine step, and how many of their tokens.

Every step has a token budget (`max_num_batched_tokens`, prompt chunks and decode tokens
together) and a sequence limit (`max_num_seqs`); requests wait in `waiting` until admitted into
`running`, which holds their KV blocks.

- ``"continuous"`` (BATCH-4, BATCH-5): finished requests leave and waiting ones join at every
  step. ``"static"``, the baseline: a group runs to completion before the next is formed.
- **Chunked prefill** (BATCH-8): a prompt longer than the budget left is fed over several steps
  while the running requests keep decoding.
- **Preemption**: when no block is free, the least important running request gives up its
  blocks and recomputes its tokens when readmitted (vLLM's *recompute* mode).
- **Priorities** (BATCH-9): lower value = served first, ties by arrival; ``aging > 0`` lowers a
  waiting request's value by `aging` per step, so low priority is never starved."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..sequence import Sequence as SequenceState
from .block_manager import BlockManager
from .config import POLICIES, EngineConfig
from .request import Request, RequestOutput, Status

__all__ = ["POLICIES", "PRIORITY_LIMIT", "Chunk", "SchedulerOutput", "Scheduler"]

PRIORITY_LIMIT = 2**53  # |priority| at most this: `rank`'s float arithmetic stays exact


@dataclass
class Chunk:
    """Feed ``request.tokens[start:start + num_new]`` in this step (K/V of ``[:start]`` cached)."""

    request: Request
    start: int
    num_new: int
    block_table: list[int] = field(default_factory=list)  # where the request's K/V live

    @property
    def completes(self) -> bool:
        """Whether this chunk reaches the request's last token, so a token is sampled after it."""
        return self.start + self.num_new == self.request.num_tokens

    @property
    def decodes(self) -> bool:
        """A decode step: one token past the prompt, the last sampled token fed back."""
        return self.num_new == 1 and self.start >= len(self.request.seq.prompt_ids)


@dataclass
class SchedulerOutput:
    chunks: list[Chunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new for c in self.chunks)

    @property
    def due(self) -> list[Chunk]:
        """The chunks after which a token is sampled, in order."""
        return [c for c in self.chunks if c.completes]


class Scheduler:
    """Waiting and running queues over a `BlockManager`; `schedule()` plans one step."""

    def __init__(self, block_manager: BlockManager, config: EngineConfig) -> None:
        """`config` comes checked, its defaults filled (`EngineConfig.resolved`)."""
        self.bm, self.policy = block_manager, config.policy
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.chunked, self.aging = config.enable_chunked_prefill, float(config.aging)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.group: set[str] = set()  # static policy: the ids of the group now being served
        self.num_steps = 0
        self.num_preemptions = 0

    # ---- queues ------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def can_admit(self, tokens: Sequence[int]) -> bool:
        """Whether a request holding `tokens` could start running now (a seat and blocks)."""
        return len(self.running) < self.max_num_seqs and self.bm.can_allocate(tokens)

    def add_prefilled(self, req: Request, first_token: int, now: float
                      ) -> tuple[int, RequestOutput] | None:
        """Admit `req` straight into `running`: its prompt's K/V were computed elsewhere and
        `first_token` sampled there at `now` (disaggregated serving). Returns how many leading
        prompt tokens this pool's prefix cache already held (the caller writes the others' K/V
        before the next step) and the request's output; None, changing nothing, when it does
        not fit now."""
        if self.policy != "continuous":
            raise ValueError("add_prefilled needs the continuous policy (a static group would "
                             "not admit a request mid-group)")
        prompt = req.tokens
        if not self.can_admit([*prompt, first_token]):
            return None
        cached = min(self.bm.allocate(req.request_id, [*prompt, first_token]), len(prompt))
        req.status = Status.RUNNING
        self.running.append(req)
        out = self.postprocess(SchedulerOutput([Chunk(req, 0, len(prompt))]), [first_token], now)
        return cached, out[0]

    def check_fits(self, seq: SequenceState) -> None:
        """A ValueError for a request the pool (or, unchunked, one step) could never hold."""
        need = seq.max_len
        if self.bm.blocks_for(need) > self.bm.num_blocks or (
                not self.chunked and need > self.max_num_batched_tokens):
            raise ValueError(self._why_unfit(seq))

    def _why_unfit(self, seq: SequenceState) -> str:
        bm, need = self.bm, seq.max_len
        if bm.blocks_for(need) > bm.num_blocks:
            return (f"request needs {bm.blocks_for(need)} blocks of {bm.block_size} tokens for "
                    f"{need} tokens (prompt {len(seq.prompt_ids)} + max_new_tokens "
                    f"{seq.params.max_new_tokens} - 1) but the pool has only num_blocks="
                    f"{bm.num_blocks}; raise num_blocks or lower max_new_tokens")
        return (f"without chunked prefill a request must fit one step: prompt + max_new_tokens"
                f" - 1 = {need} > max_num_batched_tokens={self.max_num_batched_tokens} (a "
                f"preempted request recomputes all its tokens at once); raise "
                f"max_num_batched_tokens or pass enable_chunked_prefill=True")

    def rank(self, req: Request) -> tuple[float, int]:
        """Sort key, most important first: effective priority, then arrival order."""
        return (req.priority - self.aging * req.waited_steps, req.order)

    def finish(self, req: Request) -> None:
        """`req` is done (finished or aborted): release its blocks and drop it from the queues."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
            self.bm.free(req.request_id)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        self.group.discard(req.request_id)
        req.status = Status.FINISHED

    def preempt(self, req: Request) -> None:
        """Take all of `req`'s blocks back; it will recompute its tokens when readmitted."""
        self.running.remove(req)
        self.bm.free(req.request_id)
        req.num_computed = req.num_draft_computed = 0  # (a draft's K/V too: `engine.speculative`)
        req.status = Status.WAITING
        req.metrics.preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(req)

    # ---- one step ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Plan the next step: running requests first (most important first), then admissions."""
        self.num_steps += 1
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        order = sorted(self.running, key=self.rank)
        for req in order:
            n = min(req.num_due, budget) if self.chunked else req.num_due
            if req.status is not Status.RUNNING or n == 0 or n > budget:
                continue  # preempted earlier in this loop, nothing due, or over the budget
            need = req.num_computed + n
            if not self.bm.can_append(req.request_id, need):
                if not self._make_room(req, need, order, out):
                    continue  # it gave up its own blocks
            self.bm.append_slots(req.request_id, need)
            out.chunks.append(Chunk(req, req.num_computed, n, self.bm.block_table(req.request_id)))
            budget -= n
        if not out.preempted:  # no room for running requests: admitting more would thrash
            self._admit(out, budget)
        for req in self.waiting:
            req.waited_steps += 1
        return out

    def _make_room(self, req: Request, need: int, order: list[Request],
                   out: SchedulerOutput) -> bool:
        """Preempt running requests, least important (end of `order`) first, until `req` can
        grow to `need` tokens; False if `req` itself had to go."""
        while not self.bm.can_append(req.request_id, need):
            victim = next(r for r in reversed(order) if r.status is Status.RUNNING)
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        return True

    def postprocess(self, out: SchedulerOutput, tokens: Sequence[int | Exception],
                    now: float | None = None) -> list[RequestOutput]:
        """Record a step: one sampled token (or the exception sampling raised) per chunk of
        ``out.due``, an output for each; `now` (default ``time.perf_counter()``) stamps them."""
        for c in out.chunks:
            req = c.request
            req.num_computed = c.start + c.num_new
            if self.bm.enable_prefix_caching:
                self.bm.commit(req.request_id, req.tokens, req.num_computed)
        due = out.due
        if len(tokens) != len(due):
            raise ValueError(f"postprocess needs one token per due chunk ({len(due)}), got "
                             f"{len(tokens)}")
        now = time.perf_counter() if now is None else now
        outputs = []
        for c, token in zip(due, tokens):
            if c.request.status is Status.RUNNING:  # not ended since it was scheduled
                outputs.append(self._record(c.request, token, now))
        return outputs

    def _record(self, req: Request, token: int | Exception, now: float) -> RequestOutput:
        """Append `token` to `req`, finishing it if it stops; a token that is an exception
        (sampling raised) or an append that raises ends `req` alone (`_fail`)."""
        if isinstance(token, Exception):
            return self._fail(req, token, now)
        try:
            event = req.seq.append(token, now - req.metrics.arrival_time)
        except Exception as err:  # noqa: BLE001 - this request's failure, no one else's
            return self._fail(req, err, now)
        req.text += event.text
        req.metrics.on_token(now)
        if event.finish_reason is not None:
            req.metrics.on_finish(now, event.finish_reason)
            self.finish(req)
        return req.output(event.text)

    def _fail(self, req: Request, err: Exception, now: float) -> RequestOutput:
        """End `req` alone with `err`: finish reason "error", `RequestOutput.error` says why."""
        req.error = f"request {req.request_id!r} failed: {type(err).__name__}: {err}"
        req.metrics.on_finish(now, "error")
        self.finish(req)
        return req.output("")

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests, most important first, while seats, blocks and `budget` last."""
        candidates = sorted(self.waiting, key=self.rank)
        if self.policy == "static":
            candidates = self._static_group(candidates)
        for req in candidates:
            if len(self.running) >= self.max_num_seqs or budget == 0:
                break
            tokens = req.tokens
            if not self.bm.can_allocate(tokens):
                break  # strict order: a smaller request behind does not jump the queue
            if not self.chunked and len(tokens) - self.bm.cached_prefix_tokens(tokens) > budget:
                break  # unchunked, its uncached tokens go in whole
            cached = self.bm.allocate(req.request_id, tokens)
            n = min(len(tokens) - cached, budget)
            req.num_computed = cached
            req.status = Status.RUNNING
            self.waiting.remove(req)
            self.running.append(req)
            out.chunks.append(Chunk(req, cached, n, self.bm.block_table(req.request_id)))
            budget -= n

    def _static_group(self, candidates: list[Request]) -> list[Request]:
        """The static policy's candidates: the waiting members of the group being served, or,
        once the group has finished, the next group (the first `max_num_seqs`)."""
        if not self.running and not any(r.request_id in self.group for r in self.waiting):
            self.group = {r.request_id for r in candidates[:self.max_num_seqs]}
        return [r for r in candidates if r.request_id in self.group]
