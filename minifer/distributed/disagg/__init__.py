"""Disaggregated prefill and decode (claim PD-12): two processes, the prompt's K/V sent between,
so that a long prompt's prefill never stalls the running requests' decode steps. :mod:`.front`:
the `LLMEngine`-like :class:`DisaggregatedEngine`; :mod:`.worker`: the two ranks' loops;
`minifer.distributed.handoff`: what moves between them."""

from .front import DisaggOutput, DisaggregatedEngine, DisaggReport
from .worker import FAULT_ENV, Span

__all__ = ["DisaggOutput", "DisaggReport", "DisaggregatedEngine", "FAULT_ENV", "Span"]
