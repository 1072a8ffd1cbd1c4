"""Shared fixtures for the engine tests: tiny models, a tokenizer, a "scripted" GPT, devices.

Everything here is fp32 and small, so the whole engine suite runs in seconds on a CPU. The tests
that state the engine's guarantees (cache == recompute, batched == alone, speculative exactness,
the serving engine, every precision, the compiled step) also take the `device` fixture: they run
on "cpu" always and on "cuda" where a GPU is visible (`make test-gpu` runs only those, marked
``cuda``); without one the cuda cases skip for want of hardware, which the strict-deps check
(tests/strict_deps.py) does not count as a missing package.
"""

from __future__ import annotations

import copy

import pytest
import torch
from strict_deps import pytest_configure  # noqa: F401  (MINIFER_STRICT_DEPS=1: tests/strict_deps.py)

from minifer import GPT, ByteTokenizer, GPTConfig

# Tiny models gain nothing from more threads, and on a busy machine (the CI box, a training run
# beside us) extra OpenMP threads spin against each other: one thread is ~100x faster there.
torch.set_num_threads(1)

NO_CUDA = "no CUDA GPU here (make test-gpu runs these cases on one)"
DEVICES = ("cpu", pytest.param("cuda", marks=(
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA))))


@pytest.fixture(scope="session", params=DEVICES)
def device(request) -> str:
    """Where a guarantee is checked: "cpu", and "cuda" where a GPU is visible."""
    return request.param


_copies: dict[tuple[int, str], GPT] = {}


def on_device(model: torch.nn.Module, device: str) -> torch.nn.Module:
    """`model` itself on the CPU, else one copy of it moved to `device` (made once, kept, so a
    session-scoped fixture model is never moved under the tests that share it)."""
    if device == "cpu":
        return model
    key = (id(model), device)
    if key not in _copies:
        _copies[key] = copy.deepcopy(model).to(device)
        _keep.append(model)  # its id stays its own while the copy is cached
    return _copies[key]


_keep: list[torch.nn.Module] = []


def logits_atol(device: str, atol: float = 1e-5) -> float:
    """fp32 logits agree to `atol` on the CPU; a GPU's kernels sum in another order per shape
    (split-K matmuls, attention tiles), so a cached step and a full pass agree to 10x that."""
    return atol if device == "cpu" else 10 * atol


@pytest.fixture(autouse=True)
def json_renderer():
    """Lesson tests build figures: render them as JSON, never open a browser from a test run."""
    try:
        import plotly.io as pio
    except ImportError:  # pragma: no cover - plotly is an optional extra
        yield
        return
    old = pio.renderers.default
    pio.renderers.default = "json"
    yield
    pio.renderers.default = old


@pytest.fixture(autouse=True)
def ieee_subnormals():
    """Each test starts with IEEE subnormal floats. Inductor's compiled CPU kernels on torch 2.4
    switch the process to flush them to zero (a fast-math library's start-up code), and
    hypothesis's float strategies refuse to run in that state."""
    torch.set_flush_denormal(False)
    yield


def lively_model(preset: str = "tiny", seed: int = 0, scale: float = 10.0) -> GPT:
    """A seeded random model with its matrices scaled up.

    GPT-2's init (std 0.02) makes a tiny random model nearly uniform: greedy decoding repeats one
    token forever, which would make "same tokens" tests pass trivially. Scaled weights give varied,
    prompt-dependent output with clear argmax margins.
    """
    model = GPT.from_config(preset, seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(scale)
    return model.eval()


def scripted_gpt(script: list[int], vocab_size: int = 257, eos_token_id: int | None = 256,
                 context_length: int = 128) -> GPT:
    """A real `GPT` whose weights make it recite `script`: at position p it predicts script[p + 1].

    Token embeddings and every block's output projections are zero, so the residual stream is
    the one-hot position embedding; the output head maps position p to token script[p + 1]. The
    text it produces is therefore known in advance, yet it runs through the real engine
    (cache, left padding, per-row positions, sampling, detokenizing, stop strings).
    """
    if len(script) > context_length:
        raise ValueError("script longer than the context")
    cfg = GPTConfig(vocab_size=vocab_size, context_length=context_length, n_layer=1, n_head=4,
                    n_embd=context_length, eos_token_id=eos_token_id)
    model = GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.transformer.wpe.weight.copy_(torch.eye(context_length))
        for block in model.transformer.h:
            block.ln_1.weight.fill_(1.0)
            block.ln_2.weight.fill_(1.0)
        model.transformer.ln_f.weight.fill_(1.0)
        for pos, tok in enumerate(script[1:]):
            model.lm_head.weight[tok, pos] = 10.0
    return model.eval()


@pytest.fixture(scope="session")
def tok() -> ByteTokenizer:
    return ByteTokenizer()


@pytest.fixture(scope="session")
def tiny() -> GPT:
    return lively_model("tiny")


@pytest.fixture(scope="session")
def tiny_gqa() -> GPT:
    return lively_model("tiny-gqa")


@pytest.fixture(scope="session", params=["tiny", "tiny-gqa"])
def model(request) -> GPT:
    """Both attention flavours: plain multi-head and grouped-query."""
    return lively_model(request.param)


@pytest.fixture(scope="session")
def make_lively():
    return lively_model


@pytest.fixture(scope="session")
def make_scripted():
    return scripted_gpt


def packed_batch(pool, *args, read: str = "kernel", **kw):
    """A `PackedBatch` over `pool` whose steps read the pool `read`'s way (`fast.paged.READS`;
    with the speed-ups off, the reference whatever `read` says)."""
    from minifer import hooks
    from minifer.engine.kv_pool import PackedBatch
    from minifer.fast import paged

    with paged.read(read):
        pool.planner = hooks.packed_attention(pool)
    return PackedBatch(pool, *args, **kw)


def engine_reading(read: str, *args, **kw):
    """An `LLMEngine` whose pool is read `read`'s way (`fast.paged.READS`)."""
    from minifer.engine.llm_engine import LLMEngine
    from minifer.fast import paged

    with paged.read(read):
        return LLMEngine(*args, **kw)


def pool_read(pool) -> str | None:
    """How `pool`'s steps read it: ``"kernel"``, ``"blocks"``, or None (the reference)."""
    return None if pool.planner is None else pool.planner.keywords["how"]
