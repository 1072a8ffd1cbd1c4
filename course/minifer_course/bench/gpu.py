"""The GPU benchmark: ``python -m minifer_course.bench gpu``.

What the course claims of a GPU, measured on one (``--device cuda``), in one run of a few minutes:

* **probes**: the device's copy bandwidth and bf16 matmul throughput, the roofline's two numbers
  (`minifer_course.bench.probes`), measured, not taken from a spec sheet;
* **decode**: one decode step of GPT-2 124M and of a ~1.1B model of the same family (random
  weights, bf16) for batch 1 … 256 at a fixed context: step time, tokens/s and MBU against the
  probed bandwidth, eager and as a CUDA graph (the fixed-shape step captured and replayed: measured
  late, since a failed capture can leave the device unusable), and for a few batch sizes compiled with ``torch.compile(mode="reduce-overhead")`` (inductor's
  kernels in a CUDA graph: what ``generate(..., compile=True)`` runs on a GPU);
* **prefill**: a long prompt batch, in TFLOP/s against the probed bf16 peak;
* **speculative decoding**: the shipped Shakespeare pair (trained: a real acceptance rate), and a
  random pair sized like the literature's (a ~1.1B target, a ~45M draft): its acceptance rate
  means nothing, so beside the measurement it reports the cost ratio c measured there and the
  speed-up that c gives at the acceptance rates the papers report;
* **serving**: `LLMEngine` (continuous batching) at saturation: every request queued at once.

Each section is written to ``gpu-bench.json`` (and a line to ``gpu-bench.log``) in the output
folder as soon as it is measured, so a run cut off at its time limit keeps what it measured; a
section that fails records its error and the run goes on. ``--budget-s`` bounds the run: the
compiled steps (the slowest part: each batch size compiles anew) come last and stop when it is
spent. With ``--quick`` (the default off CUDA) every size is tiny, so the suite runs the whole
benchmark on a CPU in seconds. Results of GPU runs live in the repository's ``benchmarks/``
(`minifer_course.bench.results` loads them).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from minifer.config import GPTConfig
from minifer.device import as_device, sync
from minifer.fast.compiled import compiled_decode
from minifer.fast.decode import LeanStep, lean_forward
from minifer.generation import decode_step
from minifer.model import GPT

from ..roofline import ModelSpec, kv_cache_bytes, mbu, prefill_time
from .decode import time_decode_step, time_prefill
from .probes import measure_bandwidth, measure_matmul_flops
from .timing import time_fn

__all__ = ["GPT2_1B", "DRAFT_45M", "Plan", "FULL", "QUICK", "Recorder", "device_info",
           "run", "format_report", "graph_step"]

# GPT-2's family (tied embeddings, 50,257-token vocabulary), 20 layers of width 2048:
# 1.07 billion parameters.
GPT2_1B = GPTConfig(vocab_size=50257, context_length=1024, n_layer=20, n_head=16, n_embd=2048,
                    tie_embeddings=True, eos_token_id=50256)
# Its draft, ~24x smaller (44.6M): the papers' pairs are 14-143x apart (T5-XXL with T5-large
# or T5-small; Chinchilla 70B with a 4B draft).
DRAFT_45M = GPTConfig(vocab_size=50257, context_length=1024, n_layer=6, n_head=8, n_embd=512,
                      tie_embeddings=True, eos_token_id=50256)


@dataclass(frozen=True)
class Plan:
    """The sizes of one run. `FULL` is the GPU run (~4 minutes on an H100); `QUICK` runs on a
    CPU in seconds (the suite's test)."""

    models: dict = field(default_factory=lambda: {"gpt2-124m": "gpt2", "gpt2-1b": GPT2_1B})
    dtype: str = "bfloat16"
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    context: int = 512  # cached tokens per sequence at the timed decode step
    graphs: bool = True  # capture the fixed-shape step as a CUDA graph (CUDA only)
    compile_batches: tuple[int, ...] = (1, 64, 256)  # torch.compile "reduce-overhead"
    repeats: int = 10
    bandwidth_bytes: int = 2**30
    matmul_n: int = 8192
    prefill_tokens: int = 1024
    prefill_batch: int = 8
    spec_new_tokens: int = 64
    spec_repeats: int = 3
    spec_pair: tuple = (GPT2_1B, DRAFT_45M)
    spec_alphas: tuple[float, ...] = (0.6, 0.8)
    serve_requests: int = 256
    serve_max_seqs: tuple[int, ...] = (64, 256)
    serve_lengths: tuple = ((16, 64), (8, 32), (128, 192))  # prompt, short and long answers


FULL = Plan()
QUICK = Plan(models={"tiny": "tiny", "tiny-gqa": "tiny-gqa"}, dtype="float32", batches=(1, 4),
             context=16, graphs=False, compile_batches=(), repeats=2, bandwidth_bytes=2**23,
             matmul_n=128, prefill_tokens=32, prefill_batch=2, spec_new_tokens=8,
             spec_repeats=1, spec_pair=("tiny", "tiny-gqa"), serve_requests=8,
             serve_max_seqs=(4,), serve_lengths=((4, 16), (2, 8), (16, 32)))


class Recorder:
    """The run's results as they come: a JSON file rewritten after every section, a log file
    appended line by line (both in `out_dir`; None: printed only)."""

    def __init__(self, out_dir: str | Path | None, quiet: bool = False) -> None:
        self.result: dict = {}
        self.quiet = quiet
        self.dir = Path(out_dir) if out_dir is not None else None
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.json_path, self.log_path = self.dir / "gpu-bench.json", self.dir / "gpu-bench.log"

    def log(self, line: str) -> None:
        if not self.quiet:
            print(line, flush=True)
        if self.dir is not None:
            with open(self.log_path, "a") as f:
                f.write(line + "\n")

    def put(self, key: str, value) -> None:
        self.result[key] = value
        if self.dir is not None:
            tmp = self.json_path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(self.result, indent=1, default=_plain) + "\n")
            os.replace(tmp, self.json_path)  # a reader never sees half a file

    def section(self, key: str, fn: Callable[[], object]) -> object:
        """Run one section; its value (or its error) goes into the results at once."""
        t0 = time.perf_counter()
        self.log(f"== {key}")
        try:
            value = fn()
        except Exception as exc:  # a failing section is a result too; the run goes on
            value = {"error": f"{type(exc).__name__}: {exc}",
                     "traceback": traceback.format_exc(limit=6)}
            self.log(f"   failed: {value['error']}")
        self.put(key, value)
        self.log(f"   ({time.perf_counter() - t0:.1f} s)")
        return value


