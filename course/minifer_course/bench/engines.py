"""minifer against the textbook engine and `transformers`, and against the hardware's limits:
``python -m minifer_course.bench table [--json PATH]`` (`commands.table`).

For each model shape (random weights: timings do not depend on their values), precision and
batch size, every engine continues the same prompt by ``new_tokens`` greedy tokens per row from
the same cache (by default random K/V, `baselines.random_past`: a step's work does not depend
on the values it reads, and one prefill per engine of GPT-2 124M at batch 64 would take
minutes on a small CPU; ``prefill=True`` lets each engine prefill the prompt itself), timed round-robin (minifer, textbook, transformers, floor, minifer, …) so a
busy machine slows all of them alike. Reported per engine: ms per decode step and tokens/s; for
minifer also

* the **matmul floor**: the same model's linear layers alone, called one after another on a
  ``(batch, features)`` input — what any engine built on torch's kernels pays at least;
* **GB/s and MBU**: the bytes a step must read (every linear weight once, plus each row's cached
  K/V) per second, and that as a fraction of this machine's measured memory bandwidth
  (`probes.measure_bandwidth`). Weights that fit in the last-level cache can beat "100%".

Before timing, each engine's tokens are compared with minifer's: in fp32 they must be identical
(a mismatch is reported and the engine is not timed); in bf16 rounding differs between
implementations and only the agreement is reported.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from minifer.model import GPT

from .baselines import HFDecoder, MinifierDecoder, TextbookEngine, hf_available, random_past
from .common import loadavg, machine_info, random_ids
from .probes import measure_bandwidth
from .timing import round_robin

__all__ = ["EngineResult", "TableRow", "linear_floor", "measure_row", "run_table",
           "quick_new_tokens", "quick_repeats",
           "format_table", "machine_info", "loadavg"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class EngineResult:
    name: str
    step_s: float | None  # median seconds per decode step (None: not timed)
    agreement: float  # fraction of its greedy tokens equal to minifer's
    note: str = ""


@dataclass
class TableRow:
    preset: str
    dtype: str
    batch: int
    prompt_tokens: int
    new_tokens: int
    step_s: float  # minifer, median seconds per decode step
    floor_s: float  # the linear layers alone
    bytes_per_step: int
    bandwidth: float  # this machine's measured bytes/s
    baselines: list[EngineResult] = field(default_factory=list)
    rounds: int = 0  # round-robin rounds timed (after the checked warm-up run)

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.step_s

    @property
    def floor_ratio(self) -> float:
        return self.step_s / self.floor_s

    @property
    def gbps(self) -> float:
        return self.bytes_per_step / self.step_s / 1e9

    @property
    def mbu(self) -> float:
        return self.bytes_per_step / self.step_s / self.bandwidth

    def speedup(self, name: str) -> float | None:
        """minifer's tokens/s over baseline `name`'s (same run), or None if not timed."""
        for b in self.baselines:
            if b.name == name and b.step_s:
                return b.step_s / self.step_s
        return None


def linear_floor(model: torch.nn.Module, batch: int):
    """A function calling every linear layer of `model` once on a ``(batch, in_features)`` input,
    in model order: a decode step's matmuls with nothing around them."""
    p = next(model.parameters())
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    gen = torch.Generator().manual_seed(0)
    inputs = {n: torch.randn(batch, n, generator=gen).to(device=p.device, dtype=p.dtype)
              for n in {m.in_features for m in linears}}

    def run() -> None:
        with torch.inference_mode():
            for m in linears:
                m(inputs[m.in_features])

    return run


def step_bytes(model: torch.nn.Module, batch: int, context: float) -> int:
    """Bytes a decode step must read: every linear layer's weights and biases once (a tied
    output head counts once), plus each row's `context` cached tokens' K and V."""
    seen, total = set(), 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            for t in (m.weight, m.bias):
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    total += t.numel() * t.element_size()
    kv = model.config.kv_bytes_per_token(next(model.parameters()).element_size())
    return int(total + batch * context * kv)


