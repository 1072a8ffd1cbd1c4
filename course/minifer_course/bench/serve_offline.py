"""The offline long-tailed load: a saturating benchmark of `LLMEngine` (``serve --offline``).

128 requests are all queued at t=0 (prompts of 16–64 random tokens; output lengths 80% in
8–32 and 20% in 128–192, greedy, EOS ignored, so every run does the same work) and served with
``max_num_seqs=16``. Nothing waits on arrivals, so the measure is the scheduler and the step:
static batching keeps each group until its longest request ends (its batch drains), continuous
batching refills every freed seat at once.

Reported per policy, as medians over ≥ 5 rounds that alternate the policies (and, with
`roots`, the engines): output tokens/s, the engine's wall time, and the time spent inside its
forward calls (timed by forward hooks on the model, so any engine version can be measured the
same way). ``wall / forward`` is the engine's overhead: scheduling, tensor building, sampling.

`compare_roots` runs one round per engine checkout in a subprocess (``PYTHONPATH=root``), with
the engines alternating round by round; this module is loaded by path into each, and uses only
`LLMEngine`'s public API, so it measures an older checkout as well.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["long_tail_workload", "OfflineRun", "serve_offline", "compare_policies_offline",
           "compare_roots", "format_offline", "engine_vs_generate"]

POLICIES = ("static", "continuous")


def long_tail_workload(n: int = 128, *, vocab_size: int, prompt_len: tuple[int, int] = (16, 64),
                       short: tuple[int, int] = (8, 32), long: tuple[int, int] = (128, 192),
                       long_fraction: float = 0.2, seed: int = 0) -> list[tuple[list[int], int]]:
    """`n` (prompt, max_new_tokens) pairs: random prompts, outputs `long_fraction` long."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(*prompt_len))]
        lo, hi = long if rng.random() < long_fraction else short
        out.append((prompt, rng.randint(lo, hi)))
    return out


@dataclass(frozen=True)
class OfflineRun:
    engine: str
    policy: str
    output_tokens: int
    wall_s: float
    forward_s: float
    forward_calls: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s


