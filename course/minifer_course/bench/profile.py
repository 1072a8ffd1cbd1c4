"""Where a decode step's time goes: ``python -m minifer_course.bench profile``.

Runs a few greedy decode steps of one engine (minifer eager or compiled, the textbook engine,
`transformers`, or minifer on int8/int4 weights) under `torch.profiler` and prints

* the top torch ops by their own CPU time (the profiler's table);
* a summary: the step's wall time split into the linear layers (every matmul kernel), attention,
  the other torch ops, and what is left outside any torch op: Python, module calls, dispatch.
  For the serving engine (``--engines serve``: `LLMEngine` steps at a fixed decode batch over
  the paged pool; ``serve-kernel``: the same with its decode attention in the paged kernel,
  which reads the pool in place) the K/V copies (reads of the pool by index, writes of new tokens) are their
  own line: the share of the step the paged layout costs.

This is how BENCHMARKS.md explains a target that is missed (what takes the time between a step
and its matmul floor). The profiler adds a few microseconds per op, so the "outside torch ops"
share is an upper bound; the timings themselves belong to ``decode --table``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from minifer.checks import check_int
from minifer.model import GPT

from .common import random_ids

__all__ = ["ENGINES", "LINEAR_OPS", "ATTENTION_OPS", "KV_COPY_OPS", "StepProfile",
           "ServeDecoder", "profile_decode", "format_summary"]

ENGINES = ("minifer", "compiled", "textbook", "transformers", "int8", "int4", "serve",
           "serve-kernel")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# torch ops that are the linear layers' matmuls (eager, oneDNN/MKL, quantized, inductor): the
# weights are 2-D, so a linear layer is an (add)mm; batched matmuls are attention's (the
# textbook engine's QKᵀ and PV)
LINEAR_OPS = ("aten::addmm", "aten::mm", "aten::_weight_int8pack_mm",
              "aten::_weight_int4pack_mm", "aten::_weight_int4pack_mm_for_cpu",
              "mkldnn::_linear_pointwise", "mkl::_mkl_linear", "quantized::linear_dynamic",
              "minifer_int8::gemv", "minifer_int8::gemm", "aten::_int_mm",
              "minifer_avx2::w8a8", "minifer_avx2::bf16", "minifer_avx2::f32")
ATTENTION_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu",
                 "aten::_scaled_dot_product_attention_math",
                 "aten::_scaled_dot_product_flash_attention", "aten::bmm", "aten::_softmax",
                 "aten::softmax", "minifer_paged::decode")
# the serving engine's K/V copies: reads of the paged pool by index, writes of the new tokens
KV_COPY_OPS = ("aten::index_select", "aten::index_copy_", "aten::index_copy", "aten::index",
               "aten::index_put_")


@dataclass(frozen=True)
class StepProfile:
    engine: str
    steps: int
    wall_s: float  # the profiled steps, wall clock (with the profiler's overhead)
    linear_s: float  # self CPU time of the matmul ops
    attention_s: float
    other_ops_s: float
    table: str  # the profiler's top-ops table
    kv_copy_s: float = 0.0  # of other_ops_s: the paged pool's K/V reads and writes (KV_COPY_OPS)

    @property
    def outside_ops_s(self) -> float:
        """Wall time in no torch op: Python, module calls, dispatch (and profiler overhead)."""
        return max(0.0, self.wall_s - self.linear_s - self.attention_s - self.other_ops_s)


def _engine(name: str, model: torch.nn.Module):
    from minifer.quantization import quantize

    from .baselines import HFDecoder, MinifierDecoder, TextbookEngine

    if name in ("minifer", "compiled"):
        return MinifierDecoder(model, compile=name == "compiled")
    if name == "textbook":
        return TextbookEngine(model)
    if name == "transformers":
        return HFDecoder(model)
    if name in ("int8", "int4"):
        return MinifierDecoder(quantize(model, name))
    if name == "serve":
        return ServeDecoder(model)
    if name == "serve-kernel":
        return ServeDecoder(model, kv_read="kernel")
    raise ValueError(f"engine must be one of {list(ENGINES)}, got {name!r}")


class ServeDecoder:
    """`LLMEngine` decode steps at a fixed batch: every row of `prompt` a request (prefilled by
    the engine itself; a random `past` is not used), then `decode(n)` runs `n` engine steps.
    `kv_read`: how attention reads the pool (`minifer.fast.paged.READS`)."""

    name = "serve"

    def __init__(self, model: torch.nn.Module, kv_read: str = "blocks") -> None:
        self.model, self.kv_read = model, kv_read

    def start(self, prompt: torch.Tensor, new_tokens: int, past=None) -> None:
        from minifer.engine.llm_engine import LLMEngine
        from minifer.fast import paged
        from minifer.sampling import SamplingParams

        B, T = prompt.shape
        room = self.model.config.context_length - T + 1
        params = SamplingParams(temperature=0, max_new_tokens=min(room, 3 * new_tokens + 4),
                                ignore_eos=True)
        # a step's budget holds every prompt: one prefill step, then decode steps at batch B
        with paged.read(self.kv_read):
            self.engine = LLMEngine(self.model, max_num_seqs=B, max_num_batched_tokens=max(
                B * T, self.model.config.context_length))
        for row in prompt.tolist():
            self.engine.add_request(row, params)
        self.engine.step()
        if len(self.engine.scheduler.running) != B:
            raise RuntimeError(f"the engine did not admit all {B} requests in one step")

    def decode(self, n: int) -> None:
        for _ in range(n):
            self.engine.step()


def profile_decode(engine: str, preset: str = "gpt2", dtype: str = "fp32", batch: int = 1, *,
                   prompt_tokens: int = 128, steps: int = 4, rows: int = 12,
                   model: torch.nn.Module | None = None) -> StepProfile:
    """Profile `steps` greedy decode steps of `engine` on `preset` (random weights) after a
    prompt of `prompt_tokens` whose K/V are random (`baselines.random_past`)."""
    from torch.profiler import ProfilerActivity, profile

    from .baselines import random_past

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    check_int("steps", steps, 1)
    if model is None:
        model = GPT.from_config(preset, seed=0, dtype=DTYPES[dtype])
    e = _engine(engine, model)
    prompt = random_ids(batch, prompt_tokens, model.config.vocab_size)
    e.start(prompt, steps, random_past(model, batch, prompt_tokens - 1))
    e.decode(steps)  # warm-up (and compilation)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        e.decode(steps)
        wall = time.perf_counter() - t0
    averages = prof.key_averages()
    linear = attention = other = kv_copy = 0.0
    for a in averages:
        s = a.self_cpu_time_total / 1e6
        if a.key in LINEAR_OPS:
            linear += s
        elif a.key in ATTENTION_OPS:
            attention += s
        else:  # every other op, inductor's compiled kernels included
            other += s
            if engine.startswith("serve") and a.key in KV_COPY_OPS:
                kv_copy += s
    table = averages.table(sort_by="self_cpu_time_total", row_limit=rows,
                           max_name_column_width=48)
    return StepProfile(engine, steps, wall, linear, attention, other, table, kv_copy)


def format_summary(p: StepProfile) -> str:
    per = 1e3 / p.steps
    parts = [("linear layers (matmul ops)", p.linear_s), ("attention", p.attention_s),
             ("other torch ops", p.other_ops_s),
             ("outside torch ops (Python, dispatch, profiler)", p.outside_ops_s)]
    lines = [f"{p.engine}: {p.wall_s * per:.2f} ms per step under the profiler ({p.steps} steps)"]
    if p.kv_copy_s:
        parts.insert(3, ("  of which K/V copies (paged pool reads, writes)", p.kv_copy_s))
    for name, s in parts:
        lines.append(f"  {name:<48}{s * per:9.2f} ms  {s / p.wall_s:6.1%}")
    return "\n".join(lines)
