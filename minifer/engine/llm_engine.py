"""`LLMEngine`: many requests through one model, one scheduler step at a time.

The interface is that of serving engines (vLLM's names): `add_request` queues a request,
`step()` runs one iteration and returns a `RequestOutput` for each request that moved, `abort`
drops one, and `generate` is the offline convenience: add everything, step until done.

A step has three parts (nano-vllm's split): the `Scheduler` picks which requests run and how
many tokens each feeds (`schedule`), the `ModelRunner` packs all those tokens, decode rows and
prompt chunks together, into **one forward call** and samples (`execute`), and the scheduler
records the results (`postprocess`). All K/V live in a paged pool (`kv_pool`), shared between
requests block by block when prefix caching is on.

Greedy outputs are token-identical to `minifer.generate` of each prompt alone (tested); seeded
sampling has a generator per request. What fails for one request in a step ends it alone."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence

import torch

from ..sampling import SamplingParams
from ..sequence import check_model
from ..tokenizer import TokenizerLike
from .block_manager import BlockManager
from .config import EngineConfig
from .kv_pool import PagedKVPool
from .model_runner import ModelRunner
from .options import generate_arguments, prepare_request
from .request import Request, RequestOutput
from .scheduler import Scheduler, SchedulerOutput
from .speculative import SpeculativeStep

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput", "StepStats"]


@dataclasses.dataclass(frozen=True)
class StepStats:
    """What the last step did (for lessons: which request ran in which step), read off its
    plan when asked."""

    plan: SchedulerOutput
    duration_s: float

    @property
    def prefill(self) -> list[tuple[str, int]]:
        """(request id, tokens fed) of each prompt chunk (or recomputation)."""
        return [(c.request.request_id, c.num_new) for c in self.plan.chunks if not c.decodes]

    @property
    def decode(self) -> list[str]:
        """The ids of the requests that fed back one sampled token."""
        return [c.request.request_id for c in self.plan.chunks if c.decodes]

    @property
    def preempted(self) -> list[str]:
        return [r.request_id for r in self.plan.preempted]

    @property
    def num_tokens(self) -> int:
        return self.plan.num_tokens

    def __repr__(self) -> str:
        return (f"StepStats(decode={len(self.decode)}, prefill={self.prefill}, "
                f"preempted={self.preempted}, {self.duration_s * 1e3:.1f} ms)")


class LLMEngine:
    """A serving engine over a paged KV cache (see the module docstring).

    Built from an `EngineConfig` or its fields as keyword arguments (``block_size=4``);
    `config` holds them checked, with the defaults filled in for `model`."""

    def __init__(self, model: torch.nn.Module, tokenizer: TokenizerLike | None = None,
                 config: EngineConfig | None = None, **options) -> None:
        check_model(model)
        self.config = c = dataclasses.replace(config or EngineConfig(), **options).resolved(model)
        self.model, self.tokenizer = model, tokenizer
        self.device = torch.device(c.device)
        self.pool = PagedKVPool.for_model(model, c.num_blocks, c.block_size, device=self.device)
        self.block_manager = BlockManager(c.num_blocks, c.block_size,
                                          enable_prefix_caching=c.enable_prefix_caching,
                                          bytes_per_token=self.pool.bytes_per_token)
        self.scheduler = Scheduler(self.block_manager, c)
        self.runner = ModelRunner(model, self.pool, self.device, batch_invariant=c.batch_invariant)
        self.speculative = None if c.draft_model is None else SpeculativeStep(c, self.runner, self.scheduler)
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self._order = itertools.count()
        self.last_step: StepStats | None = None

    @property
    def options(self) -> dict:
        """The config as keyword arguments: what rebuilds this engine elsewhere
        (`engine_process`, `replicas`)."""
        return dict(vars(self.config))  # not `asdict`: it would copy a draft model

    # counters of the model runner (see `ModelRunner`)
    num_prefill_tokens = property(lambda self: self.runner.num_prefill_tokens,
                                  doc="prompt (and recomputed) tokens fed to the model")
    num_decode_tokens = property(lambda self: self.runner.num_decode_tokens,
                                 doc="sampled tokens fed back, one per request per decode step")
    num_decode_calls = property(lambda self: self.runner.num_decode_calls,
                                doc="forward calls with decode rows (decode tokens / calls = batch)")

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0,
                    arrival_time: float | None = None, *, logprobs: int | None = None,
                    min_tokens: int = 0) -> str:
        """Queue one request (text with a tokenizer, or token ids); returns its id (default
        ``req-N``). A ValueError for one that could never run (`options.prepare_request`,
        `Scheduler.check_fits`). `arrival_time`: ``time.perf_counter()`` seconds."""
        req = self.new_request(prompt, params, request_id, priority, arrival_time,
                               logprobs=logprobs, min_tokens=min_tokens)
        self.requests[req.request_id] = req
        self.scheduler.add(req)
        return req.request_id

    def new_request(self, prompt, params: SamplingParams | None, request_id: str | None,
                    priority: int = 0, arrival_time: float | None = None, *,
                    logprobs: int | None = None, min_tokens: int = 0) -> Request:
        """A checked `Request` with its id chosen, not yet queued (`add_request`)."""
        seq, vocab = prepare_request(self.model, self.tokenizer, prompt, params,
                                     priority=priority, arrival_time=arrival_time,
                                     request_id=request_id, logprobs=logprobs,
                                     min_tokens=min_tokens, max_model_len=self.config.max_model_len)
        self.scheduler.check_fits(seq)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        order = next(self._order)
        if request_id is None:
            while f"req-{order}" in self.requests:  # a caller chose this id: take the next one
                order = next(self._order)
            request_id = f"req-{order}"
        seq.index = seq.result.index = order
        now = time.perf_counter() if arrival_time is None else float(arrival_time)
        vocab = min(vocab, self.config.sample_vocab or vocab)
        req = Request(request_id, seq, vocab, priority, now, order, self.device,
                      vocab_size=self.model.config.vocab_size)
        if logprobs is not None:
            req.num_logprobs, req.logprobs = logprobs, []
        return req

    def add_prefilled(self, req: Request, first_token: int, now: float
                      ) -> tuple[int, RequestOutput] | None:
        """`Scheduler.add_prefilled` of `req` (from `new_request`): disaggregated serving
        (`distributed.handoff`); an admitted request is the engine's from then on."""
        got = self.scheduler.add_prefilled(req, first_token, now)
        if got is not None and not got[1].finished:
            self.requests[req.request_id] = req
        return got

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request `request_id` (None if unknown or finished)."""
        return self.requests.get(request_id)

    def block_table(self, request_id: str) -> list[int]:
        """Where a running request's K/V live in `pool` (one block id per `block_size` tokens)."""
        return self.block_manager.block_table(request_id)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False if it is unknown or already finished.

        No `RequestOutput` is produced for it; its metrics record the finish reason "abort"."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.finish(req)
        req.metrics.on_finish(time.perf_counter(), "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # ---- one iteration -----------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduler iteration; return the outputs of requests that produced a token."""
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        for c in plan.chunks:
            c.request.metrics.on_scheduled(t0)
        outputs = (self.speculative.step(plan) if self.speculative and plan.chunks  # a draft
                   else self.scheduler.postprocess(plan, self.runner.execute(plan.chunks)))
        for out in outputs:
            if out.finished:
                del self.requests[out.request_id]
        self.last_step = StepStats(plan, time.perf_counter() - t0)
        return outputs

    # ---- offline -----------------------------------------------------------------------
    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run `prompts` (a list of texts or of token-id lists) to completion; outputs in order.
        `params`: one `SamplingParams` for all prompts, or one per prompt."""
        prompts, params = generate_arguments(prompts, params)
        ids: list[str] = []
        final: dict[str, RequestOutput] = {}
        try:
            for p, sp in zip(prompts, params):
                ids.append(self.add_request(p, sp))
            while self.requests:  # the unfinished ones
                final.update((o.request_id, o) for o in self.step() if o.finished)
        except BaseException:
            for rid in ids:  # a refused request, a step that raised: leave nothing behind
                self.abort(rid)
            raise
        return [final[i] for i in ids]

    def __repr__(self) -> str:
        s = self.scheduler
        return (f"LLMEngine(policy={s.policy!r}, max_num_seqs={s.max_num_seqs}, "
                f"max_num_batched_tokens={s.max_num_batched_tokens}, "
                f"chunked_prefill={s.chunked}, {self.block_manager})")