class _ForwardTimer:
    """Time spent in the model's forward calls, measured by hooks (CPU: calls are synchronous)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.total, self.calls, self._t0 = 0.0, 0, 0.0
        self._handles = [model.register_forward_pre_hook(self._pre),
                         model.register_forward_hook(self._post)]

    def _pre(self, *_):
        self._t0 = time.perf_counter()

    def _post(self, *_):
        self.total += time.perf_counter() - self._t0
        self.calls += 1

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def serve_offline(model: torch.nn.Module, work: Sequence[tuple[list[int], int]], policy: str,
                  *, max_num_seqs: int = 16, engine: str = "") -> OfflineRun:
    """Queue every request at once and step a fresh engine until all are done."""
    from minifer import LLMEngine, SamplingParams

    eng = LLMEngine(model, policy=policy, max_num_seqs=max_num_seqs)
    timer = _ForwardTimer(model)
    try:
        t0 = time.perf_counter()
        for prompt, n in work:
            eng.add_request(prompt, SamplingParams(temperature=0, max_new_tokens=n,
                                                   ignore_eos=True))
        tokens = 0
        while eng.has_unfinished():
            tokens += sum(len(o.token_ids) for o in eng.step() if o.finished)
        wall = time.perf_counter() - t0
    finally:
        timer.remove()
    return OfflineRun(engine, policy, tokens, wall, timer.total, timer.calls)


def _load(model_name: str):
    if model_name == "shakespeare":
        from minifer.pretrained import load_pretrained

        return load_pretrained("shakespeare")[0]
    from minifer import GPT

    return GPT.from_config(model_name, seed=0)


def compare_policies_offline(model_name: str = "shakespeare", *, rounds: int = 5,
                             requests: int = 128, max_num_seqs: int = 16, seed: int = 0,
                             engine: str = "", first: int = 0) -> list[OfflineRun]:
    """`rounds` rounds of static and continuous, alternating (A B, B A, ...) after a warm-up."""
    model = _load(model_name)
    work = long_tail_workload(requests, vocab_size=model.config.vocab_size, seed=seed)
    serve_offline(model, work[:8], "continuous", max_num_seqs=max_num_seqs)  # warm-up
    runs = []
    for r in range(rounds):
        order = POLICIES if (r + first) % 2 == 0 else POLICIES[::-1]
        for policy in order:
            runs.append(serve_offline(model, work, policy, max_num_seqs=max_num_seqs,
                                      engine=engine))
    return runs


def compare_roots(roots: dict[str, str], model_name: str = "shakespeare", *, rounds: int = 5,
                  requests: int = 128, max_num_seqs: int = 16, seed: int = 0,
                  threads: int | None = None,
                  on_run: Callable[[OfflineRun], None] | None = None) -> list[OfflineRun]:
    """One subprocess per engine checkout and round (``PYTHONPATH=root``), alternating the
    engines round by round and the policies inside each round; `on_run` sees each run as it
    ends (progress)."""
    runs: list[OfflineRun] = []
    labels = list(roots)
    for r in range(rounds):
        for label in (labels if r % 2 == 0 else labels[::-1]):
            root = os.path.join(os.path.abspath(roots[label]), "")
            code = (
                "import importlib.util, json, sys, torch\n"
                f"{'' if threads is None else f'torch.set_num_threads({threads})'}\n"
                "import minifer, minifer_course.bench\n"
                f"assert minifer.__file__.startswith({root!r}), minifer.__file__\n"
                "spec = importlib.util.spec_from_file_location('minifer_course.bench._offline', "
                f"{os.path.abspath(__file__)!r})\n"
                "m = importlib.util.module_from_spec(spec); sys.modules[spec.name] = m\n"
                "spec.loader.exec_module(m)\n"
                f"runs = m.compare_policies_offline({model_name!r}, rounds=1, requests={requests},"
                f" max_num_seqs={max_num_seqs}, seed={seed}, engine={label!r}, first={r})\n"
                "print(json.dumps([vars(x) for x in runs]))\n")
            # run from the checkout itself: ``python -c`` puts the working directory first on
            # sys.path, ahead of PYTHONPATH, so another checkout there would be imported instead
            env = dict(os.environ, PYTHONPATH=root)
            done = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, check=True,
                                  capture_output=True, text=True)
            for d in json.loads(done.stdout.strip().splitlines()[-1]):
                runs.append(OfflineRun(**d))
                if on_run is not None:
                    on_run(runs[-1])
    return runs


def format_offline(runs: Sequence[OfflineRun], header: str = "") -> str:
    """Medians per (engine, policy), and the continuous/static ratio per engine."""
    lines = [header] if header else []
    row = "{:<10} {:<11} {:>6} {:>10} {:>8} {:>10} {:>9} {:>8}"
    lines.append(row.format("engine", "policy", "rounds", "out tok/s", "wall", "forward",
                            "wall/fwd", "calls"))
    keys = list(dict.fromkeys((r.engine, r.policy) for r in runs))
    med: dict[tuple[str, str], float] = {}
    for key in keys:
        rs = [r for r in runs if (r.engine, r.policy) == key]
        tps = statistics.median(r.tokens_per_s for r in rs)
        med[key] = tps
        lines.append(row.format(key[0] or "-", key[1], len(rs), f"{tps:.0f}",
                                f"{statistics.median(r.wall_s for r in rs):.2f}s",
                                f"{statistics.median(r.forward_s for r in rs):.2f}s",
                                f"{statistics.median(r.wall_s / r.forward_s for r in rs):.2f}x",
                                int(statistics.median(r.forward_calls for r in rs))))
    lines.append("")
    for eng in dict.fromkeys(e for e, _ in keys):
        if (eng, "static") in med and (eng, "continuous") in med:
            lines.append(f"{eng or 'engine'}: continuous / static = "
                         f"{med[eng, 'continuous'] / med[eng, 'static']:.2f}x output tokens/s")
    engines = list(dict.fromkeys(e for e, _ in keys))
    if len(engines) == 2:
        a, b = engines
        for policy in POLICIES:
            if (a, policy) in med and (b, policy) in med:
                lines.append(f"{policy}: {b} / {a} = {med[b, policy] / med[a, policy]:.2f}x "
                             f"output tokens/s")
    return "\n".join(lines)


def engine_vs_generate(model: torch.nn.Module, *, batch: int = 16, prompt_len: int = 32,
                       new_tokens: int = 64, rounds: int = 5, seed: int = 0,
                       kv_reads: tuple[str, ...] = ("kernel",)) -> dict[str, list[float]]:
    """Seconds per run of `LLMEngine.generate` and of plain `minifer.generate` (one batch,
    left-padded) on `batch` equal-length prompts, greedy, `ignore_eos`: the engine's overhead
    over the simplest loop. One engine per pool read in `kv_reads` (`minifer.fast.paged.READS`;
    ``"engine"`` for the default alone, else ``"engine-<read>"``). Alternating rounds after one warm-up run of each;
    all must give the same tokens (checked)."""
    import minifer as mf
    from minifer.fast import paged

    rng = random.Random(seed)
    prompts = [[rng.randrange(model.config.vocab_size) for _ in range(prompt_len)]
               for _ in range(batch)]
    params = mf.SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)

    def engine(read: str):
        def run() -> list[list[int]]:
            with paged.read(read):
                eng = mf.LLMEngine(model, max_num_seqs=batch)
            return [o.token_ids for o in eng.generate(prompts, params)]
        return run

    def plain() -> list[list[int]]:
        return [r.token_ids for r in mf.generate(model, prompts, params)]

    runs = {("engine" if kv_reads == ("kernel",) else f"engine-{r}"): engine(r) for r in kv_reads}
    runs["generate"] = plain
    ref = plain()
    for name, run in runs.items():
        if run() != ref:
            raise AssertionError(f"{name} and minifer.generate disagree on greedy tokens")
    times: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(rounds):
        for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            t0 = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - t0)
    return times
