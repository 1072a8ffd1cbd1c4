"""The generation loop: tokenize → prefill → (sample → append → decode)* → stop.

`prefill` runs every prompt token through the model in one parallel pass and fills the KV cache;
`decode_step` feeds one token per sequence and reads everything else from the cache. `stream`
drives them for a batch of prompts and yields each token the moment it exists (claim REQ-1);
`generate` collects one `Completion` per prompt. Per-request state (tokens, text, stop strings,
finish reason, timings) lives in `sequence.Sequence`.

`advance` is the loop itself, the one place a batch of Sequences takes new tokens: it asks a
*step* for each row's next tokens until every row has finished. `run_batch` gives it the plain
step (decode, sample); tensor parallelism (`minifer.parallel.generate_tp`) runs the same
`run_batch` with its own sampler, and speculative decoding (`minifer.speculative`) gives
`advance` a step that drafts, verifies and returns several tokens.

The decode step (`GPT.decode`) writes at a slot held in a tensor. Eager, it reads only the filled
cache slots; in its fixed-shape form it attends over the whole preallocated cache through a mask,
so ``generate(..., compile=True)`` can hand it to `torch.compile` (on CUDA with CUDA graphs: written
for it, untested on a GPU). Everything per request — the cache, its slot numbers,
the token buffer — is allocated once before the loop, and the request is checked once, by
`sequence.prepare`, not at every step. Threads: torch uses one per core, which is right on an
idle machine; where other programs keep cores busy, fewer threads can be many times faster
(BENCHMARKS.md measures it). So on a CPU a governor (`minifer.threads.thread_policy`) looks
between steps and lowers the count while cores are busy, never above
the count in force when the call began, which it restores after; ``threads=n`` fixes the count
instead, and ``threads="auto"`` lets the governor use every idle core.

Prompts of different lengths share a batch by *left padding*: row b's real tokens start at slot
``start[b]`` and the attention mask hides the padding, so every row computes what it would
compute alone. In fp32 that holds exactly (greedy tokens are identical, tested); in bf16/fp16 the
padded batch runs matmuls of other shapes, whose rounding can differ, so outputs may diverge
after a near-tie.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator

import torch

from .cache import KVCache, StaticKVCache
from .device import sync
from .sampling import SamplingParams, make_generators, mask_padded_vocab, sample
from .sequence import Completion, Prepared, Sequence, TokenEvent, encode_prompts, prepare
from .threads import thread_policy
from .tokenizer import TokenizerLike

__all__ = ["prefill", "decode_step", "compiled_decode", "advance", "stream", "run_batch",
           "generate", "Completion", "TokenEvent", "encode_prompts"]


# ---- the two kinds of forward pass ---------------------------------------------------------
def prefill(model: torch.nn.Module, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Run all prompt tokens ``(B, T)`` in one pass, writing their K/V into `cache`.

    Call ``cache.reset(start)`` first for a new batch. Returns the next-token logits ``(B, V)``.
    """
    return model(ids, cache=cache, last_only=True)[:, -1]


def decode_step(model: torch.nn.Module, tokens: torch.Tensor, cache: StaticKVCache, *,
                step: Callable | None = None, fixed_shape: bool = False) -> torch.Tensor:
    """Feed one new token per row ``(B,)``; attention reads all earlier tokens from `cache`.

    Returns the next-token logits ``(B, V)``. The step (`GPT.decode`) writes the new K/V at
    ``cache.slot`` (a one-element tensor, set here to ``cache.pos``). Eager, it reads only the
    filled slots. With ``fixed_shape=True``, or a compiled `step` from `compiled_decode`, it
    attends over every slot of the preallocated cache through a mask instead: then every shape
    is the same at every step, so `torch.compile` can compile it and a GPU can capture it once
    as a CUDA graph and replay it. The only check here is that the cache has room; the request
    was checked once, up front (`sequence.prepare`).
    """
    cache.check_room(1)
    tokens = tokens.view(-1, 1)
    if not hasattr(model, "decode"):  # a model without the lean step: plain forward
        return model(tokens, cache=cache)[:, -1]
    cache.slot.fill_(cache.pos)
    if step is None:
        kv_len = None if fixed_shape else cache.pos + 1
        logits = model(tokens, cache=cache, slot=cache.slot, kv_len=kv_len)
    else:
        if cache.slot.is_cuda:  # CUDA graphs: the previous step's outputs have been used
            torch.compiler.cudagraph_mark_step_begin()
        logits = step(model, tokens, cache, cache.slot)
    cache.advance(1)
    return logits


COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_compiled: dict[tuple[str, bool], Callable] = {}
# model -> its weights' stamp when a frozen step last ran it (`_weights_stamp`)
_frozen_stamps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# model -> {(compile, batch, cache length, cache dtype): its `_ShapeThreads`}
_compiled_threads: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# graphs torch.compile keeps per step function: one per batch size and cache length (and per
# model where weights are frozen). torch's default of 8 made a ninth shape a hard error.
RECOMPILE_LIMIT = 256


def _decode(model, tokens, cache, slot):
    return model(tokens, cache=cache, slot=slot)


def _decode_frozen(model, tokens, cache, slot):  # its own code object: its own compiled graphs
    return model(tokens, cache=cache, slot=slot)


class _FrozenStep:
    """A compiled step whose graphs inductor compiles with ``freezing`` on. The setting is read
    while a call compiles (``torch.compile(options=...)`` does not reach where it is read), so
    it is switched on around each call: other code this process compiles is left as it was."""

    def __init__(self) -> None:
        self._step = torch.compile(_decode_frozen, fullgraph=True, dynamic=False)

    def __call__(self, model, tokens, cache, slot):
        config = torch._inductor.config  # set and restored by hand: config.patch costs ~90 µs
        before, config.freezing = config.freezing, True
        try:
            return self._step(model, tokens, cache, slot)
        finally:
            config.freezing = before


