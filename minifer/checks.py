"""Argument checks shared by the whole package: one wording for "an integer in this range".

A bad value fails up front with the parameter's name, the allowed range and the value, not
later inside torch. A bool is never taken for a number."""

from __future__ import annotations

import math
import numbers
import operator
import os
from typing import Any

__all__ = ["check_int", "check_number", "check_threads", "int_range_text", "max_threads",
           "number_range_text", "parse_threads"]


def int_range_text(lo: int | None = 1, hi: int | None = None) -> str:
    """How an allowed integer range reads in an error message: "a positive integer (>= 1)",
    "an integer >= 0", "an integer in [1, 64]"."""
    if hi is not None:
        return f"an integer in [{'-inf' if lo is None else lo}, {hi}]"
    if lo is None:
        return "an integer"
    return "a positive integer (>= 1)" if lo == 1 else f"an integer >= {lo}"


def _is_number(value: Any, kind: type = numbers.Real) -> bool:
    """A Python or NumPy number of `kind` (``numbers.Integral``: an integer), not a bool."""
    return (isinstance(value, kind) and not isinstance(value, bool)
            and type(value).__name__ != "bool_")


def check_int(name: str, value: Any, lo: int | None = 1, hi: int | None = None, *,
              why: str = "", allowed: str | None = None) -> int:
    """`value` as an int if it is one (Python or NumPy, not a bool) in [lo, hi] (None: no
    bound), else ``ValueError("{name} must {allowed}{why}, got {value!r}")``."""
    ok = _is_number(value, numbers.Integral)
    if ok:
        v = operator.index(value)
        ok = (lo is None or v >= lo) and (hi is None or v <= hi)
    if not ok:
        raise ValueError(f"{name} must {allowed or 'be ' + int_range_text(lo, hi)}{why}, "
                         f"got {value!r}")
    return v


def check_number(name: str, value: Any, *, gt: float | None = None, ge: float | None = None,
                 lt: float | None = None, le: float | None = None, finite: bool = False,
                 why: str = "") -> float:
    """`value` (a NumPy scalar as a float) if it is a real number, not a bool or NaN, within
    the bounds (`finite`: not ±inf), else a ValueError naming `name`, the bounds and the value."""
    try:
        ok = _is_number(value) and not math.isnan(float(value))
    except OverflowError:  # an int too large for a float
        ok = False
    if ok:
        ok = ((gt is None or value > gt) and (ge is None or value >= ge)
              and (lt is None or value < lt) and (le is None or value <= le)
              and (not finite or math.isfinite(value)))
    if not ok:
        raise ValueError(f"{name} must be {number_range_text(gt, ge, lt, le, finite)}{why}, "
                         f"got {value!r}")
    return value if type(value) in (int, float) else float(value)


def number_range_text(gt: float | None = None, ge: float | None = None, lt: float | None = None,
                      le: float | None = None, finite: bool = False) -> str:
    """How allowed numbers read in an error message: "a positive number (> 0)", "a number >= 0
    and <= 100", "a positive finite number (> 0)"."""
    bounds = [f"{op} {b:g}" for op, b in ((">", gt), (">=", ge), ("<", lt), ("<=", le))
              if b is not None and not (op == ">" and b == 0)]
    what = ("a positive " if gt == 0 else "a ") + ("finite number" if finite else "number")
    what += " (> 0)" if gt == 0 else ""
    return what + (" and " if gt == 0 else " ") + " and ".join(bounds) if bounds else what


def max_threads() -> int:
    """The most CPU threads a call may ask for: four per core this process may run on."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return 4 * (cores or 1)


def check_threads(threads: Any) -> int | str | None:
    """A `threads=` argument: None, ``"auto"``, or an integer in [1, `max_threads`]."""
    if threads is None or threads == "auto":
        return threads
    hi = max_threads()
    return check_int("threads", threads, 1, hi,
                     allowed=f"be 'auto' or an integer in [1, {hi}] (4 per core)")


def parse_threads(value: str) -> int | str:
    """A ``--threads`` option's value (argparse's ``type=``): ``auto`` or an integer up to
    `max_threads`; anything else is argparse's error, worded as `check_threads` words it."""
    import argparse

    try:
        value = int(value)
    except ValueError:
        pass  # "auto", or a word check_threads names in its error
    try:
        return check_threads(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
