"""A stand-in serving engine for the HTTP server's tests: `LLMEngine`'s public interface, no paging.

Each request runs on its own static KV cache (batch 1, `minifer.generation.prefill` /
`decode_step`), and `step()` advances every running request by one token, so its greedy output
is by construction what `minifer.generate` gives for that prompt alone. It lets the server be
tested against the documented engine interface on its own (and shows that the server needs
nothing else): `add_request` (with ``logprobs`` and ``min_tokens``), `step`, `has_unfinished`,
`abort`, `RequestOutput`, plus ``scheduler.running/waiting`` and ``block_manager`` counts for the
metrics.
"""

from __future__ import annotations

import time

import torch

from minifer import StaticKVCache, decode_step, prefill
from minifer.engine.metrics import RequestMetrics
from minifer.engine.options import ban_early_eos, check_options, record_logprobs
from minifer.engine.request import RequestOutput
from minifer.sampling import make_generators, mask_padded_vocab, sample
from minifer.sequence import prepare


class _Req:
    def __init__(self, rid, seq, vocab, device, metrics):
        self.rid, self.seq, self.vocab, self.metrics = rid, seq, vocab, metrics
        self.gens = make_generators(seq.params, 1, device)
        self.cache = None
        self.logits = None
        self.text = ""
        self.num_logprobs, self.logprobs = None, None


class Blocks:
    """Counts 'blocks' as requests holding a cache, so a leak shows as blocks_used > 0."""

    def __init__(self, engine: StandInEngine) -> None:
        self.engine = engine
        self.block_size = engine.model.config.context_length
        self.num_blocks = engine.max_num_seqs

    @property
    def num_used_blocks(self) -> int:
        return len(self.engine.scheduler.running)

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self.num_used_blocks


class Queues:
    def __init__(self) -> None:
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self.chunked = True
        self.num_preemptions = 0


class StandInEngine:
    def __init__(self, model, tokenizer=None, *, max_num_seqs: int = 8, **_ignored) -> None:
        self.model, self.tokenizer, self.max_num_seqs = model, tokenizer, max_num_seqs
        self.device = next(model.parameters()).device
        self.scheduler = Queues()
        self.block_manager = Blocks(self)
        self.requests: dict[str, _Req] = {}
        self._n = 0

    def add_request(self, prompt, params, request_id=None, priority=0, arrival_time=None, *,
                    logprobs=None, min_tokens=0) -> str:
        prep = prepare(self.model, [prompt], params, self.tokenizer, device=self.device)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        while request_id is None or request_id in self.requests:
            self._n += 1
            request_id = f"req-{self._n}"
        seq = prep.sequences[0]
        check_options(seq, logprobs, min_tokens)
        now = time.perf_counter() if arrival_time is None else arrival_time
        req = _Req(request_id, seq, prep.vocab, self.device,
                   RequestMetrics(request_id, len(seq.prompt_ids), now))
        if logprobs is not None:
            req.num_logprobs, req.logprobs = logprobs, []
        self.requests[request_id] = req
        self.scheduler.waiting.append(req)
        return request_id

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def abort(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        for q in (self.scheduler.waiting, self.scheduler.running):
            if req in q:
                q.remove(req)
        req.metrics.finished_time, req.metrics.finish_reason = time.perf_counter(), "abort"
        return True

    def step(self) -> list[RequestOutput]:
        sch = self.scheduler
        while sch.waiting and len(sch.running) < self.max_num_seqs:
            sch.running.append(sch.waiting.pop(0))
        outputs = []
        with torch.inference_mode():
            for req in list(sch.running):
                seq = req.seq
                if req.cache is None:
                    req.metrics.first_scheduled_time = time.perf_counter()
                    req.cache = StaticKVCache.for_model(self.model, 1, seq.max_len,
                                                        device=self.device)
                    ids = torch.tensor([seq.prompt_ids], device=self.device)
                    req.logits = prefill(self.model, ids, req.cache)
                logits = mask_padded_vocab(req.logits, req.vocab)
                raw = logits.clone()
                ban_early_eos(logits, [seq])
                tok = sample(logits, seq.params, None, req.gens)
                record_logprobs(raw, [req], [int(tok[0])])
                now = time.perf_counter()
                event = seq.append(int(tok[0]), now - req.metrics.arrival_time)
                req.text += event.text
                m = req.metrics
                m.first_token_time = m.first_token_time or now
                m.token_times.append(now)
                if event.finish_reason is not None:
                    m.finished_time, m.finish_reason = now, event.finish_reason
                    sch.running.remove(req)
                    del self.requests[req.rid]
                else:
                    req.logits = decode_step(self.model, tok, req.cache)
                outputs.append(RequestOutput(req.rid, seq.prompt_ids, list(seq.output_ids),
                                             req.text, event.text, seq.finished,
                                             seq.finish_reason, m,
                                             None if req.logprobs is None else list(req.logprobs)))
        return outputs


class Slow:
    """An engine whose steps take at least `delay` seconds (a bigger model, say): wraps any engine."""

    def __init__(self, engine, delay: float) -> None:
        self.inner, self.delay = engine, delay

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def step(self):
        time.sleep(self.delay)
        return self.inner.step()