def compiled_decode(model: torch.nn.Module, mode: str | None = None) -> Callable:
    """`GPT.decode` compiled by `torch.compile`, for ``decode_step(..., step=...)``.

    `mode` None picks ``"reduce-overhead"`` on CUDA (the step captured as a CUDA graph and
    replayed with one launch; untested here, where no GPU was available) and inductor's default
    elsewhere. On a CPU the default also **freezes** the weights (inductor's ``freezing``): they
    become constants of the compiled graph, and every linear weight is prepacked once into the
    blocked layout of oneDNN's (bf16: AMX where the CPU has it) or MKL's (fp32) GEMM, beside
    fused C++ kernels for everything between the matmuls (needs a C++ compiler). That is what
    `minifer.prepack` does eagerly, and what the CPU engines do at load: on a 2-core Xeon with AMX
    it made a compiled bf16 GPT-2 step 1.7x faster at batch 1 (BENCHMARKS.md). Frozen weights are
    a copy: `_compile_step` compiles again when a model's weights have changed since.

    Compiled once per process and mode; torch compiles one graph per batch size and cache
    length (``fullgraph=True``: a graph break is an error, not a silent slow path).
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode must be one of {COMPILE_MODES}, got {mode!r}")
    cpu = next(model.parameters()).device.type == "cpu"
    if mode is None:
        mode = "default" if cpu else "reduce-overhead"
    freeze = cpu and mode == "default"
    if (mode, freeze) not in _compiled:
        _raise_recompile_limit()
        _compiled[mode, freeze] = (_FrozenStep() if freeze else
                                   torch.compile(_decode, mode=mode, fullgraph=True,
                                                 dynamic=False))
    return _compiled[mode, freeze]


def _raise_recompile_limit() -> None:
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))


def _weights_stamp(model: torch.nn.Module) -> tuple:
    """What changes when a model's weights do: each tensor's storage and in-place version."""
    return tuple((t.data_ptr(), t._version) for t in
                 [*model.parameters(), *model.buffers()])


def _unfreeze_if_changed(model: torch.nn.Module) -> None:
    """Frozen steps hold a copy of the weights they were compiled with, and torch's guards do
    not see a weight changed in place (a fine-tuning step, `load_state_dict`): if `model`'s
    weights changed since a frozen step last ran it, every compiled step is dropped
    (`torch.compiler.reset`) and compiled again on its next call."""
    stamp = _weights_stamp(model)
    before = _frozen_stamps.get(model)
    if before is not None and before != stamp:
        torch.compiler.reset()
        _frozen_stamps.clear()
        _compiled_threads.clear()
    _frozen_stamps[model] = stamp


class _ShapeThreads:
    """The thread counts one compiled shape has graphs for, and when to compile another.

    torch compiles a step again for every thread count it meets (its guards include the
    count): on a 2-core Xeon a GPT-2 step took 10 s to compile again at one thread. So when the
    thread governor moves to a count this shape has no graph for, its steps run eager (the same
    tokens in fp32) until the time spent eager at that count equals what compiling the shape
    took the first time; then it compiles for that count too. A stall no longer than the time
    already spent: at most twice the cost of the better choice in hindsight, whether the new
    count lasts a few steps or for good (the ski-rental rule)."""

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


def _shape_threads(model: torch.nn.Module, compile: bool | str,
                   cache: StaticKVCache) -> _ShapeThreads:
    shapes = _compiled_threads.setdefault(model, {})
    key = (compile, cache.batch_size, cache.max_len, cache.k[0].dtype)
    if key not in shapes:
        shapes[key] = _ShapeThreads()
    return shapes[key]


def _compile_step(model: torch.nn.Module, compile: bool | str, cache: StaticKVCache
                  ) -> Callable | None:
    """The step function `stream` uses: None (eager) or the compiled one."""
    if compile is False or compile is None:
        return None
    if compile is not True and not isinstance(compile, str):
        raise ValueError(f"compile must be True, False or a torch.compile mode "
                         f"{COMPILE_MODES[1:]}, got {compile!r}")
    if not hasattr(model, "decode"):
        raise ValueError(f"compile=True needs a model with the fixed-shape step GPT.decode, got "
                         f"{type(model).__name__}")
    step = compiled_decode(model, None if compile is True else compile)
    if isinstance(step, _FrozenStep):
        _unfreeze_if_changed(model)
    if cache.slot.is_cuda:  # CUDA graphs may write the cache in place only at fixed addresses
        for t in cache.k + cache.v + (cache.k_scale + cache.v_scale if cache.quantized else []):
            torch._dynamo.mark_static_address(t)
    return step


# ---- the loop ------------------------------------------------------------------------------
Sampler = Callable[[torch.Tensor], torch.Tensor]
"""Next-token logits ``(B, V)`` → one token id per row ``(B,)``."""

Step = Callable[[], list[list[int]]]
"""One step of the loop: the tokens each row gets next (host ints, usually one per row)."""


def advance(seqs: list[Sequence], step: Step, t0: float) -> Iterator[TokenEvent]:
    """Append each step's tokens to their rows until every row has finished: the one place a
    batch of `Sequence`s advances (`stream`, tensor parallelism and speculative decoding all
    come through here; only their `step` differs).

    A row takes a step's tokens in order and stops at the first that finishes it (EOS, a stop
    string, `max_new_tokens`); tokens after that, and the tokens of finished rows, are dropped.
    Each token is stamped with the seconds since `t0` at which its step returned.
    """
    while not all(s.finished for s in seqs):
        new = step()
        now = time.perf_counter() - t0
        for s, tokens in zip(seqs, new):
            for token in tokens:
                if s.finished:
                    break
                yield s.append(token, now)


def stream(
    model: torch.nn.Module,
    prompts,
    params: SamplingParams | None = None,
    tokenizer: TokenizerLike | None = None,
    *,
    use_cache: bool = True,
    device: torch.device | str | None = None,
    completions: list[Completion] | None = None,
    kv_dtype: torch.dtype | str | None = None,
    compile: bool | str = False,
    threads: int | str | None = None,
) -> Iterator[TokenEvent]:
    """Yield a `TokenEvent` for every generated token of every prompt, as soon as it exists.

    Pass a list as `completions` to have it filled with the final `Completion`s.
    `use_cache=False` recomputes the whole sequence at every step: the reference path.
    `kv_dtype`: the KV cache's dtype (default: the model's); ``"int8"`` quantizes the cache.
    `compile`: run the decode step through `torch.compile` (True, or a mode such as
    ``"reduce-overhead"``; see `compiled_decode`). The first call for a batch size and cache
    length pays for compiling (seconds to minutes); later ones reuse it. fp32 greedy tokens are
    identical to eager (tested on CPU). torch compiles again for every thread count: where the
    thread governor (below) has moved to a count a shape has no graph for, its steps run eager
    until they have taken as long as compiling it did, and then it compiles for that count.
    `threads`, on a CPU: by default (None) torch's count in force is a ceiling, and the
    process's `minifer.threads.ThreadGovernor` lowers it between steps while other programs
    hold cores (two threads beside a busy core can run many times slower than one), then
    restores it; an integer fixes the count for this call (restored after it); ``"auto"`` lets
    the governor use every core other programs leave free, and keeps the count it set.
    """
    req = prepare(model, prompts, params, tokenizer, device=device)
    if completions is not None:  # the caller's list may already hold earlier results
        completions.extend(s.result for s in req.sequences)
    yield from run_batch(model, req, use_cache=use_cache, kv_dtype=kv_dtype, compile=compile,
                         threads=threads)


def run_batch(
    model: torch.nn.Module,
    req: Prepared,
    *,
    use_cache: bool = True,
    kv_dtype: torch.dtype | str | None = None,
    compile: bool | str = False,
    cache: StaticKVCache | None = None,
    sampler: Callable[[Sampler], Sampler] | None = None,
    threads: int | str | None = None,
) -> Iterator[TokenEvent]:
    """Generate for checked request input (`sequence.prepare`): prefill → (sample → append →
    decode step)* → stop, one `TokenEvent` per token; `stream` is this plus the checks.

    `cache`: the KV cache to fill (reset here), sized for the batch: tensor parallelism passes
    one holding only its rank's heads; default: one sized for the request. `sampler` wraps the
    sampler: given the default one (logits → tokens), it returns the one to use (tensor
    parallelism samples on rank 0 only and broadcasts the tokens to the other ranks).
    `threads`: see `stream`.
    """
    seqs, device, vocab = req.sequences, req.device, req.vocab
    params = seqs[0].params
    B, T = len(seqs), max(len(s.prompt_ids) for s in seqs)
    total = T + params.max_new_tokens
    start = torch.tensor([T - len(s.prompt_ids) for s in seqs], dtype=torch.long)
    buf = torch.zeros(B, total, dtype=torch.long)  # left-padded prompts, then generated tokens
    for b, s in enumerate(seqs):
        buf[b, T - len(s.prompt_ids):T] = torch.tensor(s.prompt_ids)
    buf = buf.to(device)
    padded = bool((start > 0).any())
    start = start.to(device)
    gens = make_generators(params, B, device)  # one per row: the same text alone or batched
    seen = None
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(B, model.config.vocab_size, dtype=torch.bool, device=device)
        for b, s in enumerate(seqs):  # the prompt's tokens count as already seen
            seen[b, torch.tensor(s.prompt_ids, device=device)] = True
    rows = torch.arange(B, device=device)

    if compile and not use_cache:
        raise ValueError("compile=True compiles the cached decode step: it needs use_cache=True")
    step_fn = None
    if use_cache:
        if cache is None:
            slots = total - 1
            if compile:  # round the cache length up so requests of similar length share one graph
                slots = min(-(-slots // 64) * 64, model.config.context_length)
            cache = StaticKVCache.for_model(model, B, slots, dtype=kv_dtype, device=device)
        elif cache.batch_size != B or cache.max_len < total - 1:
            raise ValueError(f"cache must have batch_size {B} and max_len >= {total - 1}, got "
                             f"{cache.batch_size} and {cache.max_len}")
        cache.reset(start)
        step_fn = _compile_step(model, compile, cache)
    shape = None  # a compiled step's thread counts, when a governor moves them

    def default_sampler(logits: torch.Tensor) -> torch.Tensor:
        return sample(mask_padded_vocab(logits, vocab), params, seen, gens)

    pick = default_sampler if sampler is None else sampler(default_sampler)
    n = 0  # tokens made per row so far
    tokens = None

    def step() -> list[list[int]]:
        """One decode step (the first: the prefill) and one sampled token per row."""
        nonlocal n, tokens
        policy.between_steps()
        if tokens is None:
            if use_cache:
                logits = prefill(model, buf[:, :T], cache)
            else:
                logits = model(buf[:, :T], start=start if padded else None, last_only=True)[:, -1]
        elif use_cache:
            fn = step_fn
            if shape is not None:
                count = torch.get_num_threads()
                fn = fn if shape.compiled(count) else None
                t0 = time.perf_counter()
            logits = decode_step(model, tokens, cache, step=fn)
            if shape is not None:
                shape.ran(count, fn is not None, time.perf_counter() - t0)
        else:
            seq = buf[:, : T + n]
            logits = model(seq, start=start if padded else None, last_only=True)[:, -1]
        tokens = pick(logits)
        host = tokens.tolist()  # waits for the device: the token now exists
        buf[:, T + n] = tokens
        n += 1
        if seen is not None:
            seen[rows, tokens] = True
        return [[t] for t in host]

    with thread_policy(threads, device) as policy, torch.inference_mode():
        if step_fn is not None and policy.governed:  # see `_ShapeThreads`
            shape = _shape_threads(model, compile, cache)
        yield from advance(seqs, step, time.perf_counter())
        sync(device)


def generate(
    model: torch.nn.Module,
    prompts,
    params: SamplingParams | None = None,
    tokenizer: TokenizerLike | None = None,
    *,
    use_cache: bool = True,
    device: torch.device | str | None = None,
    kv_dtype: torch.dtype | str | None = None,
    compile: bool | str = False,
    threads: int | str | None = None,
) -> list[Completion]:
    """Generate for one prompt or a batch; returns one `Completion` per prompt, in order.

    `kv_dtype`: the KV cache's dtype (default: the model's); ``"int8"`` quantizes the cache.
    `compile`: compile the decode step with `torch.compile`; `threads`: torch's CPU threads,
    or ``"auto"`` (see `stream`).
    """
    completions: list[Completion] = []
    for _ in stream(model, prompts, params, tokenizer, use_cache=use_cache, device=device,
                    completions=completions, kv_dtype=kv_dtype, compile=compile,
                    threads=threads):
        pass
    return completions

