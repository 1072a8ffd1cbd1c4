"""Lesson 11: requests competing inside one server. A long prompt's prefill stalls the other
requests' decode steps unless it is chunked (BATCH-8, PD-11), and priorities with aging decide
who waits (BATCH-9). Each experiment streams real requests at an in-process server and reads
the token times the clients saw.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
import plotly.graph_objects as go

from minifer.engine.llm_engine import LLMEngine, StepStats
from minifer_course.server import running_server

from .common import reference_line, sig_or_none, style
from .http_client import MODEL_NAME, poisson_workload, run_coroutine, warm_up


# ---- streams of timed events, driven by events (BATCH-8, BATCH-9) ---------------------------
async def _stream(http, body: dict, log: list, tag) -> None:
    """Stream one request; append ``(tag, time)`` to `log` for every token event."""
    async with http.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:]).get("choices"):
                    log.append((tag, time.perf_counter()))


@dataclass
class InterferenceRun:
    """Short requests decoding while one long prompt arrives (BATCH-8, PD-11)."""

    chunked: bool
    short_times: list[list[float]]  # per short request: its token times (s from start)
    long_sent_s: float
    long_first_token_s: float
    long_prefill_decodes: list[int]  # per engine step that fed the long prompt: others' decodes

    @property
    def itls(self) -> list[tuple[float, float]]:
        """(time, gap) of every inter-token gap of the short requests."""
        return [(b, b - a) for ts in self.short_times for a, b in zip(ts, ts[1:])]

    @property
    def stall_ms(self) -> float:
        """The largest gap any short request saw while the long prompt was being prefilled."""
        gaps = [g for t, g in self.itls if t >= self.long_sent_s]
        return max(gaps) * 1e3

    @property
    def others_done_s(self) -> float:
        """When the last short request finished, in seconds after the long prompt was sent."""
        return max(ts[-1] for ts in self.short_times) - self.long_sent_s

    @property
    def long_prefill_steps(self) -> int:
        """The engine steps that fed the long prompt (the last one also gave its first token)."""
        return len(self.long_prefill_decodes)

    @property
    def others_tokens_during_long_prefill(self) -> int:
        """Tokens the short requests got in the steps that fed the long prompt: those steps,
        times the requests decoding beside it. Read off the engine's steps, not the clients'
        clocks, so neither a busy machine nor the request's trip to the server moves it."""
        return sum(self.long_prefill_decodes)

    def others_tokens_within(self, seconds: float) -> int:
        """Tokens the short requests received in the first `seconds` after the long prompt."""
        return sum(self.long_sent_s <= t <= self.long_sent_s + seconds
                   for ts in self.short_times for t in ts)

    @property
    def typical_ms(self) -> float:
        """The median gap of the short requests before the long prompt came."""
        gaps = sorted(g for t, g in self.itls if t < self.long_sent_s)
        return gaps[len(gaps) // 2] * 1e3


def interference(model, tokenizer, *, chunked: bool, n_short: int = 3, short_tokens: int = 48,
                 long_prompt: int = 240, chunk_budget: int = 32, long_after: int = 6,
                 seed: int = 0) -> InterferenceRun:
    """`n_short` requests decode; once the first has streamed `long_after` tokens, a prompt of
    `long_prompt` tokens arrives. With ``chunked`` its prefill is split into chunks that fit a
    `chunk_budget`-token step beside the decodes; without, it runs whole in one step."""
    reqs = poisson_workload(n_short + 1, math.inf, (8, 8), short_tokens, seed=seed)
    long_ids = list(poisson_workload(1, math.inf, long_prompt, 1, seed=seed + 1)[0].prompt)
    opts = dict(enable_chunked_prefill=True, max_num_batched_tokens=chunk_budget) if chunked \
        else {}
    engine = LLMEngine(model, tokenizer, max_num_seqs=n_short + 1, **opts)
    steps = _log_steps(engine)
    with running_server(engine=engine, model_name=MODEL_NAME) as url:
        warm_up(url)

        async def scenario():
            log: list = []
            async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                t0 = time.perf_counter()
                shorts = [asyncio.create_task(_stream(http, {
                    "model": MODEL_NAME, "prompt": list(r.prompt), "max_tokens": short_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True}, log, i))
                    for i, r in enumerate(reqs[:n_short])]
                give_up = time.perf_counter() + 60
                while sum(1 for tag, _ in log if tag == 0) < long_after:
                    if time.perf_counter() > give_up or all(t.done() for t in shorts):
                        raise RuntimeError("the short requests did not start streaming")
                    await asyncio.sleep(0.001)
                sent = time.perf_counter()
                await _stream(http, {"model": MODEL_NAME, "prompt": long_ids, "max_tokens": 2,
                                     "temperature": 0, "stream": True}, log, "long")
                await asyncio.gather(*shorts)
            return log, t0, sent

        log, t0, sent = run_coroutine(scenario())
    times = [[t - t0 for tag, t in log if tag == i] for i in range(n_short)]
    first_long = next(t for tag, t in log if tag == "long") - t0
    fed = {}  # request id -> prompt tokens it was fed, over all steps
    for st in steps:
        for rid, n in st.prefill:
            fed[rid] = fed.get(rid, 0) + n
    long_id = max(fed, key=fed.get)  # no other prompt comes near its length
    decodes = [len(st.decode) for st in steps if any(rid == long_id for rid, _ in st.prefill)]
    return InterferenceRun(chunked, times, sent - t0, first_long, decodes)


def _log_steps(engine: LLMEngine) -> list[StepStats]:
    """Keep every step's `StepStats` (which request fed how many tokens) in the list returned:
    `engine.step` wrapped, on this one engine, for the lesson to count steps after the run."""
    steps: list[StepStats] = []
    step = engine.step

    def logged_step():
        outputs = step()
        steps.append(engine.last_step)
        return outputs

    engine.step = logged_step
    return steps


def interference_figure(runs: Sequence[InterferenceRun]) -> go.Figure:
    """The short requests' inter-token gaps over time, with and without chunked prefill."""
    fig = go.Figure()
    for run in runs:
        name = "chunked prefill" if run.chunked else "whole prefill"
        pts = sorted(run.itls)
        fig.add_trace(go.Scatter(x=[sig_or_none(t - run.long_sent_s) for t, _ in pts],
                                 y=[sig_or_none(g * 1e3) for _, g in pts], mode="markers", name=name))
    reference_line(fig, x=0, text="long prompt arrives")
    return style(fig, "Short requests' inter-token latency as a long prompt arrives",
                 "seconds after the long prompt was sent", "gap before this token (ms)",
                 width=760, height=360)


@dataclass
class PriorityRun:
    """A steady stream of high-priority requests and one low-priority request (BATCH-9)."""

    aging: float
    first_token_order: list  # "high" / "low" in the order their first tokens came
    low_ttft_s: float
    high_ttft_s: list[float]

    @property
    def highs_before_low(self) -> int:
        return self.first_token_order.index("low")


def priorities(model, tokenizer, *, aging: float, n_high: int = 16, clients: int = 5,
               max_num_seqs: int = 2, tokens: int = 12, seed: int = 0) -> PriorityRun:
    """`clients` closed-loop clients send `n_high` priority-0 requests in all (each sends its
    next as soon as its last finished, so high-priority work is always waiting), and one
    priority-1 request arrives just after them. Lower value = served first (vLLM's rule);
    `aging` lowers a waiting request's value per step it waits."""
    prompts = [list(r.prompt) for r in poisson_workload(n_high + 1, math.inf, (8, 16), 1,
                                                        seed=seed)]
    with running_server(model, tokenizer, model_name=MODEL_NAME, max_num_seqs=max_num_seqs,
                        aging=aging, scheduling_policy="priority") as url:
        warm_up(url)

        async def scenario():
            order: list[str] = []
            ttft: dict[str, list[float]] = {"high": [], "low": []}
            budget = iter(range(n_high))

            async def one(prompt, priority: int, kind: str):
                body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": tokens,
                        "temperature": 0, "ignore_eos": True, "stream": True,
                        "priority": priority}
                t0, first = time.perf_counter(), True
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    r.raise_for_status()
                    async for line in r.aiter_lines():
                        if first and line.startswith("data: {"):
                            first = False
                            order.append(kind)
                            ttft[kind].append(time.perf_counter() - t0)

            async def client():
                for i in budget:
                    await one(prompts[i], 0, "high")

            async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                tasks = [asyncio.create_task(client()) for _ in range(clients)]
                await asyncio.sleep(0.05)  # the high-priority clients are in
                await one(prompts[-1], 1, "low")
                await asyncio.gather(*tasks)
            return order, ttft

        order, ttft = run_coroutine(scenario())
    return PriorityRun(aging, order, ttft["low"][0], ttft["high"])
