"""Lesson 01, the generation loop: the next-token distribution, the loop traced step by step,
forward passes counted, and a streaming timeline driven by a slider."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import ipywidgets as widgets
import plotly.graph_objects as go
import torch

from ..cache import StaticKVCache
from ..generation import Completion, decode_step, generate, prefill
from ..sampling import SamplingParams
from .common import style


def show_token(tokenizer, token_id: int) -> str:
    """A token as readable text for tables (control characters and partial bytes escaped)."""
    return tokenizer.token_to_text(token_id).encode("unicode_escape").decode("ascii")


def top_tokens(logits: torch.Tensor, tokenizer, k: int = 10) -> list[dict]:
    """The k most likely next tokens of a ``(V,)`` logit vector, with their probabilities."""
    probs = logits.float().softmax(-1)
    p, ids = probs.topk(k)
    return [
        {"rank": r + 1, "id": int(i), "token": repr(show_token(tokenizer, int(i))), "prob": round(float(q), 4)}
        for r, (q, i) in enumerate(zip(p, ids))
    ]


def next_token_figure(logits: torch.Tensor, tokenizer, k: int = 20, title: str | None = None) -> go.Figure:
    """Bar chart of the k most likely next tokens: the model's output is a whole distribution."""
    rows = top_tokens(logits, tokenizer, k)
    fig = go.Figure(go.Bar(x=[r["token"] for r in rows], y=[r["prob"] for r in rows],
                           hovertext=[f"id {r['id']}" for r in rows]))
    return style(fig, title or f"Top {k} of {logits.shape[-1]:,} next-token probabilities",
                 "token", "probability")


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


def timeline_figure(c: Completion, title: str | None = None) -> go.Figure:
    """When each token arrived: a first step that waits for prefill, then a steady decode beat."""
    ms = [round(t * 1e3, 2) for t in c.token_times]
    fig = go.Figure(go.Scatter(x=list(range(1, len(ms) + 1)), y=ms, mode="markers+lines", name="arrival"))
    fig.add_hline(y=ms[0], line_dash="dot", annotation_text=f"TTFT {ms[0]:.1f} ms")
    title = title or (f"{len(ms)} tokens: TTFT {c.ttft * 1e3:.1f} ms, then "
                      f"{c.tpot * 1e3:.1f} ms per token (prompt {c.prompt_tokens} tokens)")
    return style(fig, title, "token number", "arrival time since request (ms)")


def panel(model, prompt_ids: list[int]) -> widgets.interactive:
    """Slider: how many tokens to generate → a measured arrival timeline."""

    def show(new_tokens: int = 16) -> go.Figure:
        fig = timeline_figure(timeline(model, prompt_ids, new_tokens, repeats=1))
        fig.show()
        return fig

    slider = widgets.IntSlider(value=16, min=2, max=128, step=2, description="new tokens", style={"description_width": "initial"},
                               continuous_update=False)
    return widgets.interactive(show, new_tokens=slider)
