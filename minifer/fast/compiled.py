"""The decode step compiled by `torch.compile`, and when to compile it again.

Reference: the eager lean step (`minifer.fast.decode.LeanStep`), which ``generate`` runs by
default; ``generate(..., compile=True)`` runs this instead, with identical fp32 greedy tokens.
The fixed-shape lean step attends over the whole preallocated cache through a mask, so torch
compiles one graph per batch size and cache length (``fullgraph=True``: a graph break is an
error, not a silent slow path). On CUDA the default mode is ``"reduce-overhead"`` (CUDA graphs).

On a CPU the default also **freezes** the weights (inductor's ``freezing``): prepacked
constants of the graph, a copy, so the step is compiled again when a model's weights have
changed (`unfreeze_if_changed`). torch compiles again for every thread count it meets (seconds),
so at a count the thread governor moves to, a shape's steps run eager until they have taken as
long as its first compile did (`ShapeThreads`)."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable

import torch

from ..model import GPT
from .decode import LeanStep, SlotWriter, lean_forward

__all__ = ["COMPILE_MODES", "compiled_decode", "decode_function", "ShapeThreads"]

COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# graphs torch.compile keeps per step function: one per batch size, cache length and thread
# count (and model, where weights are frozen); torch's default of 8 is too few.
RECOMPILE_LIMIT = 256

_compiled: dict[tuple[str, bool], LeanStep] = {}
_frozen_stamps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> weights stamp
_shapes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {shape: ShapeThreads}


def _decode(model, tokens, writer):
    return lean_forward(model, tokens, writer)


def _decode_frozen(model, tokens, writer):  # its own code object: its own compiled graphs
    return lean_forward(model, tokens, writer)


class CompiledStep(LeanStep):
    """The fixed-shape lean step compiled; on CUDA it tells torch before each call that the
    last step's outputs have been used, so a CUDA graph may write over them."""

    def __init__(self, mode: str) -> None:
        super().__init__(fixed_shape=True)
        self.step = torch.compile(_decode, mode=mode, fullgraph=True, dynamic=False)

    def forward(self, model, tokens, writer: SlotWriter) -> torch.Tensor:
        writer.kv_len = None  # every slot: the same shapes at every step
        if writer.slot.is_cuda:
            torch.compiler.cudagraph_mark_step_begin()
        return self.step(model, tokens, writer)


class FrozenStep(LeanStep):
    """The fixed-shape lean step compiled with inductor's ``freezing`` on. The setting is read
    while a call compiles (``torch.compile(options=...)`` does not reach it), so it is switched
    on around each call; other code this process compiles is left as it was."""

    def __init__(self) -> None:
        super().__init__(fixed_shape=True)
        self.step = torch.compile(_decode_frozen, fullgraph=True, dynamic=False)

    def forward(self, model, tokens, writer: SlotWriter) -> torch.Tensor:
        writer.kv_len = None  # every slot: the same shapes at every step
        config = torch._inductor.config  # set and restored by hand: config.patch is slower
        before, config.freezing = config.freezing, True
        try:
            return self.step(model, tokens, writer)
        finally:
            config.freezing = before


