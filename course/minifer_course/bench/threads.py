"""Thread count and OpenMP wait policy, on an idle machine and beside a busy core:
``python -m minifer_course.bench threads``.

Each *trial* is a fresh Python process (the wait policy, ``OMP_WAIT_POLICY``, is read once when
torch's OpenMP runtime starts, so it cannot change inside one process). It builds the same
seeded model, sets its thread count (`minifer.fast.threads.apply_threads`: a number, or ``auto``:
the cores idle right now) and holds it fixed (``generate(..., threads=n)``), or, for
``threads="governed"``, starts at every core and lets `generate`'s default governor lower the
count between steps while other programs hold cores; then it warms up, and times greedy generations of 1 and of ``new_tokens``
tokens from the same prompts, three times each: the difference of the medians is decode alone.

A *round* runs every setting once, in turn, first on the quiet machine and then beside a
*background load*: processes that keep cores busy (a pure-Python spin loop each, ended with the
round and by their own deadline). Over the rounds each setting gets a median decode rate and
the *spread* of its rounds (max/min): what a busy machine does to the timings. The ratios are
against the machine's default (all cores, OpenMP's default wait) on the quiet machine, measured
in the same run.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, field

from minifer.checks import check_int

from .common import background_load  # noqa: F401  (re-exported: bench.threads.background_load)

__all__ = ["Setting", "default_settings", "background_load", "trial", "ThreadsRow", "run",
           "format_report"]


@dataclass(frozen=True)
class Setting:
    """One way to run: `threads` (a count, ``"auto"`` or ``"governed"``: `generate`'s default
    from every core) and the OpenMP wait policy (None:
    the runtime's default; ``"passive"``: waiting threads sleep; ``"active"``: they spin)."""

    threads: int | str
    wait: str | None = None

    @property
    def name(self) -> str:
        return f"threads={self.threads}" + (f", OMP_WAIT_POLICY={self.wait}" if self.wait else "")


def default_settings(cpus: int | None = None) -> list[Setting]:
    """1 thread, every core, ``auto`` and ``governed``, each with the default and the passive
    wait policy."""
    cpus = cpus or os.cpu_count() or 1
    counts: list[int | str] = sorted({1, cpus}) + ["auto", "governed"]
    return [Setting(n, wait) for n in counts for wait in (None, "passive")]


_TRIAL = """
import json, statistics, sys, time
import torch
from minifer_course.bench.common import random_ids
from minifer.generation import generate
from minifer.model import GPT
from minifer.sampling import SamplingParams
from minifer.fast.threads import apply_threads
a = json.loads(sys.argv[1])
governed = a["threads"] == "governed"
threads = apply_threads(None if governed else a["threads"])
torch.manual_seed(0)
model = GPT.from_config(a["preset"], seed=0).eval()
prompts = random_ids(a["batch"], a["prompt_tokens"], model.config.vocab_size).tolist()
def run(n):
    p = SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)
    t = time.perf_counter()
    generate(model, prompts, p, threads=None if governed else threads)
    return time.perf_counter() - t
run(4)
ones, alls = [], []
for _ in range(a["repeats"]):
    ones.append(run(1))
    alls.append(run(a["new_tokens"]))
print(json.dumps({"threads": threads, "t_one": statistics.median(ones),
                  "t_all": statistics.median(alls)}))
"""


def trial(setting: Setting, *, preset: str = "reference", batch: int = 1,
          prompt_tokens: int = 16, new_tokens: int = 64, repeats: int = 3) -> dict:
    """One fresh process run under `setting`: the thread count it used and decode tokens/s."""
    from .peers import decode_rate

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if setting.wait:
        env["OMP_WAIT_POLICY"] = setting.wait
    args = {"threads": setting.threads, "preset": preset, "batch": batch,
            "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "repeats": repeats}
    out = subprocess.run([sys.executable, "-c", _TRIAL, json.dumps(args)], env=env,
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"trial {setting.name} failed:\n{out.stderr[-2000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["tokens_per_s"] = decode_rate(batch, new_tokens, result["t_one"], result["t_all"])
    return result


@dataclass
class ThreadsRow:
    """One setting under one load: decode tokens/s of every round, and the threads it used."""

    setting: Setting
    busy_cores: int
    rates: list[float] = field(default_factory=list)
    threads_used: list[int] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.rates)

    @property
    def spread(self) -> float:
        """max / min of the rounds' rates (1.0: every round the same)."""
        return max(self.rates) / min(self.rates)


def run(settings: list[Setting] | None = None, *, rounds: int = 5, busy_cores: tuple[int, ...]
        = (0, 1), progress: bool = True, **trial_args) -> list[ThreadsRow]:
    """Every setting once per round, in turn, for each background load; `rounds` rounds."""
    check_int("rounds", rounds, 1)
    settings = settings or default_settings()
    rows = {(s, b): ThreadsRow(s, b) for b in busy_cores for s in settings}
    for r in range(rounds):
        for b in busy_cores:
            with background_load(b):
                for s in settings:
                    res = trial(s, **trial_args)
                    rows[s, b].rates.append(res["tokens_per_s"])
                    rows[s, b].threads_used.append(res["threads"])
                    if progress:
                        print(f"round {r + 1}/{rounds}, {b} busy core(s), {s.name}: "
                              f"{res['tokens_per_s']:.1f} tok/s ({res['threads']} threads)",
                              file=sys.stderr, flush=True)
    return list(rows.values())


def format_report(rows: list[ThreadsRow], cpus: int | None = None) -> str:
    """A table per background load: median tok/s, spread, threads used, ratio to the default
    setting (all cores, default wait) on the quiet machine."""
    cpus = cpus or os.cpu_count() or 1
    base = next((r.median for r in rows if r.busy_cores == 0 and r.setting.threads == cpus
                 and r.setting.wait is None), None)
    lines = []
    for b in sorted({r.busy_cores for r in rows}):
        lines += ["", f"background load: {b} busy core(s) of {cpus}",
                  f"{'setting':<38} {'tok/s':>8} {'spread':>7} {'threads':>8} {'÷ default idle':>15}"]
        for r in (r for r in rows if r.busy_cores == b):
            used = "/".join(str(t) for t in sorted(set(r.threads_used)))
            ratio = f"{r.median / base:.2f}" if base else "-"
            lines.append(f"{r.setting.name:<38} {r.median:>8.1f} {r.spread:>7.2f} {used:>8} "
                         f"{ratio:>15}")
    return "\n".join(lines[1:])
