"""Lesson 07, batching: one decode step for many sequences (claims BATCH-1, BATCH-2, MET-4).

This module is the lesson's namespace (``from minifer_course.lessons import batching as B``). The
lesson's learner writes the batched step, left padding and its mask in the notebook itself; what
lives here runs after that, at scale: :mod:`.batch_sweep` times one decode step for 1 … 64
sequences (:func:`measure_sweep`, the same function as ``python -m minifer_course.bench decode``),
:class:`BatchSweep` holds it beside the claims' reference CPU (:data:`REFERENCE_SWEEP`), and
:func:`batch_figure` / :func:`batch_panel` show step time, per-user and server tokens/s with a
batch-size slider; :mod:`.batch_figures` draws the learner's own step (:func:`step_work_figure`)
and padding mask (:func:`mask_figure`). (Lesson 08's paging and scheduling: :mod:`minifer_course.lessons.scheduling`.)
"""

from __future__ import annotations

from .batch_figures import mask_figure, step_work_figure  # noqa: F401
from .batch_sweep import (  # noqa: F401
    BATCHES,
    REFERENCE_SWEEP,
    BatchSweep,
    batch_figure,
    batch_panel,
    measure_sweep,
    sweep_table,
)

__all__ = ['BATCHES', 'BatchSweep', 'REFERENCE_SWEEP', 'batch_figure', 'batch_panel', 'mask_figure',
           'measure_sweep', 'step_work_figure', 'sweep_table']
