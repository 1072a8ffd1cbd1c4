"""Lesson 12's disaggregated prefill and decode (claim PD-12): the runs, a table, a figure.

The measuring is `minifer_course.bench.disagg`'s (the ``python -m minifer_course.bench disagg`` command runs
the same load at a larger scale); this module sizes it for a notebook — a few seconds on two
CPU cores, one process start-up — and turns the results into rows and a figure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import plotly.graph_objects as go

from minifer.distributed.disagg import DisaggOutput, DisaggregatedEngine
from minifer.sampling import SamplingParams

from .. import roofline as rl
from ..bench.disagg import (
    Load,
    ModeResult,
    attach_timeline,
    decode_step_s,
    drive_disaggregated,
    mixed_load,
    run_mode,
)
from .common import reference_line, style

__all__ = ["Measured", "lesson_load", "measure", "rows", "gaps_figure", "transfer_rows",
           "LINKS"]

LINKS = ("nvlink-h100", "pcie-5", "ethernet-400g", "ethernet-100g")


def lesson_load(model, *, seed: int = 0) -> Load:
    """Three short chats streaming 128 tokens each; two 224-token prompts, the first after a
    quarter of the chats' stream and the second after half of it.

    The arrival times are counted in this machine's decode steps (`decode_step_s`), not in
    seconds: fixed times that suit a laptop's 20 ms steps come after the chats have ended on
    a machine ten times faster, and then no mode has a stall to show."""
    load = mixed_load(model.config.vocab_size, chats=3, chat_prompt=16, chat_tokens=128,
                      long_prompts=2, long_prompt=224, long_tokens=4, first_long_s=0,
                      period_s=0, seed=seed)
    quarter = load.chat_tokens // 4 * decode_step_s(model, load.chats)
    return replace(load, first_long_s=quarter, period_s=quarter)


@dataclass
class Measured:
    """Everything the lesson's section measured: the greedy texts through the two processes,
    and `runs` runs of each mode on the same load."""

    texts: list[DisaggOutput]
    runs: dict[str, list[ModeResult]]
    bytes_per_token: int
    pids: list[int]

    def best(self, mode: str, stat: str = "max") -> float:
        """The smallest of the runs' decode-stream ITL statistic (s): noise only adds."""
        return min(r.itl(stat) for r in self.runs[mode])


def measure(model, tokenizer, prompts: Sequence[str], params: SamplingParams, load: Load, *,
            runs: int = 2, prefill_nice: int = 5) -> Measured:
    """Start the two workers once: generate `prompts` through them (which also warms them up),
    then serve `load` `runs` times; then the same load `runs` times colocated (one engine,
    whole prefills) and once chunked, in this process with one thread, as each worker has."""
    with DisaggregatedEngine(model, tokenizer, prefill_tokens=256,
                             prefill_nice=prefill_nice) as eng:
        texts = eng.generate(list(prompts), params)
        dis = [drive_disaggregated(eng, load, tag=f"#{i}") for i in range(runs)]
    for r in dis:
        attach_timeline(r, eng.report)
    out = {"colocated": [run_mode("colocated", model, load) for _ in range(runs)],
           "chunked": [run_mode("chunked", model, load)], "disaggregated": dis}
    return Measured(texts, out, eng.bytes_per_token, eng.report.pids)


def rows(m: Measured) -> list[dict]:
    """One row per run: the decode stream's gaps (ms), TTFTs (ms) and the K/V bytes moved."""
    out = []
    for mode, results in m.runs.items():
        for i, r in enumerate(results):
            out.append({"mode": mode, "run": i + 1, "ITL p50 ms": r.itl("p50") * 1e3,
                        "ITL p99 ms": r.itl("p99") * 1e3, "max gap ms": r.itl("max") * 1e3,
                        "chat TTFT ms": r.ttft("chat") * 1e3,
                        "long TTFT ms": r.ttft("long") * 1e3, "K/V moved": f"{r.kv_bytes:,}"})
    return out


def gaps_figure(m: Measured) -> go.Figure:
    """The chats' inter-token gaps over time in each mode's first run, long arrivals marked."""
    fig = go.Figure()
    load = None
    for mode, results in m.runs.items():
        r = results[0]
        load = r.load
        pts = []
        for rid, met in r.metrics.items():
            if rid.startswith("chat"):
                t = met.token_times[1:]
                pts += [(b - r.start, (b - a) * 1e3) for a, b in zip(t, t[1:])]
        pts.sort()
        fig.add_trace(go.Scatter(x=[round(x, 4) for x, _ in pts], y=[round(y, 2) for _, y in pts],
                                 mode="markers", name=mode))
    for i in range(len(load.long)):
        reference_line(fig, x=load.first_long_s + i * load.period_s,
                       text="long prompt arrives" if i == 0 else "")
    return style(fig, "The chats' decode stream while long prompts arrive",
                 "seconds since the load started", "gap before this token (ms)",
                 width=760, height=380)


def transfer_rows(model: str = "llama-3-8b", prompt_tokens: int = 4096,
                  hardware: str = "h100", links: Sequence[str] = LINKS) -> list[dict]:
    """One prompt's K/V over each link, beside the roofline time of its prefill (16-bit)."""
    prefill_ms = rl.prefill_time(model, hardware, prompt_tokens).ttft_ms
    out = []
    for link in links:
        t = rl.kv_transfer(model, prompt_tokens, link)
        out.append({"link": t.interconnect, "K/V MiB": t.nbytes / 2**20, "transfer ms": t.ms,
                    "share of its prefill": t.ms / prefill_ms})
    return out
