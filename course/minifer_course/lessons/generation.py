"""Lesson 01, the generation loop: the next-token distribution, the loop traced step by step,
forward passes counted, and a streaming timeline driven by a slider."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import ipywidgets as widgets
import plotly.graph_objects as go
import torch

from minifer.cache import StaticKVCache
from minifer.generation import Completion, decode_step, generate, prefill
from minifer.sampling import SamplingParams

from .common import control, reference_line, sig, style, token_label
from .common import panel as _panel


def show_token(tokenizer, token_id: int) -> str:
    """A token as readable text for tables and axes: ``⏎`` for a newline, ``␣`` for a space,
    ``<0xFF>`` for a lone byte (see :func:`minifer_course.lessons.common.token_label`)."""
    return token_label(tokenizer.token_to_text(int(token_id)))


def top_tokens(logits: torch.Tensor, tokenizer, k: int = 10) -> list[dict]:
    """The k most likely next tokens of a ``(V,)`` logit vector, with their probabilities."""
    probs = logits.float().softmax(-1)
    p, ids = probs.topk(k)
    return [
        {"rank": r + 1, "id": int(i), "token": show_token(tokenizer, int(i)), "prob": round(float(q), 4)}
        for r, (q, i) in enumerate(zip(p, ids))
    ]


def next_token_figure(logits: torch.Tensor, tokenizer, k: int = 20, title: str | None = None) -> go.Figure:
    """Bar chart of the k most likely next tokens: the model's output is a whole distribution."""
    rows = top_tokens(logits, tokenizer, k)
    labels = [r["token"] for r in rows]
    labels = [f"{t} ({r['id']})" if labels.count(t) > 1 else t for t, r in zip(labels, rows)]
    fig = go.Figure(go.Bar(x=labels, y=[r["prob"] for r in rows],
                           hovertext=[f"id {r['id']}" for r in rows]))
    fig.update_xaxes(tickangle=0 if k <= 12 else -45)
    return style(fig, title or f"Top {k} of {logits.shape[-1]:,} next-token probabilities",
                 "token (⏎ newline, ␣ space, <0x..> a lone byte)", "probability")


@dataclass
class Step:
    step: int
    phase: str  # "prefill" or "decode"
    tokens_in: int  # tokens fed to the model in this pass
    cache_slots: int  # slots filled in the KV cache after the pass
    token_id: int
    token: str


def trace_loop(model, tokenizer, prompt: str, steps: int) -> list[Step]:
    """The generation loop written out: prefill once, then sample → append → decode, greedily.

    This is what `minifer.generate` does, minus batching, stop conditions and timing.
    """
    ids = torch.tensor([tokenizer.encode(prompt)], device=next(model.parameters()).device)
    cache = StaticKVCache.for_model(model, batch_size=1, max_len=ids.shape[1] + steps)
    trace = []
    with torch.inference_mode():
        logits = prefill(model, ids, cache)  # all prompt tokens in one pass
        tokens_in, phase = ids.shape[1], "prefill"
        for step in range(steps):
            logits[:, tokenizer.vocab_size:] = float("-inf")  # padding rows of the vocabulary
            token = logits.argmax(-1)  # greedy: the most likely token
            trace.append(Step(step, phase, tokens_in, cache.pos, int(token), show_token(tokenizer, int(token))))
            if step < steps - 1:
                logits = decode_step(model, token, cache)  # one new token per pass
                tokens_in, phase = 1, "decode"
    return trace


class PassCounter:
    """Counts forward passes of a model and the tokens fed to them."""

    def __init__(self) -> None:
        self.passes = 0
        self.tokens = 0

    def __call__(self, module, args, kwargs) -> None:
        self.passes += 1
        self.tokens += args[0].numel() if args else kwargs["idx"].numel()


@contextmanager
def count_forward_passes(model: torch.nn.Module) -> Iterator[PassCounter]:
    """``with count_forward_passes(model) as c: ...`` then read ``c.passes`` and ``c.tokens``."""
    counter = PassCounter()
    handle = model.register_forward_pre_hook(counter, with_kwargs=True)
    try:
        yield counter
    finally:
        handle.remove()


def passes_for(model, prompt_ids: list[int], new_tokens: int) -> int:
    """Forward passes that `generate` makes for `new_tokens` tokens (EOS ignored)."""
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    with count_forward_passes(model) as c:
        generate(model, [prompt_ids], params)
    return c.passes


def timeline(model, prompt_ids: list[int], new_tokens: int, repeats: int = 3) -> Completion:
    """Generate `new_tokens` greedily (after one warm-up) and keep the fastest of `repeats` runs.

    The fastest run is the most honest estimate of the cost: noise (another process, a page
    fault) only ever adds time.
    """
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    generate(model, [prompt_ids], SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True))
    return min((generate(model, [prompt_ids], params)[0] for _ in range(repeats)), key=lambda c: c.e2e)


