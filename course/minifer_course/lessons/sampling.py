"""Lesson 06, choosing the next token: one real next-token distribution reshaped by temperature,
top-k, top-p and the repetition penalty, with the kept set highlighted."""

from __future__ import annotations

import math
from dataclasses import dataclass

import ipywidgets as widgets
import plotly.graph_objects as go
import torch

from minifer.generation import generate
from minifer.sampling import SamplingParams, process_logits

from .common import control, log_axis, sig, style
from .common import panel as _panel
from .generation import show_token
from .generation import top_tokens as top_tokens  # the lesson's table of the likeliest tokens

CUT_COLOR = "#d62728"  # tokens the processors cut: they can no longer be drawn
BOUNDARY = 6  # tokens shown around the cut when it falls beyond the top ones
GAP = "⋯"  # the axis label between the top tokens and those around the cut


def _unique(labels: list[str]) -> list[str]:
    """Category labels must differ, or plotly stacks two tokens on one bar."""
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        out.append(label if seen[label] == 1 else f"{label} ({seen[label]})")
    return out


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
            top_k: int = 0, top_p: float = 1.0, repetition_penalty: float = 1.0,
            sampler=None) -> Distribution:
    """Apply the processors (penalty → temperature → top-k → top-p) to one logit row: the
    engine's own (`minifer.sampling.process_logits`), or ``sampler(logits, seen, T, k, p,
    penalty)`` — the lesson's `my_sampler` — when given. Greedy (T = 0) takes the argmax of the
    processed logits; a sampler is then called with T = 1 (no temperature changes an argmax)."""
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                            repetition_penalty=repetition_penalty)
    if sampler is not None:
        processed = sampler(logits, seen, temperature if not params.greedy else 1.0, top_k, top_p,
                            repetition_penalty)
    else:
        processed = process_logits(logits[None], params, None if seen is None else seen[None])[0]
    if params.greedy:
        after = torch.zeros_like(processed)
        after[processed.argmax()] = 1.0
    else:
        after = processed.softmax(-1)
    return Distribution(logits.float().softmax(-1), after, after > 0)


def distribution_figure(logits: torch.Tensor, tokenizer, seen: torch.Tensor | None = None, *,
                        temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                        repetition_penalty: float = 1.0, show: int = 25, sampler=None) -> go.Figure:
    """The `show` most likely tokens (by the raw distribution), two bars each: the model's
    probability (grey, or red once the processors cut the token, so a cut token stays visible
    at its old height) and the probability it is drawn with now (blue; none for a cut token).
    Tokens already in the prompt are outlined. ``sampler``: see :func:`reshape`."""
    d = reshape(logits, seen, temperature, top_k, top_p, repetition_penalty, sampler)
    ranked = d.before.argsort(descending=True).tolist()
    order: list[int | None] = ranked[:show]
    first_cut = next((r for r, i in enumerate(ranked) if not d.kept[i]), None)
    edge = ""
    if first_cut is not None and first_cut >= show and show > BOUNDARY + 2:
        # every shown token is kept, yet some are cut (a top-p of 0.95 keeps hundreds): show
        # where the cut falls instead of the last few of the top ones, after a gap
        lo = max(show - BOUNDARY - 1, first_cut - BOUNDARY // 2)
        order = ranked[:show - BOUNDARY - 1] + [None] + ranked[lo:lo + BOUNDARY]
        edge = f"; past {GAP}: ranks {lo + 1}–{lo + BOUNDARY}, where the cut falls"
    rank = {i: r for r, i in enumerate(ranked)}
    labels = _unique([GAP if i is None else (show_token(tokenizer, i) if rank[i] < show
                      else f"#{rank[i] + 1} {show_token(tokenizer, i)}") for i in order])
    cut = [i is not None and not bool(d.kept[i]) for i in order]
    outline = [2 if i is not None and seen is not None and seen[i] else 0 for i in order]
    before = [0.0 if i is None else round(float(d.before[i]), 4) for i in order]
    after = [0.0 if i is None else round(float(d.after[i]), 4) for i in order]
    fig = go.Figure([
        go.Bar(x=labels, y=before, name="model's probability (T=1, nothing cut)",
               marker=dict(color=[CUT_COLOR if c else "#bbbbbb" for c in cut])),
        go.Bar(x=labels, y=after, name="drawn with now",
               marker=dict(color="#1f77b4", line=dict(width=outline, color="black"))),
        # a legend entry only: the red bars are the model's probability of a cut token
        go.Scatter(x=[None], y=[None], mode="markers", name="red: cut, never drawn now",
                   marker=dict(color=CUT_COLOR, symbol="square", size=10)),
    ])
    if seen is not None:
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name="outlined: in the prompt",
                                 marker=dict(color="white", symbol="square", size=10,
                                             line=dict(width=2, color="black"))))
    fig.update_layout(barmode="group", bargap=0.15, bargroupgap=0.0)
    title = (f"T={temperature:g}, top-k={top_k or 'off'}, top-p={top_p:g}, penalty={repetition_penalty:g}: "
             f"{d.n_kept:,} of {logits.shape[-1]:,} tokens can be drawn")
    fig = style(fig, title, f"token (most likely first; ⏎ newline, ␣ space{edge})", "probability",
                width=820)
    # the labels slant at a fixed angle in a bottom margin sized for them and the axis title, so
    # plotly never grows the margin itself (a caption added under the figure stays clear of it)
    fig.update_xaxes(tickangle=30)
    return fig.update_layout(margin_b=100, height=fig.layout.height + 50)