def _plain(obj):
    if isinstance(obj, GPTConfig):
        return asdict(obj)
    if isinstance(obj, (torch.dtype, torch.device)):
        return str(obj)
    return repr(obj)


def device_info(device: torch.device) -> dict:
    """What the numbers depend on: the GPU (or CPU), driver, torch, CUDA, date."""
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": str(device), "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "host_cpus": os.cpu_count()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, memory_gib=round(props.total_memory / 2**30, 1),
                    multiprocessors=props.multi_processor_count,
                    capability=f"{props.major}.{props.minor}", driver=_driver_version())
    else:
        from .common import machine_info

        info.update(cpu=machine_info()["cpu"], threads=torch.get_num_threads())
    return info


def _driver_version() -> str | None:
    try:
        import pynvml  # nvidia-ml-py, where installed

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else version
    except Exception:
        try:
            with open("/proc/driver/nvidia/version") as f:
                return f.readline().strip()
        except OSError:
            return None


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def random_model(cfg: GPTConfig | str, device: torch.device, dtype: torch.dtype,
                 seed: int = 0) -> GPT:
    """A model with random weights built on `device` itself (a billion parameters initialised
    on a CPU first would take longer than the benchmark): timings do not depend on the values."""
    cfg = GPTConfig.preset(cfg) if isinstance(cfg, str) else cfg
    torch.manual_seed(seed)
    with torch.device(device):
        model = GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    return model.to(dtype).eval()


