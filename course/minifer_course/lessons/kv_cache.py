"""Lesson 03, the KV cache: cached keys never change, cached output is identical, and the cost
per token stays flat with the cache but grows with the sequence without it."""

from __future__ import annotations

import statistics

import ipywidgets as widgets
import plotly.graph_objects as go
import torch

from minifer.cache import StaticKVCache
from minifer.generation import decode_step, generate, prefill
from minifer.sampling import SamplingParams

from .common import control, style
from .common import panel as _panel


def keys_never_change(model, prompt_ids: list[int], steps: int = 8) -> dict:
    """Prefill, snapshot every layer's cached K/V, decode `steps` tokens, compare the old slots.

    Also recomputes the whole sequence from scratch and compares its K/V with the cached ones:
    the cache holds exactly what a full recomputation would produce (up to float rounding).
    """
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], device=device)
    t = ids.shape[1]
    cache = StaticKVCache.for_model(model, 1, t + steps)
    with torch.inference_mode():
        logits = prefill(model, ids, cache)
        before = [(k[:, :, :t].clone(), v[:, :, :t].clone()) for k, v in zip(cache.k, cache.v)]
        tokens = []
        for _ in range(steps):
            tok = logits.argmax(-1)
            tokens.append(int(tok))
            logits = decode_step(model, tok, cache)
        unchanged = all(torch.equal(k[:, :, :t], kb) and torch.equal(v[:, :, :t], vb)
                        for (kb, vb), k, v in zip(before, cache.k, cache.v))
        fresh = StaticKVCache.for_model(model, 1, t + steps)
        prefill(model, torch.tensor([prompt_ids + tokens], device=device), fresh)
        n = cache.pos
        diff = max(float((a[:, :, :n] - b[:, :, :n]).abs().max()) for a, b in zip(cache.k + cache.v, fresh.k + fresh.v))
    return {"prompt_tokens": t, "decoded": steps, "old_slots_unchanged": unchanged, "max_abs_diff_vs_recompute": diff}


def tokens_processed(prompt_tokens: int, new_tokens: int, use_cache: bool) -> list[int]:
    """Tokens fed through the model at each step to produce `new_tokens` tokens.

    With the cache: the prompt once, then one token per step. Without: the whole sequence so
    far, every step. Summed, that is linear versus quadratic in the output length.
    """
    if use_cache:
        return [prompt_tokens] + [1] * (new_tokens - 1)
    return [prompt_tokens + i for i in range(new_tokens)]


def work_figure(prompt_tokens: int, new_tokens: int) -> go.Figure:
    """Cumulative tokens processed, with and without the cache."""
    fig = go.Figure()
    for use_cache, name in ((False, "no cache (recompute)"), (True, "KV cache")):
        per_step = tokens_processed(prompt_tokens, new_tokens, use_cache)
        total = [sum(per_step[: i + 1]) for i in range(new_tokens)]
        fig.add_trace(go.Scatter(x=list(range(1, new_tokens + 1)), y=total, name=name, mode="lines"))
    return style(fig, f"Tokens pushed through the model (prompt {prompt_tokens} tokens)",
                 "tokens generated", "tokens processed so far (cumulative)")


def rope_figure(angles: torch.Tensor) -> go.Figure:
    """Rotary positions as a picture: the cosine of each dim pair's angle (x) at each position
    (y), from `angles` ``(positions, head_dim / 2)``. The first pairs turn fast, the last barely."""
    fig = go.Figure(go.Heatmap(z=angles.cos().tolist(), colorscale="RdBu", zmin=-1, zmax=1,
                               colorbar=dict(title="cos")))
    return style(fig, "Rotary positions: every pair of dims turns at its own speed",
                 "dim pair i (dims i and i + head_dim/2)", "position")


def step_times(model, prompt_ids: list[int], new_tokens: int, use_cache: bool, repeats: int = 3) -> list[float]:
    """Median (over `repeats`, after one warm-up) time of each generated token, in ms.

    Entry 0 is the time to the first token (prefill); entry i > 0 is the gap before token i.
    """
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    generate(model, [prompt_ids], SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True),
             use_cache=use_cache)
    runs = []
    for _ in range(repeats):
        c = generate(model, [prompt_ids], params, use_cache=use_cache)[0]
        runs.append([c.token_times[0]] + c.itl)
    return [1e3 * statistics.median(r[i] for r in runs) for i in range(new_tokens)]


