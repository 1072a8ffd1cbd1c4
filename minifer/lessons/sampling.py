"""Lesson 06, choosing the next token: one real next-token distribution reshaped by temperature,
top-k, top-p and the repetition penalty, with the kept set highlighted."""

from __future__ import annotations

from dataclasses import dataclass

import ipywidgets as widgets
import plotly.graph_objects as go
import torch

from ..generation import generate
from ..sampling import SamplingParams, process_logits
from .common import style
from .generation import show_token


def next_token_logits(model, tokenizer, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's next-token logits ``(V,)`` for `prompt`, and the mask of tokens already in it."""
    ids = tokenizer.encode(prompt)
    with torch.inference_mode():
        logits = model(torch.tensor([ids], device=next(model.parameters()).device), last_only=True)[0, -1]
    seen = torch.zeros_like(logits, dtype=torch.bool)
    seen[torch.tensor(ids)] = True
    return logits.float().cpu(), seen.cpu()


@dataclass
class Distribution:
    """Next-token probabilities before and after the logits processors."""

    before: torch.Tensor  # softmax of the raw logits
    after: torch.Tensor  # the distribution the token is drawn from (one-hot when greedy)
    kept: torch.Tensor  # bool: tokens that can still be drawn

    @property
    def n_kept(self) -> int:
        return int(self.kept.sum())


def reshape(logits: torch.Tensor, seen: torch.Tensor | None = None, temperature: float = 1.0,
            top_k: int = 0, top_p: float = 1.0, repetition_penalty: float = 1.0) -> Distribution:
    """Apply the engine's own processors (penalty → temperature → top-k → top-p) to one logit row."""
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                            repetition_penalty=repetition_penalty)
    processed = process_logits(logits[None], params, None if seen is None else seen[None])[0]
    if params.greedy:
        after = torch.zeros_like(processed)
        after[processed.argmax()] = 1.0
    else:
        after = processed.softmax(-1)
    return Distribution(logits.float().softmax(-1), after, after > 0)


def distribution_figure(logits: torch.Tensor, tokenizer, seen: torch.Tensor | None = None, *,
                        temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                        repetition_penalty: float = 1.0, show: int = 25) -> go.Figure:
    """The `show` most likely tokens (by the raw distribution): before (grey) and after (bars),
    kept tokens in blue, dropped ones in light red, tokens already in the prompt outlined."""
    d = reshape(logits, seen, temperature, top_k, top_p, repetition_penalty)
    order = d.before.argsort(descending=True)[:show].tolist()
    labels = [f"{show_token(tokenizer, i)!r}" for i in order]
    colors = ["#1f77b4" if d.kept[i] else "#f4a6a6" for i in order]
    outline = [2 if seen is not None and seen[i] else 0 for i in order]
    fig = go.Figure([
        go.Bar(x=labels, y=[round(float(d.before[i]), 4) for i in order], name="model (T=1, nothing cut)",
               marker_color="#cccccc"),
        go.Bar(x=labels, y=[round(float(d.after[i]), 4) for i in order], name="sampled from",
               marker=dict(color=colors, line=dict(width=outline, color="black"))),
    ])
    fig.update_layout(barmode="group")
    title = (f"T={temperature:g}, top-k={top_k or 'off'}, top-p={top_p:g}, penalty={repetition_penalty:g}: "
             f"{d.n_kept:,} of {logits.shape[-1]:,} tokens can be drawn")
    return style(fig, title, "token (most likely first)", "probability", width=820)


def panel(logits: torch.Tensor, tokenizer, seen: torch.Tensor | None = None) -> widgets.interactive:
    """Four sliders reshaping one real next-token distribution live."""

    def show(temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0) -> go.Figure:
        fig = distribution_figure(logits, tokenizer, seen, temperature=temperature, top_k=top_k,
                                  top_p=top_p, repetition_penalty=repetition_penalty)
        fig.show()
        return fig

    return widgets.interactive(
        show,
        temperature=widgets.FloatSlider(value=1.0, min=0.0, max=2.0, step=0.05, description="temperature", style={"description_width": "initial"},
                                        continuous_update=False),
        top_k=widgets.IntSlider(value=0, min=0, max=50, description="top-k (0=off)", style={"description_width": "initial"}, continuous_update=False),
        top_p=widgets.FloatSlider(value=1.0, min=0.05, max=1.0, step=0.05, description="top-p",
                                  continuous_update=False),
        repetition_penalty=widgets.FloatSlider(value=1.0, min=1.0, max=3.0, step=0.1, description="penalty",
                                               continuous_update=False),
    )


def continuations(model, tokenizer, prompt: str, temperatures, *, max_new_tokens: int = 40,
                  seed: int = 0, **params) -> list[dict]:
    """One seeded continuation of `prompt` per temperature (0 = greedy)."""
    rows = []
    for t in temperatures:
        sp = SamplingParams(temperature=t, max_new_tokens=max_new_tokens, seed=seed, **params)
        c = generate(model, prompt, sp, tokenizer)[0]
        rows.append({"temperature": t, "text": c.text})
    return rows
