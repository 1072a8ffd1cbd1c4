"""`LLMEngine`: many requests through one model, one scheduler step at a time.

The interface is that of serving engines (vLLM's names): `add_request` queues a request,
`step()` runs one iteration — the scheduler picks which requests run and how many tokens each
feeds, the model runs, one token is sampled for every request whose tokens are all fed — and
returns a `RequestOutput` for each request that moved. `generate` is the offline convenience:
add everything, step until done.

One step runs one forward call for all the rows that feed a single token (the decode batch) and
one forward call per prompt chunk (batch 1, on top of that request's cached tokens). All K/V live
in a paged pool (`kv_pool`), shared between requests block by block when prefix caching is on.

Greedy outputs are token-identical to `minifer.generate` of each prompt alone (tested): every
row attends over exactly its own tokens at its own positions, whatever else is in the batch.
Seeded sampling uses one generator per request, so it does not depend on the batch either.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

import torch

from ..sampling import SamplingParams, mask_padded_vocab, sample
from ..sequence import prepare
from ..tokenizer import TokenizerLike
from .block_manager import BlockManager
from .kv_pool import DecodeWorkspace, PagedKVPool
from .request import Request, RequestOutput, Status
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


def _token_at(req: Request, i: int) -> int:
    """Token `i` of prompt + output, without building the joined list."""
    prompt = req.seq.prompt_ids
    return prompt[i] if i < len(prompt) else req.seq.output_ids[i - len(prompt)]


def _decodes(c: Chunk) -> bool:
    """A one-token chunk right after cached tokens: it can join the batched decode call."""
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
    ) -> None:
        from ..device import as_device

        if not hasattr(model, "config"):
            raise TypeError(f"model must be a minifer GPT, got {type(model).__name__}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        for name, value in (("block_size", block_size), ("max_num_seqs", max_num_seqs)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        ctx = model.config.context_length
        if num_blocks is None:
            num_blocks = max_num_seqs * -(-ctx // block_size)
        if max_num_batched_tokens is None:
            max_num_batched_tokens = min(256, ctx) if enable_chunked_prefill else ctx
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        self.model, self.tokenizer = model, tokenizer
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
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self._order = itertools.count()
        self.last_step: StepStats | None = None
        self.num_prefill_tokens = 0  # prompt (and recomputed) tokens fed to the model
        self.num_decode_tokens = 0  # sampled tokens fed back, one per request per decode step
        self.num_decode_calls = 0  # batched decode forward calls (decode tokens / calls = batch)
        self._workspace: DecodeWorkspace | None = None  # the decode batch's K/V, contiguous
        self._ws_storage: list[torch.Tensor] | None = None  # its memory, reused by rebuilds
        self.num_workspace_builds = 0

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0,
                    arrival_time: float | None = None) -> str:
        """Queue one request (text with a tokenizer, or a list of token ids); returns its id.

        Raises ValueError for a request that could never run: bad input (see
        `minifer.sequence.prepare`), prompt + max_new_tokens - 1 beyond the context window, more
        blocks than the whole pool, or (without chunked prefill) a prompt larger than one step.
        `arrival_time` (``time.perf_counter()`` seconds) defaults to now.
        """
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer (lower = served first), got {priority!r}")
        if isinstance(prompt, (list, tuple)) and prompt and not all(
                isinstance(p, int) or hasattr(p, "__index__") for p in prompt):
            raise ValueError("add_request takes one prompt (text or a flat list of token ids); "
                             "use generate() for a list of prompts")
        prep = prepare(self.model, [prompt], params, self.tokenizer, device=self.device)
        seq = prep.sequences[0]
        need = seq.max_len
        bm, sch = self.block_manager, self.scheduler
        if bm.blocks_for(need) > bm.num_blocks:
            raise ValueError(
                f"request needs {bm.blocks_for(need)} blocks of {bm.block_size} tokens for "
                f"{need} tokens (prompt {len(seq.prompt_ids)} + max_new_tokens "
                f"{seq.params.max_new_tokens} - 1) but the pool has only num_blocks="
                f"{bm.num_blocks}; raise num_blocks or lower max_new_tokens")
        if not sch.chunked and need > sch.max_num_batched_tokens:
            raise ValueError(
                f"without chunked prefill a request must fit one step: prompt + max_new_tokens - 1"
                f" = {need} > max_num_batched_tokens={sch.max_num_batched_tokens} (a preempted "
                f"request recomputes all its tokens at once); raise max_num_batched_tokens or "
                f"pass enable_chunked_prefill=True")
        if request_id is None:
            request_id = f"req-{next(self._order)}"
            order = int(request_id[4:])
        else:
            if not isinstance(request_id, str) or not request_id:
                raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
            order = next(self._order)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        seq.index = seq.result.index = order
        now = time.perf_counter() if arrival_time is None else float(arrival_time)
        req = Request(request_id, seq, prep.vocab, priority, now, order, self.device,
                      vocab_size=self.model.config.vocab_size)
        self.requests[request_id] = req
        sch.add(req)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False if it is unknown or already finished.

        No `RequestOutput` is produced for it; its metrics record the finish reason "abort".
        """
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.finish(req)
        self._workspace = None
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
        if plan.preempted:
            self._workspace = None  # belt and braces: preempted rows will be recomputed
        for c in plan.chunks:
            if c.request.metrics.first_scheduled_time is None:
                c.request.metrics.first_scheduled_time = t0
        logits = self._forward(plan.chunks)
        outputs = self._sample(plan.chunks, logits) if plan.chunks else []
        self.last_step = StepStats(plan, time.perf_counter() - t0)
        return outputs

    def _forward(self, chunks: list[Chunk]) -> dict[int, torch.Tensor]:
        """Run the model over every chunk; next-token logits of the chunks that complete."""
        bm, pool = self.block_manager, self.pool
        logits: dict[int, torch.Tensor] = {}
        decode = [i for i, c in enumerate(chunks) if _decodes(c)]
        with torch.inference_mode():
            if decode:
                rows = [chunks[i] for i in decode]
                ids = torch.tensor([[_token_at(c.request, c.start)] for c in rows],
                                   dtype=torch.long, device=self.device)
                keys = [c.request.request_id for c in rows]
                tables = [bm.tables[k] for k in keys]
                context = [c.start for c in rows]
                ws = self._workspace
                if ws is None or not ws.matches(keys, context):
                    ws = self._workspace = DecodeWorkspace(pool, keys, tables, context,
                                                           storage=self._ws_storage)
                    self._ws_storage = ws.storage
                    self.num_workspace_builds += 1
                out = self.model(ids, cache=ws.prepare(tables))[:, -1]
                self.num_decode_calls += 1
                for j, i in enumerate(decode):
                    logits[i] = out[j]
            for i, c in enumerate(chunks):
                if _decodes(c):
                    continue
                toks = c.request.tokens[c.start:c.start + c.num_new]
                ids = torch.tensor([toks], dtype=torch.long, device=self.device)
                cache = pool.batch([bm.tables[c.request.request_id]], [c.start], c.num_new)
                out = self.model(ids, cache=cache, last_only=True)[:, -1]
                logits[i] = out[0]
        for c in chunks:
            if c.num_new == 1 and c.completes and c.request.seq.output_ids:
                self.num_decode_tokens += 1  # the last sampled token, fed back
            else:
                self.num_prefill_tokens += c.num_new  # prompt (or recomputed) tokens
            c.request.num_computed = c.start + c.num_new
            if bm.enable_prefix_caching:
                bm.commit(c.request.request_id, c.request.tokens, c.request.num_computed)
        return logits

    def _sample(self, chunks: list[Chunk], logits: dict[int, torch.Tensor]) -> list[RequestOutput]:
        due = [i for i, c in enumerate(chunks) if c.completes]
        tokens: dict[int, int] = {}
        # rows that share a SamplingParams object are sampled together
        groups: dict[int, list[int]] = {}
        for i in due:
            groups.setdefault(id(chunks[i].request.params), []).append(i)
        with torch.inference_mode():
            for rows in groups.values():
                reqs = [chunks[i].request for i in rows]
                params = reqs[0].params
                lg = torch.stack([logits[i] for i in rows])
                lg = mask_padded_vocab(lg, reqs[0].vocab)
                seen = torch.stack([r.seen for r in reqs]) if reqs[0].seen is not None else None
                gens = [r.generator for r in reqs] if reqs[0].generator is not None else None
                picked = sample(lg, params, seen, gens).tolist()
                for i, r, t in zip(rows, reqs, picked):
                    tokens[i] = t
                    if r.seen is not None:
                        r.seen[t] = True
        now = time.perf_counter()
        outputs = []
        for i in due:
            req = chunks[i].request
            if req.status is not Status.RUNNING:
                continue
            event = req.seq.append(tokens[i], now - req.metrics.arrival_time)
            req.text += event.text
            m = req.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            m.token_times.append(now)
            if event.finish_reason is not None:
                m.finished_time, m.finish_reason = now, event.finish_reason
                self.scheduler.finish(req)
                del self.requests[req.request_id]
            outputs.append(req.output(event.text))
        return outputs

    # ---- offline -----------------------------------------------------------------------
    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run `prompts` (a list of texts or of token-id lists) to completion; outputs in order.

        `params`: one `SamplingParams` for all prompts, or one per prompt.
        """
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and all(isinstance(p, int) for p in prompts)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a non-empty list of prompts (texts or id lists)")
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)  # one object: its rows are sampled together
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        ids: list[str] = []
        try:
            for p, sp in zip(prompts, params):
                ids.append(self.add_request(p, sp))
        except (ValueError, TypeError):
            for rid in ids:  # leave the engine as it was
                self.abort(rid)
            raise
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def __repr__(self) -> str:
        s = self.scheduler
        return (f"LLMEngine(policy={s.policy!r}, max_num_seqs={s.max_num_seqs}, "
                f"max_num_batched_tokens={s.max_num_batched_tokens}, "
                f"chunked_prefill={s.chunked}, {self.block_manager})")
