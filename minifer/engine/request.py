"""One request inside the serving engine, and what `LLMEngine.step` reports about it.

A `Request` wraps the `Sequence` every generation loop uses and adds what a scheduler needs: id,
priority, status, `num_computed`, its own random generator and its metrics."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from ..sampling import make_generators, seen_mask
from ..sequence import Sequence
from .metrics import RequestMetrics

__all__ = ["Status", "Request", "RequestOutput"]


class Status(enum.Enum):
    WAITING = "waiting"  # not started, or preempted (its K/V freed, to be recomputed)
    RUNNING = "running"  # holds blocks; prefilling or decoding
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """A request's state after one engine step (vLLM's `RequestOutput`, flattened): `token_ids`
    and `text` so far, `delta` the text this step released (held back until certain)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    delta: str
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics
    logprobs: list | None = None  # a `serve.logprobs.TokenLogprob` per token, if asked for
    error: str | None = None  # why it failed (finish_reason "error"), naming the request id


class Request:
    """A `Sequence` plus its place in the scheduler: ``num_computed`` of its ``tokens`` (prompt +
    generated) have K/V in the cache; it is due a pass over the rest (the prompt, one decode
    token, or everything after a preemption) and samples once none are left."""

    num_logprobs: int | None = None  # alternatives to report per token (None: no logprobs)
    logprobs: list | None = None  # the TokenLogprob of each generated token so far
    error: str | None = None  # set when something in a step failed for this request alone
    num_draft_computed = 0  # leading tokens whose K/V the draft's pool holds (`engine.speculative`)

    def __init__(self, request_id: str, seq: Sequence, vocab: int, priority: int,
                 arrival_time: float, order: int, device: torch.device,
                 vocab_size: int | None = None) -> None:
        self.request_id, self.seq, self.vocab = request_id, seq, vocab
        self.params = seq.params
        self.priority, self.order = priority, order  # order: arrival rank, breaks ties
        self.status = Status.WAITING
        self.num_computed = 0
        self.waited_steps = 0  # scheduler steps spent waiting (for aging)
        self.metrics = RequestMetrics(request_id=request_id, prompt_tokens=len(seq.prompt_ids),
                                      arrival_time=arrival_time)
        gens = make_generators(self.params, 1, device)  # its own: its samples never depend on the batch
        self.generator = gens[0] if gens else None
        self.seen = (seen_mask([seq.prompt_ids], vocab_size or vocab, device)[0]  # tokens seen
                     if self.params.repetition_penalty != 1.0 else None)  # (repetition penalty)
        self.text = ""  # released so far

    @property
    def tokens(self) -> list[int]:
        """Prompt then generated tokens (a new list)."""
        return self.seq.prompt_ids + self.seq.output_ids

    @property
    def num_tokens(self) -> int:
        return self.seq.num_tokens

    @property
    def num_due(self) -> int:
        """Tokens still to feed before the next token can be sampled."""
        return self.num_tokens - self.num_computed

    def output(self, delta: str) -> RequestOutput:
        s = self.seq
        return RequestOutput(self.request_id, s.prompt_ids, list(s.output_ids),
                             self.text if s.stopper is not None else None, delta,
                             self.status is Status.FINISHED, self.metrics.finish_reason,
                             self.metrics, None if self.logprobs is None else list(self.logprobs),
                             self.error)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, priority={self.priority}, {self.status.value}, "
                f"tokens={self.num_tokens}, computed={self.num_computed})")

