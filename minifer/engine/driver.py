"""The one loop every front of the engine runs: take what arrived, step, hand the outputs on.

`AsyncEngine`, `engine_process` and the two disaggregated workers differ only in where requests
come from and where outputs go. A step that raises failed for every request in it: `fail` ends
the requests in flight and the loop goes on (one request's failure `LLMEngine.step` ends alone)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["drive"]


def drive(engine: Any, take: Callable[[bool], bool], deliver: Callable[[list], None],
          fail: Callable[[Exception], None] | None = None) -> None:
    """Step `engine` until `take(idle)` returns False; it applies what arrived (``idle``:
    the engine has no work, so it may wait). Each step's outputs go to `deliver`; a step that
    raises goes to `fail` (without one, it propagates)."""
    while take(not engine.has_unfinished()):
        if not engine.has_unfinished():
            continue
        try:
            outputs = engine.step()
        except Exception as err:
            if fail is None:
                raise
            fail(err)
            continue
        deliver(outputs)
