"""Colocated vs chunked vs disaggregated prefill under a mixed load: ``python -m minifer_course.bench disagg``.

The load (claim PD-12): a few **short chats** that start together and stream many tokens — the
decode stream — while **long prompts** arrive periodically, each asking for a few tokens. Three
ways to serve it, on the same model with the same torch threads per process:

- **colocated**: one `LLMEngine`, a long prompt prefilled whole in one step; the chats' next
  tokens wait for that step (the stall PD-12 names);
- **chunked**: one `LLMEngine` with chunked prefill: the prompt is split into `chunk`-token
  pieces, each step carries one piece beside the chats' decode rows (smaller stalls, later
  first token for the long prompt);
- **disaggregated**: `DisaggregatedEngine`: prompts on a prefill process, decode on another;
  the K/V travel between them (``bytes_per_token × prompt tokens`` each).

Reported per mode: the decode stream's inter-token latency while long prompts arrive (p50,
p99, max gap: the longest pause any chat saw, counting the gaps that end after the first long
prompt arrived, when every chat is streaming), TTFT of the chats and of the long prompts, and
the K/V bytes moved. Disaggregation
uses two processes, so on a machine with one free core per process it also has twice the
compute; on a loaded 2-core machine the two share it. What it shows is the mechanism: decode
steps no longer contain prefills. `minifer_course.roofline.kv_transfer` gives the transfer's cost on
real links.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from minifer.checks import check_int, check_number
from minifer.engine.llm_engine import LLMEngine
from minifer.engine.metrics import RequestMetrics
from minifer.sampling import SamplingParams
from minifer_course.summary import percentile

__all__ = ["MODES", "Load", "ModeResult", "mixed_load", "decode_step_s", "run_mode",
           "drive_disaggregated", "attach_timeline", "compare", "format_report"]

MODES = ("colocated", "chunked", "disaggregated")


@dataclass(frozen=True)
class Load:
    """A mixed load: `chats` short chats at t=0, then `long_prompts` long ones, one every
    `period_s` from `first_long_s` on. Prompts are random token ids (timings do not depend on
    the tokens); every request ignores EOS, so each mode does the same work."""

    chats: list[list[int]]
    chat_tokens: int
    long: list[list[int]]
    long_tokens: int
    first_long_s: float
    period_s: float

    def requests(self) -> list[tuple[str, list[int], int, float]]:
        """``(request_id, prompt, max_new_tokens, arrival_s)`` in arrival order."""
        out = [(f"chat-{i}", p, self.chat_tokens, 0.0) for i, p in enumerate(self.chats)]
        out += [(f"long-{i}", p, self.long_tokens, self.first_long_s + i * self.period_s)
                for i, p in enumerate(self.long)]
        return out


def mixed_load(vocab_size: int, *, chats: int = 4, chat_prompt: int = 16, chat_tokens: int = 64,
               long_prompts: int = 3, long_prompt: int = 224, long_tokens: int = 4,
               first_long_s: float = 0.4, period_s: float = 0.3, seed: int = 0) -> Load:
    """A seeded `Load` (see there); lengths in tokens, times in seconds."""
    for name, v in (("chats", chats), ("chat_prompt", chat_prompt), ("chat_tokens", chat_tokens),
                    ("long_prompts", long_prompts), ("long_prompt", long_prompt),
                    ("long_tokens", long_tokens)):
        check_int(name, v, 1)
    check_number("first_long_s", first_long_s, ge=0)
    check_number("period_s", period_s, ge=0)
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(n)]

    return Load([ids(chat_prompt) for _ in range(chats)], chat_tokens,
                [ids(long_prompt) for _ in range(long_prompts)], long_tokens,
                first_long_s, period_s)


@dataclass
class ModeResult:
    """One mode's run: every request's metrics, and what moved between processes."""

    mode: str
    load: Load = field(repr=False)
    start: float  # the run's t=0 (time.perf_counter(), one clock for every process)
    metrics: dict[str, RequestMetrics]
    token_ids: dict[str, list[int]]
    kv_bytes: int = 0  # K/V bytes sent prefill → decode (disaggregated only)
    transfer_s: float = 0.0  # seconds inside the decode worker's recv of them
    bytes_per_token: int = 0
    prompt_tokens: int = 0  # prompt tokens of the requests whose K/V moved
    decode_prompt_tokens: int = 0  # prompt tokens fed in steps that also carried chat tokens
    timeline: dict[str, list[dict]] = field(default_factory=dict, repr=False)

    def chat_gaps(self) -> list[float]:
        """The decode stream under long prompts: every gap between two successive tokens that
        decode steps made (from a chat's second token on) ending after the first long prompt
        arrived (seconds). The gap after the first token is the handoff (`first_gap`)."""
        since = self.start + self.load.first_long_s
        gaps = []
        for rid, m in self.metrics.items():
            if rid.startswith("chat"):
                t = m.token_times[1:]
                gaps += [b - a for a, b in zip(t, t[1:]) if b > since]
        if not gaps:
            raise ValueError("no chat token came after the first long prompt arrived: make the "
                             "chats longer (chat_tokens) or the long prompts come earlier")
        return gaps

    def itl(self, stat: str) -> float:
        """The decode stream's inter-token latency: ``"p50"``, ``"p99"`` or ``"max"`` (s)."""
        gaps = self.chat_gaps()
        if stat == "max":
            return max(gaps)
        return percentile(gaps, {"p50": 50, "p99": 99}[stat])

    def first_gap(self) -> float:
        """Median gap between a chat's first and second token (s): in the disaggregated mode
        the handoff — the K/V's transfer and the decode worker's admission."""
        return statistics.median(m.token_times[1] - m.token_times[0]
                                 for r, m in self.metrics.items() if r.startswith("chat"))

    def ttft(self, kind: str) -> float:
        """Median TTFT (s) of the ``"chat"`` or ``"long"`` requests."""
        return statistics.median(m.ttft for r, m in self.metrics.items() if r.startswith(kind))


def _drive_engine(engine: LLMEngine, load: Load) -> tuple[float, dict, dict, list[dict], int]:
    """Serve `load` in real time on one engine; returns t=0, metrics, tokens, steps, and the
    prompt tokens fed in steps that also fed chat tokens."""
    reqs = load.requests()
    params = {}
    i, t0 = 0, time.perf_counter()
    done_m, done_t, steps, mixed = {}, {}, [], 0
    while i < len(reqs) or engine.has_unfinished():
        now = time.perf_counter()
        while i < len(reqs) and t0 + reqs[i][3] <= now:
            rid, prompt, n, at = reqs[i]
            sp = params.setdefault(n, SamplingParams(temperature=0, max_new_tokens=n,
                                                     ignore_eos=True))
            engine.add_request(prompt, sp, request_id=rid, arrival_time=t0 + at)
            i += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, t0 + reqs[i][3] - time.perf_counter()))
            continue
        s = time.perf_counter()
        for out in engine.step():
            if out.finished:
                done_m[out.request_id], done_t[out.request_id] = out.metrics, out.token_ids
        st = engine.last_step
        steps.append({"start": s, "end": time.perf_counter(), "tokens": st.num_tokens})
        if any(r.startswith("chat") for r in st.decode):
            mixed += sum(n for _, n in st.prefill)
    return t0, done_m, done_t, steps, mixed