def timeline_figure(c: Completion, title: str | None = None,
                    x_max_ms: float | None = None) -> go.Figure:
    """When each token arrived, on a clock that starts when the request was sent: nothing for
    the whole prefill (the TTFT, marked), then one token per decode step at a steady beat.

    Time runs along the x axis from 0, so the wait for the first token is the empty stretch
    before the TTFT line. ``x_max_ms`` fixes the axis (a slider keeps one scale).
    """
    ms = [round(t * 1e3, 2) for t in c.token_times]
    n = list(range(1, len(ms) + 1))
    fig = go.Figure(go.Scatter(x=ms, y=n, mode="markers", name="a token arrives",
                               marker=dict(size=6, color="#1F77B4"), showlegend=False))
    fig.add_trace(go.Scatter(x=[0.0, *ms], y=[0, *n], mode="lines", line_shape="hv",
                             name="tokens received", showlegend=False,
                             line=dict(color="#1F77B4", width=1)))
    reference_line(fig, x=ms[0], text=f"first token: TTFT {ms[0]:.1f} ms", color="#D62728")
    fig.add_vrect(x0=0, x1=ms[0], line_width=0, fillcolor="rgba(214,39,40,0.08)")
    fig.update_xaxes(range=[0, (x_max_ms or ms[-1]) * 1.04], rangemode="tozero")
    fig.update_yaxes(range=[0, len(ms) * 1.08], rangemode="tozero")
    title = title or (f"{len(ms)} tokens: the first after {c.ttft * 1e3:.1f} ms (TTFT), then "
                      f"one every {c.tpot * 1e3:.1f} ms (prompt {c.prompt_tokens} tokens)")
    return style(fig, title, "time since the request was sent (ms)", "tokens received")


def first_tokens(c: Completion, n: int) -> Completion:
    """The first ``n`` tokens of a completion, with their times: what a run asked for ``n``
    tokens would have produced (greedy decoding of ``n`` tokens is a prefix of a longer run)."""
    if not 1 <= n <= c.completion_tokens:
        raise ValueError(f"n must be in 1..{c.completion_tokens}, got {n}")
    return dataclasses.replace(c, token_ids=c.token_ids[:n], token_times=c.token_times[:n],
                               text=None, finish_reason="length")


def panel(model, prompt_ids: list[int], max_tokens: int = 128, value: int = 16
          ) -> widgets.interactive:
    """Slider: how many tokens to generate → their arrival timeline.

    The panel times one greedy run of ``max_tokens`` tokens when it is built (about a second)
    and the slider shows its first N tokens, so every move answers at once; the time axis
    stays that of the whole run, so a longer answer visibly takes longer.
    """
    full = timeline(model, prompt_ids, max_tokens, repeats=1)
    end_ms = full.token_times[-1] * 1e3

    def figure(new_tokens: int = value) -> go.Figure:
        return timeline_figure(first_tokens(full, new_tokens), x_max_ms=end_ms)

    return _panel(figure, new_tokens=control("int", "new tokens", value=value, min=2,
                                             max=max_tokens, step=2))


def step_probs_figure(rows: list[dict], vocab_size: int) -> go.Figure:
    """The loop a learner just ran, step by step: the probability the model gave the token
    the loop chose (greedy: the largest) and the end-of-text token's, against an even spread.

    ``rows``: one dict per step with ``step``, ``token`` (a readable label), ``prob`` and
    ``eos prob``. The y axis starts at 0, so a flat distribution looks flat."""
    if not rows:
        raise ValueError("rows must hold at least one step")
    steps = [r["step"] for r in rows]
    labels = [f"{r['step']}: {r['token']}" for r in rows]
    fig = go.Figure(go.Bar(x=labels, y=[sig(r["prob"], 4) for r in rows],
                           name="the chosen token (the argmax)", marker=dict(color="#1F77B4")))
    fig.add_trace(go.Scatter(x=labels, y=[sig(r["eos prob"], 4) for r in rows],
                             mode="markers", name="end-of-text token",
                             marker=dict(size=10, color="#D62728", symbol="diamond")))
    even = 1 / vocab_size
    reference_line(fig, y=even, text=f"an even spread: 1/{vocab_size:,}",
                   position="bottom right")
    top = max(max(r["prob"] for r in rows), max(r["eos prob"] for r in rows), even)
    fig.update_yaxes(range=[0, sig(top * 1.25, 4)])
    fig.update_xaxes(tickangle=0 if len(steps) <= 10 else -45)
    return style(fig, f"The {len(rows)} steps of the loop: how likely the model found each "
                 "token it chose", "step: chosen token", "probability")