def _model_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def graph_step(model: torch.nn.Module, tokens: torch.Tensor, cache) -> Callable[[], None]:
    """The fixed-shape lean decode step (`minifer.fast.decode`) captured once as a CUDA graph;
    returns a function that replays it at the cache's position and rolls the token back (what
    `time_decode_step` does eagerly). The step attends over every cache slot through a mask,
    so its shapes never change."""
    step = LeanStep(fixed_shape=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.inference_mode():  # warm-up off the default stream
        for _ in range(2):
            decode_step(model, tokens, cache, step=step)
            cache.rollback(1)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    writer = step.writer  # the graph reads the write slot from its tensor
    writer.slot.fill_(cache.pos)
    with torch.inference_mode(), torch.cuda.graph(graph):
        lean_forward(model, tokens.view(-1, 1), writer)

    def replay() -> None:
        writer.slot.fill_(cache.pos)
        graph.replay()

    return replay


def _time_graph(model, batch: int, context: int, repeats: int) -> float:
    from minifer.cache import StaticKVCache

    cache = StaticKVCache.for_model(model, batch, context + 1)
    cache.advance(context)  # a step's time does not depend on the values the cache holds
    tokens = torch.zeros(batch, dtype=torch.long, device=cache.device)
    replay = graph_step(model, tokens, cache)
    return time_fn(replay, warmup=3, repeats=repeats, device=cache.device).median_s


def _decode_rows(name: str, model: GPT, plan: Plan, bandwidth: float, rec: Recorder,
                 graphs: bool = False) -> list[dict]:
    """One decode step per batch size, eager (or, with `graphs`, captured as a CUDA graph and
    replayed): ms, tokens/s and MBU. A failed capture ends the graph rows (it can leave the
    device's stream unusable), so graphs are measured after everything else but the compiled
    steps."""
    spec = ModelSpec.from_config(model.config, name=name)
    kv_precision = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}[
        next(model.parameters()).dtype]
    wbytes = _model_bytes(model)
    how = "graph" if graphs else "eager"
    rows = []
    for b in plan.batches:
        kvb = kv_cache_bytes(spec, plan.context, b, kv_precision)
        row = {"model": name, "batch": b, "context": plan.context, "weight_bytes": wbytes,
               "kv_bytes": kvb}
        try:
            step = (_time_graph(model, b, plan.context, plan.repeats) if graphs else
                    time_decode_step(model, b, plan.context, warmup=3,
                                     repeats=plan.repeats).median_s)
            row.update({f"{how}_ms": step * 1e3, f"{how}_tok_s": b / step,
                        f"{how}_mbu": mbu(wbytes, kvb, step, bandwidth)})
        except Exception as exc:  # e.g. out of memory at the largest batch: keep the others
            row["error"] = f"{type(exc).__name__}: {exc}"[:500]
        finally:
            _free(next(model.parameters()).device)
        rows.append(row)
        rec.log("   " + _decode_line(row, how))
        if graphs and "error" in row:
            break
    return rows


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _compiled_rows(models: dict, plan: Plan, bandwidth: float, deadline: float,
                   rec: Recorder) -> list[dict]:
    """Decode steps compiled with "reduce-overhead", batch by batch, while time is left."""
    rows = []
    for b in plan.compile_batches:
        for name, model in models.items():
            if time.monotonic() > deadline:
                rows.append({"model": name, "batch": b, "skipped": "time budget spent"})
                continue
            spec = ModelSpec.from_config(model.config, name=name)
            kvb = kv_cache_bytes(spec, plan.context, b, 2)
            row = {"model": name, "batch": b, "context": plan.context}
            try:
                t0 = time.perf_counter()
                step = compiled_decode(model, "reduce-overhead")
                time_decode_step(model, b, plan.context, warmup=1, repeats=1, step=step)
                row["compile_s"] = time.perf_counter() - t0
                s = time_decode_step(model, b, plan.context, warmup=3, repeats=plan.repeats,
                                     step=step).median_s
                row.update(compiled_ms=s * 1e3, compiled_tok_s=b / s,
                           compiled_mbu=mbu(_model_bytes(model), kvb, s, bandwidth))
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:500]
            rows.append(row)
            rec.log(f"   {name:10} batch {b:>4}: " + (
                f"{row['compiled_ms']:8.3f} ms/step compiled (compiling took "
                f"{row['compile_s']:.0f} s)" if "compiled_ms" in row else row.get("error", "")))
    return rows


