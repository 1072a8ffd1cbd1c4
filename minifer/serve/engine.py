"""`LLMEngine`: many requests through one model, one scheduler step at a time.

The interface is that of serving engines (vLLM's names): `add_request` queues a request,
`step()` runs one iteration and returns a `RequestOutput` for each request that moved, `abort`
drops one, and `generate` is the offline convenience: add everything, step until done.

A step has three parts, in three places (nano-vllm's split): the `Scheduler` picks which
requests run and how many tokens each feeds (`schedule`), the `ModelRunner` packs all those
tokens — decode rows and prompt chunks together — into **one forward call** and samples
(`execute`), and the scheduler records the results: tokens computed, blocks named, tokens
appended, requests finished (`postprocess`). All K/V live in a paged pool (`kv_pool`), shared
between requests block by block when prefix caching is on.

Greedy outputs are token-identical to `minifer.generate` of each prompt alone (tested): every
row attends over exactly its own tokens at its own positions, whatever else is in the batch.
Seeded sampling uses one generator per request, so it does not depend on the batch either.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

import torch

from ..checks import check_int
from ..sampling import SamplingParams
from ..sequence import check_weights, prepare
from ..tokenizer import TokenizerLike
from .block_manager import BlockManager
from .driver import drive
from .handoff import Handoff
from .kv_pool import PagedKVPool
from .model_runner import ModelRunner
from .options import check_options, check_request, generate_arguments
from .request import Request, RequestOutput
from .scheduler import POLICIES, Chunk, Scheduler, SchedulerOutput

__all__ = ["LLMEngine", "RequestOutput", "StepStats"]


class StepStats:
    """What the last step did (for lessons: which request ran in which step)."""

    def __init__(self, out: SchedulerOutput, duration_s: float) -> None:
        self.prefill = [(c.request.request_id, c.num_new) for c in out.chunks if not _decodes(c)]
        self.decode = [c.request.request_id for c in out.chunks if _decodes(c)]
        self.preempted = [r.request_id for r in out.preempted]
        self.num_tokens = out.num_tokens
        self.duration_s = duration_s

    def __repr__(self) -> str:
        return (f"StepStats(decode={len(self.decode)}, prefill={self.prefill}, "
                f"preempted={self.preempted}, {self.duration_s * 1e3:.1f} ms)")


def _decodes(c: Chunk) -> bool:
    """A one-token chunk right after cached tokens: a decode step."""
    return c.num_new == 1 and c.start > 0


class LLMEngine:
    """A serving engine over a paged KV cache (see the module docstring).

    - `policy`: ``"continuous"`` (requests join and leave at every step) or ``"static"``
      (fixed groups run to completion: the baseline).
    - `block_size`, `num_blocks`: the KV pool (default: room for `max_num_seqs` full contexts).
    - `max_num_seqs`: most requests running at once; `max_num_batched_tokens`: most tokens fed
      in one step (default: the context length, or 256 with chunked prefill).
    - `enable_chunked_prefill`: split long prompts across steps, beside other requests' decode.
    - `enable_prefix_caching`: share full blocks with equal contents (a common system prompt).
    - `aging`: priority points a waiting request gains per step (0 = strict priority).
    - `sample_vocab`: sample only among the first `sample_vocab` token ids (default: the
      tokenizer's vocabulary, else the model's); a worker without the tokenizer gets its size.
    - `kv_read`: how attention reads the pool (`kv_pool.READS`): ``"blocks"`` (the default:
      each row's blocks copied into a buffer per layer, then SDPA), ``"slots"`` (the readable
      reference) or ``"kernel"`` (decode rows through a paged-attention kernel that reads the
      blocks in place, built for this machine on first use; see `paged_attention`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: TokenizerLike | None = None,
        *,
        policy: str = "continuous",
        block_size: int = 16,
        num_blocks: int | None = None,
        max_num_seqs: int = 32,
        max_num_batched_tokens: int | None = None,
        enable_chunked_prefill: bool = False,
        enable_prefix_caching: bool = False,
        device: torch.device | str | None = None,
        aging: float = 0.0,
        sample_vocab: int | None = None,
        kv_read: str = "blocks",
    ) -> None:
        from ..device import as_device

        if not hasattr(model, "config"):
            raise TypeError(f"model must be a minifer GPT, got {type(model).__name__}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        for name, value in (("block_size", block_size), ("max_num_seqs", max_num_seqs)):
            check_int(name, value, 1)
        ctx = model.config.context_length
        if num_blocks is None:
            num_blocks = max_num_seqs * -(-ctx // block_size)
        if max_num_batched_tokens is None:
            max_num_batched_tokens = min(256, ctx) if enable_chunked_prefill else ctx
        check_int("num_blocks", num_blocks, 1)
        if sample_vocab is not None:
            check_int("sample_vocab", sample_vocab, 1, model.config.vocab_size)
        self.sample_vocab = sample_vocab
        self.model, self.tokenizer = model, tokenizer
        check_weights(model)
        model_device = next(model.parameters()).device
        self.device = as_device(device) if device is not None else model_device
        if self.device != model_device and not (self.device.type == model_device.type
                                               and self.device.index is None):
            raise ValueError(f"device={device!r} but the model is on {model_device}; move the "
                             f"model first (model.to(device)) or leave device=None")
        self.pool = PagedKVPool.for_model(model, num_blocks, block_size, device=self.device)
        self.block_manager = BlockManager(num_blocks, block_size,
                                          enable_prefix_caching=enable_prefix_caching,
                                          bytes_per_token=self.pool.bytes_per_token)
        self.scheduler = Scheduler(self.block_manager, policy=policy, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   enable_chunked_prefill=enable_chunked_prefill, aging=aging)
        self.runner = ModelRunner(model, self.pool, self.device, read=kv_read)
        self.options = dict(  # what rebuilds this engine elsewhere (`engine_process`)
            policy=policy, block_size=block_size, num_blocks=num_blocks,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill,
            enable_prefix_caching=enable_prefix_caching, device=str(self.device), aging=aging,
            sample_vocab=sample_vocab, kv_read=kv_read)
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self._order = itertools.count()
        self.last_step: StepStats | None = None

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
        """Queue one request (text with a tokenizer, or a list of token ids); returns its id.

        Raises ValueError for a request that could never run: bad input (see
        `minifer.sequence.prepare`), prompt + max_new_tokens - 1 beyond the context window, more
        blocks than the whole pool, or (without chunked prefill) a prompt larger than one step.
        `arrival_time` (``time.perf_counter()`` seconds) defaults to now. Without `request_id`
        the engine picks ``req-N``, skipping ids of requests in flight. `priority` (at most 2**53
        either way), `logprobs` (reported in `RequestOutput.logprobs`) and `min_tokens`: see
        `minifer.serve.options`.
        """
        check_request(prompt, priority)
        req = self._new_request(prompt, params, request_id, priority, arrival_time)
        check_options(req.seq, logprobs, min_tokens)
        if logprobs is not None:
            req.num_logprobs, req.logprobs = logprobs, []
        self.requests[req.request_id] = req
        self.scheduler.add(req)
        return req.request_id

    def _new_request(self, prompt, params: SamplingParams | None, request_id: str | None,
                     priority: int, arrival_time: float | None) -> Request:
        """A checked `Request` with its id chosen (not yet queued)."""
        prep = prepare(self.model, [prompt], params, self.tokenizer, device=self.device)
        seq = prep.sequences[0]
        self.scheduler.check_fits(seq)
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        order = next(self._order)
        if request_id is None:
            request_id = f"req-{order}"
            while request_id in self.requests:  # a caller chose this id: take the next one
                order = next(self._order)
                request_id = f"req-{order}"
        seq.index = seq.result.index = order
        now = time.perf_counter() if arrival_time is None else float(arrival_time)
        vocab = prep.vocab if self.sample_vocab is None else min(prep.vocab, self.sample_vocab)
        return Request(request_id, seq, vocab, priority, now, order, self.device,
                       vocab_size=self.model.config.vocab_size)

    # ---- disaggregated serving: hand a prefilled request from one engine to another ------
    def export_prefilled(self, request_id: str) -> Handoff:
        """Take a request whose prompt is computed and whose first token was just sampled out
        of this engine, with a copy of its prompt's K/V (`serve.handoff.Handoff`).

        Call it right after the `step` that returned the request's first token. Its blocks
        are freed here; it produces no more outputs in this engine. A request that the first
        token finished has left already: build its `Handoff` from the output instead.
        """
        req = self.requests.get(request_id)
        if req is None:
            raise KeyError(f"no unfinished request {request_id!r} in this engine")
        prompt = req.seq.prompt_ids
        if len(req.seq.output_ids) != 1 or req.num_computed != len(prompt):
            raise ValueError(f"request {request_id!r} is not just prefilled: {len(prompt)} prompt "
                             f"tokens, {req.num_computed} computed, {len(req.seq.output_ids)} "
                             f"sampled (export it right after the step of its first token)")
        kv = self.pool.read_tokens(self.block_manager.block_table(request_id), len(prompt))
        self.scheduler.finish(req)  # frees its blocks
        del self.requests[request_id]
        m = req.metrics
        state = req.generator.get_state() if req.generator is not None else None
        return Handoff(request_id, list(prompt), req.seq.output_ids[0], req.params, kv,
                       m.arrival_time, m.first_scheduled_time, m.first_token_time,
                       priority=req.priority, generator_state=state)

    def add_prefilled(self, handoff: Handoff) -> bool:
        """Continue a request another engine prefilled (`export_prefilled`): allocate blocks
        in this pool, write its prompt's K/V into them, and decode it from the next step.

        Returns False, changing nothing, when it does not fit now (`max_num_seqs` running or
        too few free blocks): try again after a step. Raises ValueError for a handoff that
        could never run here (see `add_request`), one already finished, or K/V of the wrong
        shape. Its metrics keep the prefill engine's timestamps (arrival, first token).
        """
        h = handoff
        if h.finish_reason is not None or h.kv is None:
            raise ValueError(f"request {h.request_id!r} finished at its first token "
                             f"({h.finish_reason}); there is nothing to decode")
        expect = (self.pool.n_layer, 2, len(h.prompt_ids), self.pool.n_kv_head,
                  self.pool.head_dim)
        if tuple(h.kv.shape) != expect:
            raise ValueError(f"handoff K/V has shape {tuple(h.kv.shape)}, this engine's model "
                             f"needs {expect}")
        sch = self.scheduler
        if len(sch.running) >= sch.max_num_seqs or not self.block_manager.can_allocate(
                [*h.prompt_ids, h.first_token]):
            return False  # checked first: a request waiting for room is not prepared again
        req = self._new_request(list(h.prompt_ids), h.params, h.request_id, h.priority,
                                h.arrival_time)
        event = req.seq.append(h.first_token, h.first_token_time - h.arrival_time)
        req.text += event.text
        if event.finish_reason is not None:
            raise ValueError(f"request {h.request_id!r}: its first token finishes it "
                             f"({event.finish_reason}); there is nothing to decode")
        if req.seen is not None:
            req.seen[h.first_token] = True
        if req.generator is not None and h.generator_state is not None:
            req.generator.set_state(h.generator_state)
        cached = self.scheduler.add_prefilled(req, len(h.prompt_ids))
        if cached is None:
            return False
        if cached < len(h.prompt_ids):
            self.pool.write_tokens(self.block_manager.block_table(req.request_id),
                                   h.kv[:, :, cached:], start=cached)
        m = req.metrics
        m.on_scheduled(h.first_scheduled_time)
        m.on_token(h.first_token_time)
        self.requests[req.request_id] = req
        return True

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False if it is unknown or already finished.

        No `RequestOutput` is produced for it; its metrics record the finish reason "abort".
        """
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.finish(req)
        now = time.perf_counter()
        req.metrics.finished_time, req.metrics.finish_reason = now, "abort"
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
        tokens = self.runner.execute(plan.chunks)
        outputs = self.scheduler.postprocess(plan, tokens)
        for out in outputs:
            if out.finished:
                del self.requests[out.request_id]
        self.last_step = StepStats(plan, time.perf_counter() - t0)
        return outputs

    # ---- offline -----------------------------------------------------------------------
    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run `prompts` (a list of texts or of token-id lists) to completion; outputs in order.

        `params`: one `SamplingParams` for all prompts, or one per prompt.
        """
        prompts, params = generate_arguments(prompts, params)
        ids: list[str] = []
        try:
            for p, sp in zip(prompts, params):
                ids.append(self.add_request(p, sp))
        except (ValueError, TypeError):
            for rid in ids:  # leave the engine as it was
                self.abort(rid)
            raise
        final: dict[str, RequestOutput] = {}

        def keep(outputs: list[RequestOutput]) -> None:
            final.update((o.request_id, o) for o in outputs if o.finished)

        try:
            drive(self, lambda idle: not idle, keep)  # step until nothing is left
        except BaseException:
            for rid in ids:  # a step that raised (or Ctrl-C): leave nothing behind
                self.abort(rid)
            raise
        return [final[i] for i in ids]

    def __repr__(self) -> str:
        s = self.scheduler
        return (f"LLMEngine(policy={s.policy!r}, max_num_seqs={s.max_num_seqs}, "
                f"max_num_batched_tokens={s.max_num_batched_tokens}, "
                f"chunked_prefill={s.chunked}, {self.block_manager})")