def step_times_pair(model, prompt_ids: list[int], new_tokens: int, repeats: int = 3, *,
                    best: bool = False) -> tuple[list[float], list[float]]:
    """Per-token times (ms) with and without the cache, measured turn about.

    One warm-up each, then `repeats` rounds of (cached run, recomputed run); each entry is the
    median over the rounds (``best=True``: the fastest round's, since load on a shared machine
    only ever adds time — the better choice for two rounds). Alternating the two puts both
    under the same load: a busy machine slows both alike instead of whichever happened to run
    while it was busy.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    pick = min if best else statistics.median
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    warm = SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True)
    runs: dict[bool, list[list[float]]] = {True: [], False: []}
    for use_cache in (True, False):
        generate(model, [prompt_ids], warm, use_cache=use_cache)
    for _ in range(repeats):
        for use_cache in (True, False):
            c = generate(model, [prompt_ids], params, use_cache=use_cache)[0]
            runs[use_cache].append([c.token_times[0]] + c.itl)
    med = {u: [1e3 * pick([r[i] for r in rs]) for i in range(new_tokens)]
           for u, rs in runs.items()}
    return med[True], med[False]


def ms_per_token(times_ms: list[float]) -> float:
    """Mean decode time per token (the steps after the first)."""
    return statistics.fmean(times_ms[1:])


def whole_call_ms_per_token(times_ms: list[float]) -> float:
    """A whole generation's time divided by its new tokens, prefill included (the way the
    claims' reference run timed KV-3: one ``generate`` call per length)."""
    return sum(times_ms) / len(times_ms)


def compare(cached_ms: list[float], recompute_ms: list[float], new_tokens: int, *,
            whole_call: bool = False) -> dict:
    """ms per token with and without the cache over the first `new_tokens` tokens, and their ratio.

    Greedy generation of N tokens is a prefix of generating more, so one long measured run
    answers for every shorter length. By default the decode steps are averaged (the prefill,
    entry 0, left out); ``whole_call=True`` divides the whole call's time, prefill included, by
    the new tokens, as the claims' reference run did.
    """
    per_token = whole_call_ms_per_token if whole_call else ms_per_token
    cached = per_token(cached_ms[:new_tokens])
    recompute = per_token(recompute_ms[:new_tokens])
    return {"new tokens": new_tokens, "cache ms/token": round(cached, 2),
            "no-cache ms/token": round(recompute, 2), "ratio": round(recompute / cached, 1)}


def step_time_figure(cached_ms: list[float], recompute_ms: list[float], prompt_tokens: int,
                     y_max_ms: float | None = None) -> go.Figure:
    """Time of each decode step: flat with the cache, growing with the sequence without it.

    The y axis starts at 0 (``y_max_ms`` fixes its top, so a slider compares like with like).
    """
    fig = go.Figure()
    for ms, name in ((recompute_ms, "no cache (recompute)"), (cached_ms, "KV cache")):
        fig.add_trace(go.Scatter(x=list(range(1, len(ms))), y=[round(m, 2) for m in ms[1:]],
                                 name=name, mode="lines+markers"))
    top = y_max_ms or max(max(recompute_ms[1:]), max(cached_ms[1:]))
    fig.update_yaxes(range=[0, top * 1.05])
    fig.update_xaxes(range=[0, len(cached_ms) - 0.5])
    return style(fig, f"Decode step time, prompt of {prompt_tokens} tokens "
                      f"({ms_per_token(cached_ms):.1f} vs {ms_per_token(recompute_ms):.1f} ms/token)",
                 "decode step", "ms")


CONTEXTS = (32, 128, 256, 512)  # the panel's context lengths (prompt tokens)


def measure_contexts(model, contexts: tuple[int, ...] = CONTEXTS, new_tokens: int = 8,
                     repeats: int = 1) -> dict[int, tuple[list[float], list[float]]]:
    """Per-token times (ms) with and without the cache for a prompt of each length in
    ``contexts``: ``{context: (cached_ms, recompute_ms)}``, for :func:`panel`.

    Measured once, up front (a few seconds: the recomputed steps of a 512-token prompt are
    512-token prefills), so that moving the slider only redraws.
    """
    limit = model.config.context_length - new_tokens
    if not contexts or any(not 1 <= c <= limit for c in contexts):
        raise ValueError(f"contexts must be non-empty, each in 1..{limit}, got {contexts}")
    if new_tokens < 2:
        raise ValueError(f"new_tokens must be >= 2 (one decode step at least), got {new_tokens}")
    return {c: step_times_pair(model, list(range(1, c + 1)), new_tokens, repeats)
            for c in contexts}


def panel(measured: dict[int, tuple[list[float], list[float]]]) -> widgets.interactive:
    """Slider over the context lengths of :func:`measure_contexts`: the measured step times with
    and without the cache, on one y scale for all contexts (the answer is immediate)."""
    if not measured:
        raise ValueError("measured must hold at least one context (see measure_contexts)")
    contexts = sorted(measured)
    top = max(max(max(c[1:]), max(r[1:])) for c, r in measured.values())

    def figure(context: int = contexts[0]) -> go.Figure:
        cached, recomputed = measured[context]
        return step_time_figure(cached, recomputed, context, y_max_ms=top)

    return _panel(figure, context=control("select", "context", options=contexts,
                                          value=contexts[0]))