def compiled_decode(model: torch.nn.Module, mode: str | None = None) -> LeanStep:
    """The fixed-shape lean step compiled, called as ``step(model, tokens, cache)`` (or given to
    `minifer.decode_step` as its `step`).

    `mode` None: ``"reduce-overhead"`` (CUDA graphs) on CUDA, inductor's frozen default on a
    CPU. Compiled once per process and mode."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode must be one of {COMPILE_MODES}, got {mode!r}")
    cpu = next(model.parameters()).device.type == "cpu"
    mode = ("default" if cpu else "reduce-overhead") if mode is None else mode
    freeze = cpu and mode == "default"
    if (mode, freeze) not in _compiled:
        config = torch._dynamo.config
        name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))
        _compiled[mode, freeze] = FrozenStep() if freeze else CompiledStep(mode)
    return _compiled[mode, freeze]


def unfreeze_if_changed(model: torch.nn.Module) -> None:
    """Frozen steps hold a copy of the weights, and torch's guards do not see a weight changed
    in place (a fine-tuning step, `load_state_dict`): if `model`'s weights changed since a
    frozen step last ran it, every compiled step is dropped and compiled again on next use."""
    stamp = tuple((t.data_ptr(), t._version) for t in [*model.parameters(), *model.buffers()])
    before = _frozen_stamps.get(model)
    if before is not None and before != stamp:
        torch.compiler.reset()
        _frozen_stamps.clear()
        _shapes.clear()
    _frozen_stamps[model] = stamp


class ShapeThreads:
    """The thread counts one compiled shape has graphs for, and when to compile another: at a
    count with no graph, steps run eager until the time spent there equals the shape's first
    compile; then it compiles for that count too. At most twice the cost of the better choice
    in hindsight, however long the new count lasts (the ski-rental rule)."""

    def __init__(self) -> None:
        self.counts: set[int] = set()
        self.compile_s: float | None = None  # the first compiled call: compiling and one step
        self.eager_s: dict[int, float] = {}

    def compiled(self, threads: int) -> bool:
        """Run the compiled step at `threads` (compiling for it if new)?"""
        if not self.counts or threads in self.counts:
            self.counts.add(threads)
            return True
        if self.compile_s is not None and self.eager_s.get(threads, 0.0) >= self.compile_s:
            self.counts.add(threads)
            return True
        return False

    def ran(self, threads: int, compiled: bool, seconds: float) -> None:
        if compiled:
            if self.compile_s is None:
                self.compile_s = seconds
        else:
            self.eager_s[threads] = self.eager_s.get(threads, 0.0) + seconds


class ThreadAwareStep(LeanStep):
    """A compiled step for one cache shape that runs the eager lean step at thread counts it
    has no graph for yet (`ShapeThreads`)."""

    def __init__(self, compiled: LeanStep, shape: ShapeThreads) -> None:
        super().__init__()
        self.compiled, self.shape = compiled, shape

    def forward(self, model, tokens, writer: SlotWriter) -> torch.Tensor:
        count = torch.get_num_threads()
        compiled = self.shape.compiled(count)
        t0 = time.perf_counter()
        logits = (self.compiled.forward(model, tokens, writer) if compiled  # else the eager
                  else super().forward(model, tokens, writer))  # step, reading filled slots only
        self.shape.ran(count, compiled, time.perf_counter() - t0)
        return logits


def decode_function(model: torch.nn.Module, cache, compile: bool | str) -> Callable | None:
    """The `minifer.hooks.decode_function` of the speed-up package: for a `GPT`, the eager lean
    step (`minifer.fast.decode`) for ``compile=False``, the compiled one for True (or a
    `torch.compile` mode name); None (the plain forward pass) for another model."""
    if compile is False or compile is None:
        return LeanStep() if isinstance(model, GPT) else None
    if compile is not True and not isinstance(compile, str):
        raise ValueError(f"compile must be True, False or a torch.compile mode "
                         f"{COMPILE_MODES[1:]}, got {compile!r}")
    if not isinstance(model, GPT):
        raise ValueError(f"compile=True compiles minifer's GPT decode step, got "
                         f"{type(model).__name__}")
    step = compiled_decode(model, None if compile is True else compile)
    if isinstance(step, FrozenStep):
        unfreeze_if_changed(model)
    if cache.k[0].is_cuda:  # CUDA graphs may write the cache in place only at fixed addresses
        for t in cache.k + cache.v + (cache.k_scale + cache.v_scale if cache.quantized else []):
            torch._dynamo.mark_static_address(t)
    shapes = _shapes.setdefault(model, {})
    key = (compile, cache.batch_size, cache.max_len, cache.k[0].dtype)
    return ThreadAwareStep(step, shapes.setdefault(key, ShapeThreads()))
