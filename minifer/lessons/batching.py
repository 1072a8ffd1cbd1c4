"""Lesson 07, batching and serving: many users share one model (claims BATCH-1, BATCH-2,
BATCH-4 … BATCH-7, MET-4, KV-12; prefix caching).

This module is the lesson's namespace (``from minifer.lessons import batching as B``); each part
lives in a module of its own, a set of plain functions that return tables or plotly figures
(slider callbacks included, so tests can call them):

* :mod:`.batch_sweep` — a measured batch sweep (BATCH-1, BATCH-2, MET-4): one decode step for
  1 … 64 sequences; :class:`BatchSweep` holds it, :func:`batch_figure` shows step time, per-user
  and server tokens/s beside the claims' reference CPU;
* :mod:`.paging` — paged vs reserved KV memory (KV-12): arithmetic over :mod:`minifer.roofline`
  and a seeded set of sequence lengths, with block-size and context sliders;
* :mod:`.simulation` — :func:`simulate` runs a workload through the engine's own scheduler on a
  simulated clock whose step times come from a :class:`StepCosts` (measured, or the claims'
  reference CPU), producing the same :class:`Trace` as a real engine run (BATCH-4, BATCH-5);
* :mod:`.load` — latency against load on that simulation, and the batch limit a latency target
  allows (BATCH-6, BATCH-7);
* :mod:`.traces` — which request ran in which step: :func:`run_engine` drives a
  :class:`minifer.LLMEngine` step by step with requests arriving at given steps, and
  :func:`gantt_figure` draws any :class:`Trace`.
"""

from __future__ import annotations

from ..serve.scheduler import POLICIES
from .batch_sweep import (  # noqa: F401
    BATCHES,
    REFERENCE_SWEEP,
    BatchSweep,
    batch_figure,
    batch_panel,
    measure_sweep,
    sweep_table,
)
from .load import (  # noqa: F401
    LIMIT_COLORS,
    RATES,
    SEQ_LIMITS,
    at_rate,
    load_figure,
    load_panel,
    load_point,
    load_rows,
    load_workload,
    pick_batch_limit,
    rates_for,
)
from .paging import (  # noqa: F401
    BLOCK_SIZES,
    CONTEXTS,
    TYPICAL_LENGTH,
    paging_figure,
    paging_panel,
    paging_rows,
    sequence_lengths,
)
from .simulation import (  # noqa: F401
    REFERENCE_COSTS,
    StepCosts,
    measure_costs,
    simulate,
)
from .traces import (  # noqa: F401
    DECODE,
    HELD,
    PREFILL,
    Trace,
    fastest_steps_s,
    gantt_figure,
    mark_held,
    run_engine,
    sequential_ttft,
)

__all__ = ['BATCHES', 'BLOCK_SIZES', 'BatchSweep', 'CONTEXTS', 'DECODE', 'HELD', 'LIMIT_COLORS', 'POLICIES', 'PREFILL', 'RATES', 'REFERENCE_COSTS', 'REFERENCE_SWEEP', 'SEQ_LIMITS', 'StepCosts', 'TYPICAL_LENGTH', 'Trace', 'at_rate', 'batch_figure', 'batch_panel', 'fastest_steps_s', 'gantt_figure', 'load_figure', 'load_panel', 'load_point', 'load_rows', 'load_workload', 'mark_held', 'measure_costs', 'measure_sweep', 'paging_figure', 'paging_panel', 'paging_rows', 'pick_batch_limit', 'rates_for', 'run_engine', 'sequence_lengths', 'sequential_ttft', 'simulate', 'sweep_table']