def _agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a == b).float().mean().item()


def measure_row(model: torch.nn.Module, preset: str, dtype: str, batch: int, *,
                prompt_tokens: int = 128, new_tokens: int = 16, repeats: int = 3,
                bandwidth: float, compile: bool = False, baselines: bool = True,
                prefill: bool = False) -> TableRow:
    """One row of the table: minifer (and the baselines) decoding `new_tokens` after a prompt
    of `prompt_tokens` (its K/V random unless `prefill`)."""
    prompt = random_ids(batch, prompt_tokens, model.config.vocab_size)
    past = None if prefill else random_past(model, batch, prompt_tokens - 1)
    engines = [MinifierDecoder(model, compile=compile)]
    if baselines:
        engines.append(TextbookEngine(model))
        if hf_available():
            engines.append(HFDecoder(model))
    results, timed = [], []
    reference = None
    for e in engines:
        e.start(prompt, new_tokens, past)
        tokens = e.decode(new_tokens)  # also the warm-up run
        if reference is None:
            reference = tokens
            timed.append(e)
            continue
        agree = _agreement(tokens, reference)
        ok = agree == 1.0 or dtype != "fp32"
        results.append(EngineResult(e.name, None, agree, "" if ok else
                                    "fp32 tokens differ from minifer's: not timed"))
        if ok:
            timed.append(e)
    floor = linear_floor(model, batch)
    floor()  # warm-up (each engine was warmed by its checked run)
    fns = [(lambda e=e: e.decode(new_tokens)) for e in timed] + [floor]
    medians = round_robin(fns, warmup=0, repeats=repeats, device=next(model.parameters()).device)
    by_name = {e.name: t / new_tokens for e, t in zip(timed, medians)}
    for r in results:
        r.step_s = by_name.get(r.name)
    context = prompt_tokens + (new_tokens - 1) / 2  # mean cached tokens over the decode
    return TableRow(preset, dtype, batch, prompt_tokens, new_tokens, by_name[timed[0].name],
                    medians[-1], step_bytes(model, batch, context), bandwidth, results, repeats)


def quick_new_tokens(batch: int) -> int:
    """Decode steps per timed run in the quick table: 8 at batch <= 8, 3 above. A large batch's
    step is long (GPT-2 124M at batch 64: about half a second on a 2-core CPU), so a call's
    fixed cost (`transformers` sets up `generate` at every call) is under 1% of 3 steps."""
    return 8 if batch <= 8 else 3


def quick_repeats(batch: int) -> int:
    """Round-robin rounds in the quick table: 5 at batch <= 8 (short steps, and the batch-1
    ratio to the floor is the figure a noisy machine blurs most), 3 above."""
    return 5 if batch <= 8 else 3


def run_table(presets=("reference", "gpt2"), dtypes=("fp32", "bf16"), batches=(1, 8, 32, 64), *,
              prompt_tokens: int = 128, new_tokens: int | Callable[[int], int] = 16,
              repeats: int | Callable[[int], int] = 3,
              compile: bool = False, baselines: bool = True, prefill: bool = False,
              progress=None) -> dict:
    """The whole table plus the machine it ran on; a JSON-ready dict (`rows` hold `TableRow`s).

    `new_tokens` (decode steps per timed run) and `repeats` (round-robin rounds): a number, or
    a function of the batch size (`quick_new_tokens`, `quick_repeats`)."""
    bandwidth = measure_bandwidth()
    load_before = loadavg()
    t0 = time.perf_counter()
    rows = []
    for preset in presets:
        for dtype in dtypes:
            model = GPT.from_config(preset, seed=0, dtype=DTYPES[dtype])
            for b in batches:
                row = measure_row(model, preset, dtype, b, prompt_tokens=prompt_tokens,
                                  new_tokens=new_tokens if isinstance(new_tokens, int)
                                  else new_tokens(b),
                                  repeats=repeats if isinstance(repeats, int) else repeats(b),
                                  bandwidth=bandwidth,
                                  compile=compile, baselines=baselines, prefill=prefill)
                rows.append(row)
                if progress:
                    progress(format_row(row))
    return {"machine": machine_info(), "bandwidth_gbps": bandwidth / 1e9,
            "loadavg_before": load_before, "loadavg_after": loadavg(),
            "seconds": time.perf_counter() - t0, "compile": compile, "prefill": prefill,
            "rows": rows}