def _decode_line(row: dict, how: str = "eager") -> str:
    if f"{how}_ms" not in row:
        return f"{row['model']:10} batch {row['batch']:>4}: {row.get('error', '')}"
    return (f"{row['model']:10} batch {row['batch']:>4}: {how} {row[f'{how}_ms']:8.3f} ms/step "
            f"{row[f'{how}_tok_s']:10,.0f} tok/s MBU {row[f'{how}_mbu']:5.1%}")


def _prefill(name: str, model: GPT, plan: Plan, peak_flops: float) -> dict:
    tokens = min(plan.prefill_tokens, model.config.context_length)
    s = time_prefill(model, tokens, plan.prefill_batch, warmup=2, repeats=plan.repeats).median_s
    spec = ModelSpec.from_config(model.config, name=name)
    flops = prefill_time(spec, "illustrative", tokens, plan.prefill_batch,  # FLOPs only
                         include_attention=True).flops
    return {"model": name, "tokens": tokens, "batch": plan.prefill_batch, "ms": s * 1e3,
            "tokens_per_s": tokens * plan.prefill_batch / s, "tflops": flops / s / 1e12,
            "share_of_probed_peak": flops / s / peak_flops}


def _spec_point(p, alphas: tuple[float, ...]) -> dict:
    from minifer.speculative import expected_speedup

    out = {"drafter": p.drafter, "k": p.k, "tokens": p.tokens, "alpha": p.alpha,
           "target_passes": p.stats.target_passes, "plain_tok_s": p.plain_tok_s,
           "spec_tok_s": p.spec_tok_s, "speedup": p.speedup, "cost_ratio_c": p.cost_ratio,
           "expected_speedup": p.expected_speedup}
    if p.cost_ratio > 0:
        out["projected_speedup_at_alpha"] = {str(a): expected_speedup(a, p.k, p.cost_ratio)
                                             for a in alphas}
    return out


def _spec(device: torch.device, plan: Plan, dtype: torch.dtype) -> dict:
    from minifer.pretrained import load_pretrained
    from minifer.speculative import ModelDrafter, PromptLookupDrafter

    from .spec import PROMPT, measure

    target, tok = load_pretrained("shakespeare", device=device)
    draft, _ = load_pretrained("shakespeare-draft", device=device)
    ids = tok.encode(PROMPT)
    shipped = measure(target, [ModelDrafter(draft), PromptLookupDrafter()], ids, k=4,
                      new_tokens=plan.spec_new_tokens, repeats=plan.spec_repeats)
    big_cfg, small_cfg = plan.spec_pair
    big, small = random_model(big_cfg, device, dtype), random_model(small_cfg, device, dtype, 1)
    vocab = big.config.vocab_size  # a random pair: any ids will do
    sized = measure(big, [ModelDrafter(small)], [i % vocab for i in ids], k=4,
                    new_tokens=plan.spec_new_tokens,
                    repeats=plan.spec_repeats)
    return {"shipped": {"target_params": target.num_params(), "draft_params": draft.num_params(),
                        "dtype": "float32", "points": [_spec_point(p, ()) for p in shipped]},
            "sized": {"target_params": big.num_params(), "draft_params": small.num_params(),
                      "dtype": plan.dtype, "note": "random weights: alpha means nothing; the "
                      "projection uses the measured c and the papers' acceptance rates",
                      "points": [_spec_point(p, plan.spec_alphas) for p in sized]}}