@contextlib.contextmanager
def _engine(model: torch.nn.Module, threads: int, **options) -> Iterator[LLMEngine]:
    """A warmed-up `LLMEngine` on `model` (16 seats, `options` besides), with `threads` torch
    threads while the block runs."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        engine = LLMEngine(model, max_num_seqs=16, **options)
        engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=2))
        yield engine
    finally:
        torch.set_num_threads(saved)


def decode_step_s(model: torch.nn.Module, prompts: Sequence[Sequence[int]], *,
                  tokens: int = 32, threads: int = 1) -> float:
    """Median seconds of one decode step that carries `prompts` together, on an engine like
    the colocated mode's: a load's arrival times scaled by it land at the same point of the
    chats' stream on a slow laptop and on a fast server."""
    check_int("tokens", tokens, 3)
    with _engine(model, threads, block_size=16) as engine:
        outs = engine.generate([list(p) for p in prompts],
                               SamplingParams(temperature=0, max_new_tokens=tokens,
                                              ignore_eos=True))
    times = [o.metrics.token_times[1:] for o in outs]  # the first token came from the prefill
    return statistics.median(b - a for t in times for a, b in zip(t, t[1:]))


def run_mode(mode: str, model: torch.nn.Module, load: Load, *, chunk: int = 32,
             block_size: int = 16, threads: int = 1, prefill_nice: int = 5,
             timeout_s: float = 120.0) -> ModeResult:
    """Serve `load` one way (one of :data:`MODES`); `threads` torch threads per process.

    `prefill_nice`: the disaggregated prefill worker's lowered CPU priority (see
    `DisaggregatedEngine`): on one machine its prefills would otherwise take CPU time from
    the decode worker that separate machines would not.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    check_int("chunk", chunk, 1)
    if mode == "disaggregated":
        return _run_disaggregated(model, load, chunk=chunk, block_size=block_size,
                                  threads=threads, prefill_nice=prefill_nice,
                                  timeout_s=timeout_s)
    kw = {"enable_chunked_prefill": True, "max_num_batched_tokens": chunk} \
        if mode == "chunked" else {}
    with _engine(model, threads, block_size=block_size, **kw) as engine:
        t0, metrics, tokens, steps, mixed = _drive_engine(engine, load)
    return ModeResult(mode, load, t0, metrics, tokens, decode_prompt_tokens=mixed,
                      timeline={"engine": steps})


def _run_disaggregated(model, load: Load, *, chunk: int, block_size: int, threads: int,
                       prefill_nice: int, timeout_s: float) -> ModeResult:
    from minifer.distributed.disagg import DisaggregatedEngine

    with DisaggregatedEngine(model, block_size=block_size, prefill_tokens=max(chunk, 256),
                             decode_max_seqs=16, threads=threads, prefill_nice=prefill_nice,
                             timeout_s=timeout_s) as eng:
        eng.generate([[1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=2))  # warm up
        result = drive_disaggregated(eng, load)
    attach_timeline(result, eng.report)
    return result


def drive_disaggregated(eng, load: Load, *, tag: str = "") -> ModeResult:
    """Serve `load` in real time through a started `DisaggregatedEngine` (warm it up first:
    a first request pays for nothing then). Request ids get `tag` appended, so one engine can
    serve the load several times; the result's keys are the load's ids. The workers'
    timelines come with the engine's report: see :func:`attach_timeline`."""
    reqs = load.requests()
    i, t0 = 0, time.perf_counter()
    deadline = t0 + eng.timeout_s
    ids: dict[str, str] = {}  # engine's request id -> the load's
    finished: set[str] = set()
    while i < len(reqs) or not finished.issuperset(ids):
        now = time.perf_counter()
        while i < len(reqs) and t0 + reqs[i][3] <= now:
            rid, prompt, n, at = reqs[i]
            ids[eng.add_request(prompt, SamplingParams(temperature=0, max_new_tokens=n,
                                                       ignore_eos=True),
                                request_id=rid + tag, arrival_time=t0 + at)] = rid
            i += 1
        wait = (t0 + reqs[i][3] - time.perf_counter()) if i < len(reqs) else 0.05
        finished.update(o.request_id for o in eng.poll(timeout_s=max(0.001, min(wait, 0.05))))
        if time.perf_counter() > deadline:
            raise TimeoutError(f"the disaggregated run took more than {eng.timeout_s:g} s")
    outs = {ids[o.request_id]: o for o in eng.outputs if o.request_id in ids}
    return ModeResult("disaggregated", load, t0, {r: o.metrics for r, o in outs.items()},
                      {r: o.token_ids for r, o in outs.items()},
                      kv_bytes=sum(o.kv_bytes for o in outs.values()),
                      transfer_s=sum(o.recv_s for o in outs.values()),
                      bytes_per_token=eng.bytes_per_token,
                      prompt_tokens=sum(len(o.prompt_token_ids) for o in outs.values()
                                        if o.kv_bytes))


