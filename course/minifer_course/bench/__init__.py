"""Measuring, honestly: timing (warm-up, device sync, medians, round-robin), probes of this
machine, and the benchmarks behind ``python -m minifer_course.bench probe|decode|profile|quant|spec|serve``.

`timing` and `probes` are imported here; the benchmark modules (`decode`, `quant`, `spec`, ...) are
imported where they are used. They measure and format; `commands` holds the command line (one
module per subcommand), `common` what every benchmark shares (seeded ids, machine info, the
busy-CPU warning) and `reference` the claims' reference figures the lessons draw beside theirs.
"""

from .probes import measure_bandwidth, measure_hardware, measure_matmul_flops, this_machine
from .timing import Timing, round_robin, sync, time_fn

__all__ = ["Timing", "measure_bandwidth", "measure_hardware", "measure_matmul_flops",
           "round_robin", "sync", "this_machine", "time_fn"]
