"""The claims' reference figures: what the course's numbers were measured as, in one place.

The benchmarks print these beside this machine's measurements, and the lessons draw them beside
their own; neither measures anything here. Change a figure here (and in CLAIMS.md) when the
reference run is redone.
"""

from __future__ import annotations

__all__ = ["DECODE", "SPEC"]

DECODE = {
    "prefill_512_ms": 147.0, "prefill_tok_s": 3480, "decode_ms": 11.1, "decode_tok_s": 90,
    "batch_ms": {1: 6.7, 8: 20.6, 32: 47.9, 64: 73.9},
    "batch_tok_s": {1: 150, 8: 388, 32: 667, 64: 866},
    "cache_ms": {32: (7.3, 34.2), 128: (6.6, 46.5)},  # (with cache, without) ms per token
}
"""Claims PD-3, BATCH-1 and KV-3: a 4-thread laptop CPU, the reference model in fp32
(``python -m minifer_course.bench decode``)."""

SPEC = {"draft_params": 148_000, "target_params": 5_100_000, "k": 4, "tokens": 80,
        "target_passes": 21, "accepted": 59}
"""Claim SPEC-3's reference run (``python -m minifer_course.bench spec``, the seed's figures)."""