def attach_timeline(result: ModeResult, report) -> None:
    """Give a disaggregated `result` the workers' spans of its own run (from the engine's
    `DisaggReport`), and count the prompt tokens its decode worker fed (recomputing)."""
    lo = result.start
    hi = max(m.finished_time for m in result.metrics.values())

    def window(spans):
        return [s for s in spans if lo <= s["start"] <= hi]
    dec = window(report.decode["timeline"])
    result.timeline = {"prefill": window(report.prefill["timeline"]), "decode": dec,
                       "recv": window(report.decode["recv"])}
    result.decode_prompt_tokens = sum(s["tokens"] - len(s["requests"]) for s in dec
                                      if s["kind"] == "recompute")


def compare(model: torch.nn.Module, load: Load, *, modes: Sequence[str] = MODES,
            chunk: int = 32, block_size: int = 16, threads: int = 1, prefill_nice: int = 5,
            timeout_s: float = 120.0) -> dict[str, ModeResult]:
    """Every mode on the same load, one after another; also checks that all modes produced
    the same tokens (greedy: the serving layout never changes the output)."""
    results = {m: run_mode(m, model, load, chunk=chunk, block_size=block_size, threads=threads,
                           prefill_nice=prefill_nice, timeout_s=timeout_s) for m in modes}
    first = next(iter(results.values())).token_ids
    for m, r in results.items():
        if r.token_ids != first:
            raise AssertionError(f"mode {m} produced other tokens than {modes[0]}")
    return results


def format_report(results: dict[str, ModeResult]) -> str:
    """A table: the decode stream's ITL p50 / p99 / max gap, the chats' first gap, TTFT chat /
    long, K/V moved and the decode worker's time receiving it."""
    lines = [f"{'mode':<14} {'ITL p50 ms':>10} {'ITL p99 ms':>10} {'max gap ms':>10} "
             f"{'1st gap ms':>10} {'TTFT chat ms':>12} {'TTFT long ms':>12} {'KV moved':>12} "
             f"{'recv ms':>8}"]
    for m, r in results.items():
        lines.append(f"{m:<14} {r.itl('p50') * 1e3:>10.1f} {r.itl('p99') * 1e3:>10.1f} "
                     f"{r.itl('max') * 1e3:>10.1f} {r.first_gap() * 1e3:>10.1f} "
                     f"{r.ttft('chat') * 1e3:>12.1f} "
                     f"{r.ttft('long') * 1e3:>12.1f} {r.kv_bytes:>12,} "
                     f"{r.transfer_s * 1e3:>8.2f}")
    return "\n".join(lines)
