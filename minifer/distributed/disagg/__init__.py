"""Disaggregated prefill and decode (claim PD-12): two processes, the prompt's K/V sent between.

On one server, prefill and decode compete: a long prompt's prefill step stalls every running
request's next token. Disaggregated serving runs prompts on a *prefill* worker and decode steps
on a *decode* worker; when a prompt is done its K/V (``bytes_per_token × prompt tokens``) and
first token travel to the decode worker, which keeps decoding with continuous batching while
the next long prompt is prefilled elsewhere.

- :mod:`.front`: :class:`DisaggregatedEngine`, the `LLMEngine`-like front (``add_request``,
  ``poll``, ``generate``, ``close``), which starts and always ends the workers.
- :mod:`.worker`: the two ranks' loops (rank 0 prefill, rank 1 decode) and their timelines.
- ``python -m minifer.distributed.disagg``: the ranks' program, also for ``torchrun --nproc-per-node 2``.
- `minifer.distributed.handoff`: what moves between them and how (``dist.send`` / ``dist.recv``).
"""

from .front import DisaggOutput, DisaggregatedEngine, DisaggReport
from .worker import FAULT_ENV, Span

__all__ = ["DisaggOutput", "DisaggReport", "DisaggregatedEngine", "FAULT_ENV", "Span"]