HEADER = (f"{'model':<10}{'dtype':<6}{'batch':>5}{'ms/step':>9}{'tok/s':>9}{'floor ms':>9}"
          f"{'x floor':>8}{'GB/s':>7}{'MBU':>6}  {'vs textbook':<17} vs transformers")


def format_row(r: TableRow) -> str:
    def vs(name: str) -> str:
        b = next((x for x in r.baselines if x.name == name), None)
        if b is None:
            return "-"
        if b.step_s is None:
            return "not timed"
        tag = "" if b.agreement == 1.0 else f" ({b.agreement:.0%} same)"
        return f"x{b.step_s / r.step_s:.2f}{tag}"

    return (f"{r.preset:<10}{r.dtype:<6}{r.batch:>5}{r.step_s * 1e3:>9.2f}{r.tokens_per_s:>9.0f}"
            f"{r.floor_s * 1e3:>9.2f}{r.floor_ratio:>8.2f}{r.gbps:>7.1f}{r.mbu:>6.0%}  "
            f"{vs('textbook'):<17} {vs('transformers')}")


def _per_batch(rows: list[TableRow], attr: str) -> str:
    """``"8"`` when every row has the same value, else e.g. ``"8 at batch 1, 3 at batch 64"``."""
    by_value: dict[int, list[int]] = {}
    for r in rows:
        by_value.setdefault(getattr(r, attr), []).append(r.batch)
    if len(by_value) == 1:
        return str(next(iter(by_value)))
    return ", ".join(f"{v} at batch {'/'.join(map(str, sorted(set(b))))}"
                     for v, b in by_value.items())


def format_table(result: dict) -> str:
    m = result["machine"]
    rows = result["rows"]
    lines = [f"decode: {m['cpu']}, {m['cpus']} CPUs, {m['threads']} torch thread(s), torch "
             f"{m['torch']}; memory bandwidth {result['bandwidth_gbps']:.1f} GB/s (measured); "
             f"load average {result['loadavg_before']} before, {result['loadavg_after']} after"]
    if rows:
        r = rows[0]
        kv = "its K/V computed" if result.get("prefill") else "random K/V"
        lines.append(f"greedy, {r.prompt_tokens}-token prompt in the cache ({kv}); new tokens "
                     f"per row and timed run: {_per_batch(rows, 'new_tokens')}; round-robin "
                     f"rounds: {_per_batch(rows, 'rounds')}; medians"
                     + ("; minifer's step compiled" if result.get("compile") else ""))
    lines.append(HEADER)
    lines += [format_row(r) for r in rows]
    lines.append("x floor: minifer's step / its linear layers alone; MBU: bytes a step must read "
                 "(weights + K/V) per second / measured bandwidth; vs X: minifer's tokens/s / X's.")
    if not hf_available():
        lines.append("transformers is not installed (pip install 'minifer[hf]'): not compared.")
    return "\n".join(lines)


def to_json(result: dict) -> dict:
    """`run_table`'s result with rows as plain dicts (and their derived figures)."""
    out = dict(result)
    out["rows"] = []
    for r in result["rows"]:
        d = asdict(r)
        d.update(tokens_per_s=r.tokens_per_s, floor_ratio=r.floor_ratio, gbps=r.gbps, mbu=r.mbu)
        out["rows"].append(d)
    return out
