"""The repository's top-level pytest settings (tests/conftest.py holds the tests' fixtures).

It lives here, not in notebooks/, so that it loads for every run (`make test`, a notebooks-only
run) and before tests/conftest.py, whose names the tests import as ``conftest``.

nbval runs each notebook in a Jupyter kernel of its own.
Starting that kernel forks a process. On a machine that another job keeps busy with processes and
threads, the fork can meet the task limit for a moment: it fails with EAGAIN ("Resource
temporarily unavailable", Python's `BlockingIOError`), nbval does not try again, and every cell
of that notebook fails with the same error while the notebook passes alone (issue 45, item 13).
EAGAIN asks the caller to try again, so here the kernel's start is tried again after a short,
growing wait (about half a minute in all) before the error stands.
"""

from __future__ import annotations

import errno
import functools
import sys
import time
from collections.abc import Callable

# Seconds to wait before each further try: 0.25 s doubling, ~32 s in all.
RETRY_WAITS_S = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)


def transient(err: BaseException) -> bool:
    """An error that asks to try again: EAGAIN from fork or clone (the task limit met)."""
    return isinstance(err, OSError) and err.errno == errno.EAGAIN


def retrying(start: Callable, waits: tuple[float, ...] = RETRY_WAITS_S,
             sleep: Callable[[float], None] = time.sleep) -> Callable:
    """`start`, tried again after each of `waits` while it fails with a transient error."""

    @functools.wraps(start)
    def start_retrying(*args, **kwargs):
        for wait in waits:
            try:
                return start(*args, **kwargs)
            except OSError as err:
                if not transient(err):
                    raise
                print(f"starting a Jupyter kernel met {err!r}: trying again in {wait} s",
                      file=sys.stderr, flush=True)
                sleep(wait)
        return start(*args, **kwargs)  # the last try: its error stands

    start_retrying.retries = start  # the wrapped function (and a mark: wrapped once)
    return start_retrying


def _patch_nbval() -> None:
    try:
        import nbval.kernel
    except ImportError:  # the notebooks are only collected with nbval (pytest --nbval)
        return
    if not hasattr(nbval.kernel.start_new_kernel, "retries"):
        nbval.kernel.start_new_kernel = retrying(nbval.kernel.start_new_kernel)


_patch_nbval()