def _serve(name: str, model: GPT, plan: Plan) -> list[dict]:
    from .serve_offline import long_tail_workload, serve_offline

    prompt_len, short, long = plan.serve_lengths
    work = long_tail_workload(plan.serve_requests, vocab_size=model.config.vocab_size,
                              prompt_len=prompt_len, short=short, long=long)
    serve_offline(model, work[:max(2, len(work) // 16)], "continuous",
                  max_num_seqs=plan.serve_max_seqs[0])  # warm-up
    rows = []
    for seqs in plan.serve_max_seqs:
        r = serve_offline(model, work, "continuous", max_num_seqs=seqs)
        rows.append({"model": name, "requests": len(work), "max_num_seqs": seqs,
                     "output_tokens": r.output_tokens, "wall_s": r.wall_s,
                     "output_tok_s": r.tokens_per_s, "forward_share": r.forward_s / r.wall_s})
    return rows


def run(device: str = "cuda", *, plan: Plan | None = None, out_dir: str | Path | None = None,
        budget_s: float = 300.0, quiet: bool = False) -> dict:
    """The whole benchmark on `device` (default plan: `FULL` on CUDA, `QUICK` elsewhere);
    returns the results, also written to `out_dir` section by section."""
    dev = as_device(device)
    plan = plan or (FULL if dev.type == "cuda" else QUICK)
    deadline = time.monotonic() + budget_s
    rec = Recorder(out_dir, quiet=quiet)
    dtype = _dtype(plan.dtype)
    rec.put("machine", device_info(dev))
    rec.put("plan", {k: v for k, v in asdict(replace(plan, models={}, spec_pair=())).items()}
            | {"models": {k: (v if isinstance(v, str) else asdict(v))
                          for k, v in plan.models.items()}, "budget_s": budget_s})
    rec.log(f"GPU benchmark on {rec.result['machine'].get('gpu', dev)}")
    probes = rec.section("probes", lambda: {
        "bandwidth_GBps": measure_bandwidth(dev, plan.bandwidth_bytes) / 1e9,
        "matmul_tflops": measure_matmul_flops(dev, plan.matmul_n, dtype) / 1e12,
        "matmul_dtype": plan.dtype, "matmul_n": plan.matmul_n})
    if "error" in probes:
        return rec.result
    rec.log(f"   copy {probes['bandwidth_GBps']:,.0f} GB/s, {plan.dtype} matmul "
            f"{probes['matmul_tflops']:,.1f} TFLOP/s")
    bandwidth, peak = probes["bandwidth_GBps"] * 1e9, probes["matmul_tflops"] * 1e12
    models = {}
    for name, cfg in plan.models.items():
        models[name] = random_model(cfg, dev, dtype)
        rec.log(f"   {name}: {models[name].num_params():,} parameters, {plan.dtype}")
    rec.section("decode", lambda: [row for name, m in models.items()
                                   for row in _decode_rows(name, m, plan, bandwidth, rec)])
    rec.section("prefill", lambda: [_prefill(n, m, plan, peak) for n, m in models.items()])
    first = next(iter(models))
    rec.section("serve", lambda: _serve(first, models[first], plan))
    rec.section("speculative", lambda: _spec(dev, plan, dtype))
    if plan.graphs and dev.type == "cuda":
        rec.section("decode_graph", lambda: [
            row for name, m in models.items()
            for row in _decode_rows(name, m, plan, bandwidth, rec, graphs=True)])
    if plan.compile_batches and dev.type == "cuda":
        rec.section("decode_compiled", lambda: _compiled_rows(models, plan, bandwidth,
                                                              deadline, rec))
    sync(dev)
    rec.put("elapsed_s", budget_s - (deadline - time.monotonic()))
    return rec.result


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None or (isinstance(value, float) and math.isnan(value)) \
        else format(value, spec)


def _rows(r: dict, key: str) -> list[dict]:
    value = r.get(key)
    return [x for x in value if isinstance(x, dict)] if isinstance(value, list) else []


def format_report(r: dict) -> str:
    """The results as a table (what `python -m minifer_course.bench gpu` prints at the end)."""
    m = r.get("machine", {})
    lines = [f"GPU benchmark: {m.get('gpu') or m.get('cpu', '?')} ({m.get('device')}), "
             f"torch {m.get('torch')}, CUDA {m.get('cuda')}, driver {m.get('driver', '-')}, "
             f"{m.get('date')}"]
    p = r.get("probes", {})
    if "bandwidth_GBps" in p:
        lines.append(f"probed: copy bandwidth {p['bandwidth_GBps']:,.0f} GB/s; {p['matmul_dtype']} "
                     f"matmul {p['matmul_tflops']:,.1f} TFLOP/s (n={p['matmul_n']})")
    compiled = {(c["model"], c["batch"]): c for c in _rows(r, "decode_compiled")}
    graph = {(c["model"], c["batch"]): c for c in _rows(r, "decode_graph")}
    decode = r.get("decode", [])
    if isinstance(decode, list) and decode:
        lines.append(f"decode step at context {decode[0]['context']} (ms/step, total tok/s, MBU):")
        lines.append(f"  {'model':10} {'batch':>5}  {'eager ms':>9} {'tok/s':>10} {'MBU':>6}  "
                     f"{'graph ms':>9} {'tok/s':>10} {'MBU':>6}  {'compiled ms':>11} {'MBU':>6}")
        for row in decode:
            c = compiled.get((row["model"], row["batch"]), {})
            row = graph.get((row["model"], row["batch"]), {}) | row
            lines.append(
                f"  {row['model']:10} {row['batch']:>5}  {_fmt(row.get('eager_ms'), '9.3f'):>9} "
                f"{_fmt(row.get('eager_tok_s'), '10,.0f'):>10} {_fmt(row.get('eager_mbu'), '6.1%'):>6}  "
                f"{_fmt(row.get('graph_ms'), '9.3f'):>9} {_fmt(row.get('graph_tok_s'), '10,.0f'):>10} "
                f"{_fmt(row.get('graph_mbu'), '6.1%'):>6}  {_fmt(c.get('compiled_ms'), '11.3f'):>11} "
                f"{_fmt(c.get('compiled_mbu'), '6.1%'):>6}" + (f"  {row['error'][:60]}"
                                                                 if "error" in row else ""))
    for row in r.get("prefill", []) if isinstance(r.get("prefill"), list) else []:
        lines.append(f"prefill {row['model']:10} {row['batch']} x {row['tokens']} tokens: "
                     f"{row['ms']:.2f} ms, {row['tokens_per_s']:,.0f} tok/s, "
                     f"{row['tflops']:.1f} TFLOP/s = {row['share_of_probed_peak']:.0%} of the "
                     f"probed peak")
    spec = r.get("speculative", {})
    for key in ("shipped", "sized"):
        part = spec.get(key) if isinstance(spec, dict) else None
        if not part:
            continue
        lines.append(f"speculative, {key} pair (target {part['target_params']:,}, draft "
                     f"{part['draft_params']:,}, {part['dtype']}), k=4, greedy:")
        for q in part["points"]:
            proj = q.get("projected_speedup_at_alpha")
            lines.append(f"  {q['drafter'][:36]:36} alpha {q['alpha']:.2f} c {q['cost_ratio_c']:.3f}"
                         f"  plain {q['plain_tok_s']:8.1f} tok/s  spec {q['spec_tok_s']:8.1f}  "
                         f"x{q['speedup']:.2f}" + (
                             "  projected " + ", ".join(f"x{v:.2f} at alpha {a}"
                                                        for a, v in proj.items()) if proj else ""))
    for row in r.get("serve", []) if isinstance(r.get("serve"), list) else []:
        lines.append(f"serving {row['model']}: {row['requests']} requests at once, max_num_seqs "
                     f"{row['max_num_seqs']}: {row['output_tok_s']:,.0f} output tok/s "
                     f"({row['forward_share']:.0%} of the time in forward calls)")
    for key, value in r.items():
        if isinstance(value, dict) and "error" in value:
            lines.append(f"{key}: FAILED {value['error']}")
    return "\n".join(lines)
