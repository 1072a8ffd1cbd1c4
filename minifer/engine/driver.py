"""The one loop every front of the engine runs: take what arrived, step, hand the outputs on.

`AsyncEngine` (a thread of the server), `engine_process` (a process of its own) and the two
workers of disaggregated serving differ only in where requests come from and where outputs go;
the loop itself is this (`LLMEngine.generate`, which has all its requests at the start, steps
until they are done):

    while take(idle):          # apply new requests and aborts (waiting for some while idle)
        if the engine has work:
            deliver(engine.step())

A failure of one request inside a step never reaches this loop: `LLMEngine.step` ends that
request alone (finish reason "error"). A step that raises failed for every request in it (the
forward call itself); `fail` ends the requests in flight and the loop goes on serving.
"""

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
