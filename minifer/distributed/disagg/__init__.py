"""Disaggregated prefill and decode (claim PD-12): two processes, the prompt's K/V sent between.

On one server a long prompt's prefill stalls every running request's next token; here prompts
run on a *prefill* worker and their K/V and first token travel to a *decode* worker, which keeps
decoding meanwhile. :mod:`.front`: the `LLMEngine`-like :class:`DisaggregatedEngine`;
:mod:`.worker`: the two ranks' loops; `minifer.distributed.handoff`: what moves between them."""

from .front import DisaggOutput, DisaggregatedEngine, DisaggReport
from .worker import FAULT_ENV, Span

__all__ = ["DisaggOutput", "DisaggReport", "DisaggregatedEngine", "FAULT_ENV", "Span"]
