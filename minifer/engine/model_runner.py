"""`ModelRunner`: turn one scheduled step into tensors, run the model once, sample.

The scheduler decides *what* runs; the runner packs every scheduled token (decode rows' one,
prompt chunks' many) into one sequence with each token's position and pool slot
(`kv_pool.PackedBatch`), makes **one forward call** for the step, and samples a token for every
request whose tokens are all fed (nano-vllm's `model_runner`, without CUDA graphs). Packing
changes which tokens share a matrix multiply, never what a row attends to (greedy rows are
`generate`'s own, `LLMEngine` says); seeded sampling uses each request's own generator."""

from __future__ import annotations

import time

import torch

from .. import hooks
from ..sampling import mask_padded_vocab, sample
from .kv_pool import PackedBatch, PagedKVPool
from .options import ban_early_eos, record_logprobs
from .request import Request
from .scheduler import Chunk

__all__ = ["ModelRunner"]


class ModelRunner:
    """Runs the scheduled chunks of one step through `model` over the paged `pool`.

    `batch_invariant`: each step runs `minifer.hooks.batch_invariant`'s kernels (`EngineConfig`).
    Counters (benchmarks, lessons): `num_forward_calls`, `forward_time_s` (inside the forward
    calls), `num_prefill_tokens` (prompt and recomputed tokens fed), `num_decode_tokens` (sampled
    tokens fed back), `num_decode_calls` (calls with a decode row: the mean decode batch)."""

    def __init__(self, model: torch.nn.Module, pool: PagedKVPool, device: torch.device,
                 batch_invariant: bool = False) -> None:
        self.model, self.pool, self.device = model, pool, device
        self.invariant = batch_invariant  # `hooks.batch_invariant`
        self.num_forward_calls, self.forward_time_s = 0, 0.0  # the counters, as listed above
        self.num_prefill_tokens = self.num_decode_tokens = self.num_decode_calls = 0

    def execute(self, chunks: list[Chunk]) -> list[int | Exception]:
        """One forward call over every chunk; for each chunk that completes its request's
        tokens, in order, the sampled token (or the exception sampling it raised)."""
        if not chunks:
            return []
        due = [j for j, c in enumerate(chunks) if c.completes]
        ids = [t for c in chunks for t in c.request.tokens[c.start:c.start + c.num_new]]
        batch = PackedBatch(self.pool, [c.block_table for c in chunks], [c.start for c in chunks],
                            [c.num_new for c in chunks], logits_rows=due)
        with torch.inference_mode():
            logits = self.forward(chunks, ids, batch)  # (len(due), vocab): the rows that sample
            return self.sample([chunks[j].request for j in due], logits)

    def forward(self, chunks: list[Chunk], ids: list[int], batch: PackedBatch) -> torch.Tensor:
        """The step's one model call over `chunks`, fed `ids` packed in `batch`: counted, timed."""
        decode = sum(1 for c in chunks if c.decodes)  # rows feeding back one sampled token
        self.num_decode_tokens += decode
        self.num_decode_calls += decode > 0
        self.num_prefill_tokens += sum(c.num_new for c in chunks) - decode  # prompt, recomputed
        t0 = time.perf_counter()
        with hooks.batch_invariant(self.model, self.invariant):
            logits = self.model(torch.tensor([ids], dtype=torch.long, device=self.device), cache=batch)
            self.forward_time_s += time.perf_counter() - t0
            self.num_forward_calls += 1
        return logits

    def sample(self, requests: list[Request], logits: torch.Tensor) -> list[int | Exception]:
        """One token per request from its logits row (requests sharing a `SamplingParams`
        together); what fails for one request comes back as its exception, in its place."""
        groups: dict[int, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(id(r.params), []).append(i)
        tokens: list[int | Exception] = [0] * len(requests)
        for rows in groups.values():
            try:
                picked = self._sample_group([requests[i] for i in rows], logits, rows)
            except Exception:  # noqa: BLE001 - it belongs to one of these rows: find which
                picked = [self._sample_alone(requests[i], logits, i) for i in rows]
            for i, t in zip(rows, picked):
                tokens[i] = t
        return tokens

    def _sample_alone(self, request: Request, logits: torch.Tensor, row: int) -> int | Exception:
        """Row `row` for `request` alone: its token, or the exception its sampling raised."""
        try:
            return self._sample_group([request], logits, [row])[0]
        except Exception as err:  # noqa: BLE001 - this request's failure, no one else's
            return err

    @staticmethod
    def _sample_group(reqs: list[Request], logits: torch.Tensor, rows: list[int]) -> list[int]:
        """Sample rows `rows` of `logits` for `reqs` (which share one `SamplingParams`)."""
        lg = mask_padded_vocab(logits[rows], reqs[0].vocab)  # a copy: indexed by a list
        raw = lg.clone() if any(r.logprobs is not None for r in reqs) else None
        ban_early_eos(lg, [r.seq for r in reqs])  # min_tokens
        seen = torch.stack([r.seen for r in reqs]) if reqs[0].seen is not None else None
        gens = [r.generator for r in reqs] if reqs[0].generator is not None else None
        picked = sample(lg, reqs[0].params, seen, gens).tolist()
        if raw is not None:
            record_logprobs(raw, reqs, picked)
        for r, t in zip(reqs, picked):
            if r.seen is not None:
                r.seen[t] = True
        return picked
