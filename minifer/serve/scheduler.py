"""Which requests run in the next engine step, and how many of their tokens.

Every step has a token budget (`max_num_batched_tokens`: tokens fed to the model in this step,
prompt chunks and decode tokens together) and a sequence limit (`max_num_seqs`). Requests wait
in `waiting` until admitted into `running`, which holds their KV blocks.

Policies (claims BATCH-4, BATCH-5):

- ``"continuous"``: iteration-level batching. A finished request leaves at once and waiting ones
  join at every step, so the batch stays full.
- ``"static"``: the baseline. A group of up to `max_num_seqs` requests is formed when nothing is
  running, and no one else joins until the whole group has finished: short requests wait for the
  longest, and new arrivals wait for the group.

**Chunked prefill** (BATCH-8): a prompt longer than what is left of the budget is fed in chunks
over several steps, while the running requests keep decoding in the same steps; without it a
prompt goes in whole and must fit the budget.

**Preemption**: when a running request needs a new block and none is free, the least important
running request (lowest priority, then latest arrival) gives up all its blocks and goes back to
waiting; when readmitted it recomputes prompt + generated-so-far in a prefill (vLLM's
*recompute* mode), keeping the tokens it already produced.

**Priorities** (BATCH-9): lower value = served first (vLLM's convention), ties by arrival.
Strict priority can starve low priority forever under a steady stream of important requests;
``aging > 0`` lowers a waiting request's effective priority value by `aging` per step it waits,
so every request eventually reaches the front.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .block_manager import BlockManager
from .request import Request, Status

__all__ = ["POLICIES", "Chunk", "SchedulerOutput", "Scheduler"]

POLICIES = ("static", "continuous")


@dataclass
class Chunk:
    """Feed ``request.tokens[start:start + num_new]`` in this step (K/V of ``[:start]`` cached)."""

    request: Request
    start: int
    num_new: int

    @property
    def completes(self) -> bool:
        """Whether this chunk reaches the request's last token, so a token is sampled after it."""
        return self.start + self.num_new == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[Chunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new for c in self.chunks)


class Scheduler:
    """Waiting and running queues over a `BlockManager`; `schedule()` plans one step."""

    def __init__(self, block_manager: BlockManager, *, policy: str = "continuous",
                 max_num_seqs: int = 32, max_num_batched_tokens: int = 512,
                 enable_chunked_prefill: bool = False, aging: float = 0.0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        for name, value in (("max_num_seqs", max_num_seqs),
                            ("max_num_batched_tokens", max_num_batched_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(aging, bool) or not isinstance(aging, (int, float)) or not aging >= 0:
            raise ValueError(f"aging must be a number >= 0 (priority points per step waited; "
                             f"0 = strict priority), got {aging!r}")
        self.bm, self.policy = block_manager, policy
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.chunked, self.aging = enable_chunked_prefill, float(aging)
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
        req.num_computed = 0
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
            if req.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            n = min(req.num_due, budget) if self.chunked else req.num_due
            if n == 0 or n > budget:
                continue
            need = req.num_computed + n
            while not self.bm.can_append(req.request_id, need):
                victim = next(r for r in reversed(order) if r.status is Status.RUNNING)
                self.preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                continue
            self.bm.append_slots(req.request_id, need)
            out.chunks.append(Chunk(req, req.num_computed, n))
            budget -= n
        if not out.preempted:  # no room for running requests: admitting more would thrash
            budget = self._admit(out, budget)
        for req in self.waiting:
            req.waited_steps += 1
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        candidates = sorted(self.waiting, key=self.rank)
        if self.policy == "static":
            if not self.running and not any(r.request_id in self.group for r in self.waiting):
                self.group = {r.request_id for r in candidates[:self.max_num_seqs]}
            candidates = [r for r in candidates if r.request_id in self.group]
        for req in candidates:
            if len(self.running) >= self.max_num_seqs or budget == 0:
                break
            tokens = req.tokens
            if not self.bm.can_allocate(tokens):
                break  # strict order: a smaller request behind does not jump the queue
            n = len(tokens) - self.bm.cached_prefix_tokens(tokens)
            if not self.chunked and n > budget:
                break
            cached = self.bm.allocate(req.request_id, tokens)
            n = min(len(tokens) - cached, budget)
            req.num_computed = cached
            req.status = Status.RUNNING
            self.waiting.remove(req)
            self.running.append(req)
            out.chunks.append(Chunk(req, cached, n))
            budget -= n
        return budget