def panel(logits: torch.Tensor, tokenizer, seen: torch.Tensor | None = None, *, sampler=None,
          temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
          repetition_penalty: float = 1.0) -> widgets.interactive:
    """Four sliders reshaping one real next-token distribution live, with ``sampler`` (the
    learner's `my_sampler`; minifer's `process_logits` without one), starting at the values
    given."""

    def figure(temperature=temperature, top_k=top_k, top_p=top_p,
               repetition_penalty=repetition_penalty) -> go.Figure:
        return distribution_figure(logits, tokenizer, seen, temperature=temperature, top_k=top_k,
                                   top_p=top_p, repetition_penalty=repetition_penalty,
                                   sampler=sampler)

    return _panel(
        figure,
        temperature=control("float", "temperature", value=temperature, min=0.0, max=2.0, step=0.05),
        top_k=control("int", "top-k (0=off)", value=top_k, min=0, max=50),
        top_p=control("float", "top-p", value=top_p, min=0.05, max=1.0, step=0.05),
        repetition_penalty=control("float", "penalty", value=repetition_penalty, min=1.0, max=3.0,
                                   step=0.1),
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


def temperature_figure(logits: torch.Tensor, tokenizer, temperatures=(0.5, 1.0, 2.0), *,
                       show: int = 12) -> go.Figure:
    """The `show` most likely tokens' probabilities after ``softmax(logits / T)``, one bar group
    per token and one colour per temperature: T < 1 piles the mass on the top tokens, T > 1
    spreads it into the tail (the shown tokens' share of all the probability is in the legend)."""
    ranked = logits.float().argsort(descending=True)[:show].tolist()
    labels = _unique([show_token(tokenizer, i) for i in ranked])
    fig = go.Figure()
    for t in temperatures:
        probs = (logits.double() / t).softmax(-1)  # shown to 3 digits: logits differ by CPU
        shown = float(probs[ranked].sum())
        fig.add_trace(go.Bar(x=labels, y=[sig(float(probs[i]), 3) for i in ranked],
                             name=f"T={t:g} (these {show} hold {shown:.0%})"))
    fig.update_layout(barmode="group", bargap=0.2, bargroupgap=0.0)
    return style(fig, f"Temperature reshapes one distribution: the {show} likeliest tokens at "
                 f"T = {', '.join(f'{t:g}' for t in temperatures)}",
                 "token (most likely first; ⏎ newline, ␣ space)", "probability", width=820)


def cumulative_figure(logits: torch.Tensor, ps=(0.5, 0.9, 0.95)) -> go.Figure:
    """Top-p's cut: the cumulative probability of the tokens, most likely first (log rank), and
    for each p the rank where it is reached: the number of tokens top-p keeps."""
    ranked = logits.float().softmax(-1).sort(descending=True).values
    before = ranked.cumsum(0) - ranked  # above each token: float32, as minifer's top-p cuts
    # the curve in float64: float32 sums differ in their 4th digit between CPUs' kernels
    mass = logits.double().softmax(-1).sort(descending=True).values.cumsum(0)
    V = mass.shape[0]
    ranks = sorted({int(r) for r in torch.logspace(0, math.log10(V), 120).round().tolist()} | {V})
    fig = go.Figure(go.Scatter(x=ranks, y=[sig(float(mass[r - 1]), 4) for r in ranks],
                               mode="lines", name="probability of the top r tokens",
                               line=dict(color="#1f77b4", width=2)))
    kept = []
    for p in ps:
        n = max(int((before < p).sum()), 1)
        kept.append(n)
        fig.add_trace(go.Scatter(x=[n, n], y=[0, sig(float(mass[n - 1]), 4)], mode="lines+markers",
                                 name=f"top-p={p:g}: keeps {n}", line=dict(dash="dot", width=2)))
    log_axis(fig, "xaxis")
    fig.update_yaxes(range=[0, 1.02])
    return style(fig, f"Top-p keeps tokens until their probability reaches p: "
                 f"{', '.join(map(str, kept))} of {V:,}", "rank r (log)",
                 "cumulative probability", width=760)


def steps_figure(kept: list[int], drawn_prob: list[float], labels: list[str]) -> go.Figure:
    """A sampled generation, step by step: how many tokens the processors left to draw from
    (bars, log scale) and the probability the drawn token had (line, right axis)."""
    steps = list(range(1, len(kept) + 1))
    fig = go.Figure([
        go.Bar(x=steps, y=kept, name="tokens left to draw from", marker_color="#9ecae1",
               hovertext=labels),
        go.Scatter(x=steps, y=[sig(p, 3) for p in drawn_prob], name="probability of the drawn token",
                   mode="lines+markers", yaxis="y2", line=dict(color="#d62728", width=2),
                   hovertext=labels),
    ])
    fig.update_layout(yaxis2=dict(overlaying="y", side="right", range=[0, 1.02], showgrid=False,
                                  tickmode="array", tickvals=[0, 0.25, 0.5, 0.75, 1],
                                  title=dict(text="probability of the drawn token"),
                                  tickfont=dict(size=12)))
    log_axis(fig, "yaxis", title_text="tokens left (log)")
    return style(fig, f"Your sampler at each of the {len(kept)} steps: "
                 f"{min(kept)}–{max(kept)} tokens left after top-k and top-p", "step", width=820)
