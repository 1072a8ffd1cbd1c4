"""Lesson 08, paging and scheduling: where a batch's KV cache lives and who runs in which step
(claims KV-12, BATCH-4 … BATCH-7, KV-14).

This module is the lesson's namespace (``from minifer_course.lessons import scheduling as S``). The
learner writes a block table, the static and continuous step counts and prefix caching's block
hashes and reference counts in the notebook, checked against `minifer.serve`; what lives here
runs the experiments at scale, a set of plain functions that return tables or plotly figures
(slider callbacks included, so tests can call them):

* :mod:`.paging` — paged vs reserved KV memory (KV-12): arithmetic over :mod:`minifer_course.roofline`
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

from minifer.engine.scheduler import POLICIES

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

__all__ = ['BLOCK_SIZES', 'CONTEXTS', 'DECODE', 'HELD', 'LIMIT_COLORS', 'POLICIES', 'PREFILL', 'RATES',
           'REFERENCE_COSTS', 'SEQ_LIMITS', 'StepCosts', 'TYPICAL_LENGTH', 'Trace', 'at_rate',
           'fastest_steps_s', 'gantt_figure', 'load_figure', 'load_panel', 'load_point', 'load_rows',
           'load_workload', 'mark_held', 'measure_costs', 'paging_figure', 'paging_panel',
           'paging_rows', 'pick_batch_limit', 'rates_for', 'run_engine', 'sequence_lengths',
           'sequential_ttft', 'simulate']
