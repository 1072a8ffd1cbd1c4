"""Lesson 10, speculative decoding: the reference run beside ours, a k sweep with Leviathan et
al.'s expected speed-up laid over the measurement, predictable vs creative text, the exactness
of speculative *sampling* made visible, and a k / temperature panel."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence

import ipywidgets as widgets
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from minifer import speculative as spec
from minifer.cache import StaticKVCache
from minifer.config import GPTConfig
from minifer.generation import generate
from minifer.model import GPT
from minifer.sampling import SamplingParams
from minifer.speculative import ModelDrafter, SpecStats, expected_speedup, speculative_generate

from ..bench.reference import SPEC as REFERENCE
from ..bench.spec import SpecPoint, measure
from ..bench.timing import round_robin
from .common import control, reference_line, sig, style
from .common import panel as _panel

__all__ = ["reference_rows", "stats_row", "sweep", "verify_cost", "speedup_figure",
           "point_figure", "panel", "sweep_notes", "acceptance_figure", "accept_hist_figure", "rounds_figure",
           "toy_pair",
           "exact_last_token", "target_counts", "spec_counts", "always_accept",
           "distribution_figure", "tv_distance"]


# ---- SPEC-3: the reference run beside ours ------------------------------------------------------
def reference_rows(stats: SpecStats, target_params: int, draft_params: int) -> list[dict]:
    """The seed's figures (claim SPEC-3) and ours, as table rows."""
    ref = REFERENCE
    return [
        {"run": "claim SPEC-3 (seed)", "draft params": ref["draft_params"],
         "target params": ref["target_params"], "k": ref["k"], "tokens": ref["tokens"],
         "target passes": ref["target_passes"], "plain passes": ref["tokens"],
         "accepted": ref["accepted"], "tokens/pass": round(ref["tokens"] / ref["target_passes"], 2)},
        {"run": "ours (this notebook)", "draft params": draft_params, "target params": target_params,
         "k": stats.k, "tokens": stats.tokens, "target passes": stats.target_passes,
         "plain passes": stats.tokens, "accepted": stats.accepted,
         "tokens/pass": round(stats.tokens_per_pass, 2)},
    ]


def stats_row(name: str, s: SpecStats) -> dict:
    """One run's counts. α = accepted ÷ *tested* (drafts up to and including each round's
    first rejection); ``proposed`` also counts the drafts after a rejection, never tested."""
    return {"run": name, "k": s.k, "tokens": s.tokens, "target passes": s.target_passes,
            "accepted": s.accepted, "tested": s.accepted + s.rejections, "proposed": s.proposed,
            "alpha": round(s.alpha, 3), "tokens/pass": round(s.tokens_per_pass, 2)}


def alpha_line(s: SpecStats) -> str:
    """α with its one denominator spelled out, beside the summary's accepted/proposed."""
    tested = s.accepted + s.rejections
    return (f"α = accepted / tested = {s.accepted}/{tested} = {s.alpha:.2f} (tested: the drafts "
            f"up to each round's first rejection; the {s.proposed - tested} proposed after a "
            f"rejection were never checked)")


# ---- the k sweep ----------------------------------------------------------------------------
def sweep(target, draft, prompt_ids: list[int], ks: Sequence[int] = (1, 2, 3, 4, 6), *,
          temperature: float = 0.0, new_tokens: int = 48, repeats: int = 3) -> list[SpecPoint]:
    """Measure plain vs speculative decoding (draft model) for each k (interleaved timings)."""
    out = []
    for k in ks:
        out += measure(target, [ModelDrafter(draft)], prompt_ids, k=k, new_tokens=new_tokens,
                       temperature=temperature, repeats=repeats)
    return out


def sweep_notes(points: Sequence[SpecPoint], verify: dict[int, float] | None = None,
                size_ratio: float | None = None) -> str:
    """What a k sweep measured, in sentences written from its numbers (so the text matches
    the reader's run): ranges of α, c and the speed-up, Leviathan's expectation beside the
    measurement, the cost of verification, and c against the parameter-count ratio."""
    def span(values, fmt):
        lo, hi = min(values), max(values)
        return f"{lo:{fmt}}" if f"{lo:{fmt}}" == f"{hi:{fmt}}" else f"{lo:{fmt}}–{hi:{fmt}}"

    best = max(points, key=lambda p: p.speedup)
    c = [p.cost_ratio for p in points]
    lines = [f"α (accepted ÷ tested): {span([p.alpha for p in points], '.2f')}; "
             f"c (a draft step / a target step): {span(c, '.2f')}"
             + (f" — by parameter count alone it would be 1/{size_ratio:.0f} ≈ {1 / size_ratio:.2f}"
                if size_ratio else "") + ".",
             f"Measured speed-up: {span([p.speedup for p in points], '.2f')}× (best {best.speedup:.2f}× at "
             f"k = {best.k}); Leviathan's formula with each k's α and c expected "
             f"{span([p.expected_speedup for p in points], '.2f')}×."]
    if verify:
        ks = sorted(verify)
        lines.append(f"Checking k + 1 tokens in one target pass cost {verify[ks[0]]:.2f}× a one-token "
                     f"step at k = {ks[0]} and {verify[ks[-1]]:.2f}× at k = {ks[-1]} "
                     "(the formula assumes 1×).")
    if best.speedup < 1:
        lines.append("Here no k beat plain decoding.")
    return "\n".join(lines)


def verify_cost(target, prompt_ids: list[int], ks: Sequence[int], repeats: int = 7) -> dict[int, float]:
    """Time of one target pass over k + 1 new tokens, relative to a one-token decode step.

    Leviathan et al.'s formula assumes verification is as cheap as one decode step (true when
    the weights' memory traffic dominates, as on a GPU). A small model on a CPU is partly
    compute-bound, so checking k + 1 tokens costs more.
    """
    dev = next(target.parameters()).device
    cache = StaticKVCache.for_model(target, 1, len(prompt_ids) + max(ks) + 2)
    fns = []
    with torch.inference_mode():
        target(torch.tensor([prompt_ids], device=dev), cache=cache)
    for t in [1] + [k + 1 for k in ks]:
        x = torch.tensor([prompt_ids[:1] * t], device=dev)

        def f(x=x, t=t):
            with torch.inference_mode():
                target(x, cache=cache)
            cache.rollback(t)
        fns.append(f)
    med = round_robin(fns, warmup=2, repeats=repeats, device=dev)
    return {k: m / med[0] for k, m in zip(ks, med[1:])}


def speedup_figure(points: Sequence[SpecPoint], verify: dict[int, float] | None = None,
                   k_max: int = 8) -> go.Figure:
    """Measured speed-up per k, with the analytic expectation from the measured α and c."""
    alpha = sum(p.stats.accepted for p in points) / max(
        1, sum(p.stats.accepted + p.stats.rejections for p in points))
    c = sum(p.cost_ratio for p in points) / len(points)
    ks = list(range(1, k_max + 1))
    fig = make_subplots(rows=1, cols=2, subplot_titles=("tokens per target pass", "speed-up vs plain"))
    fig.add_trace(go.Scatter(x=ks, y=[round(spec.expected_tokens_per_pass(alpha, k), 3) for k in ks],
                             mode="lines", name=f"expected, α={alpha:.2f}"), 1, 1)
    fig.add_trace(go.Scatter(x=[p.k for p in points], y=[round(p.stats.tokens_per_pass, 3) for p in points],
                             mode="markers", marker=dict(size=10), name="measured tokens/pass"), 1, 1)
    fig.add_trace(go.Scatter(x=ks, y=[round(expected_speedup(alpha, k, c), 3) for k in ks],
                             mode="lines", name=f"Leviathan: c={c:.2f}"), 1, 2)
    if verify:
        vk = sorted(verify)
        fig.add_trace(go.Scatter(
            x=vk, y=[round(spec.expected_tokens_per_pass(alpha, k) / (k * c + verify[k]), 3) for k in vk],
            mode="lines", line=dict(dash="dash"), name="+ measured verify cost"), 1, 2)
    fig.add_trace(go.Scatter(x=[p.k for p in points], y=[round(p.speedup, 3) for p in points],
                             mode="markers", marker=dict(size=10, symbol="diamond"),
                             name="measured speed-up"), 1, 2)
    reference_line(fig, y=1.0, row=1, col=2)  # 1×: no faster than plain decoding
    fig.update_xaxes(title_text="k (draft tokens per pass)")
    return style(fig, "Speculative decoding: expectation vs measurement", height=380, width=860,
                 top=80)


def point_figure(p: SpecPoint, k_max: int = 8) -> go.Figure:
    """One panel setting, one unit per axis: α (a probability), tokens per target pass, and the
    speed-up (×) measured beside Leviathan's curve over k. α has one definition throughout,
    accepted ÷ tested (:func:`alpha_line`), in the title as in the bar."""
    fig = make_subplots(rows=1, cols=3, column_widths=[0.2, 0.2, 0.6], horizontal_spacing=0.1,
                        subplot_titles=("α (probability)", "tokens per target pass",
                                        "speed-up (×): Leviathan vs measured"))
    tested = p.stats.accepted + p.stats.rejections
    fig.add_trace(go.Bar(x=[f"k={p.k}, T={p.temperature:g}"], y=[round(p.alpha, 3)],
                         showlegend=False, marker_color="#1f77b4"), 1, 1)
    fig.add_trace(go.Bar(x=[f"k={p.k}, T={p.temperature:g}"], y=[round(p.stats.tokens_per_pass, 3)],
                         showlegend=False, marker_color="#2ca02c"), 1, 2)
    fig.update_yaxes(range=[0, 1], row=1, col=1)
    fig.update_yaxes(range=[0, k_max + 1], row=1, col=2)
    ks = list(range(1, k_max + 1))
    fig.add_trace(go.Scatter(x=ks, y=[round(expected_speedup(p.alpha, k, p.cost_ratio), 3) for k in ks],
                             mode="lines", name=f"expected (α={p.alpha:.2f}, c={p.cost_ratio:.2f})"), 1, 3)
    fig.add_trace(go.Scatter(x=[p.k], y=[round(p.speedup, 3)], mode="markers",
                             marker=dict(size=12, symbol="diamond"), name="measured"), 1, 3)
    reference_line(fig, y=1.0, row=1, col=3)  # 1×: no faster than plain decoding
    fig.update_xaxes(title_text="k (draft tokens per pass)", row=1, col=3)
    return style(fig, f"{p.drafter}: α = accepted / tested = {p.stats.accepted}/{tested} = "
                      f"{p.alpha:.2f}", height=360, width=860, top=80)


def panel(target, draft, prompt_ids: list[int], new_tokens: int = 48,
          known: Sequence[SpecPoint] = ()) -> widgets.interactive:
    """Sliders k and temperature → a measured run (plain vs speculative) and its figure.

    Each setting is measured once, when first chosen (about a second on a CPU), and kept, so
    going back to it redraws at once; ``known`` points (e.g. :func:`sweep`'s, same prompt and
    length) are used as they are, so those settings never wait.
    """
    measured = {(p.k, float(p.temperature)): p for p in known}

    def figure(k: int = 4, temperature: float = 0.0) -> go.Figure:
        key = (k, float(temperature))
        if key not in measured:
            measured[key] = measure(target, [ModelDrafter(draft)], prompt_ids, k=k,
                                    new_tokens=new_tokens, temperature=temperature, warmup=0,
                                    repeats=1)[0]
        return point_figure(measured[key])

    return _panel(figure, k=control("int", "k", value=4, min=1, max=8),
                  temperature=control("float", "temperature", value=0.0, min=0.0, max=1.5,
                                      step=0.25))


# ---- predictable vs creative text -----------------------------------------------------------
DRAFTER_COLORS = {"draft": "#1f77b4", "lookup": "#ff7f0e"}


def acceptance_figure(rows: Sequence[dict]) -> go.Figure:
    """Grouped bars: α and tokens/pass per (text, drafter) row of `stats_row`-like dicts."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("α: per-token acceptance", "tokens per target pass"))
    # "text · drafter" on two lines (no slanted labels); one colour per drafter in both panels
    labels = [r["run"].replace(" · ", "<br>") for r in rows]
    colors = [DRAFTER_COLORS.get(r["run"].rsplit(" · ", 1)[-1], "#7f7f7f") for r in rows]
    for col, key in ((1, "alpha"), (2, "tokens/pass")):
        fig.add_trace(go.Bar(x=labels, y=[r[key] for r in rows], marker_color=colors,
                             showlegend=False), 1, col)
    return style(fig, "α by text and drafter: prompt lookup's rises on looping text, the draft "
                      "model's does not", height=400, width=860, top=80)


def accept_hist_figure(stats: dict[str, SpecStats]) -> go.Figure:
    """How many drafts each round accepted (0 … k), per run."""
    fig = go.Figure()
    for name, s in stats.items():
        fig.add_trace(go.Bar(x=list(range(s.k + 1)), y=s.accept_hist, name=name))
    return style(fig, "Accepted drafts per target pass", "accepted in the round", "rounds")


def rounds_figure(rounds: Sequence[int], k: int) -> go.Figure:
    """One greedy speculative run, round by round: the drafts each target pass accepted (blue)
    and the one token of the target's own that every pass adds (orange), against k + 1."""
    x = list(range(1, len(rounds) + 1))
    fig = go.Figure([
        go.Bar(x=x, y=list(rounds), name="drafts accepted", marker_color="#1f77b4"),
        go.Bar(x=x, y=[1] * len(rounds), name="the target's own token", marker_color="#ff7f0e"),
    ])
    fig.update_layout(barmode="stack", bargap=0.15)
    fig.update_yaxes(range=[0, k + 1.5], dtick=1)
    reference_line(fig, y=k + 1, text=f"most a pass can give: k + 1 = {k + 1}")
    tokens = sum(rounds) + len(rounds)
    return style(fig, f"Your loop, one bar per target pass: {tokens} tokens from {len(rounds)} "
                      f"verification passes (after the prefill's one)", "verification pass",
                 "tokens gained", width=820)


# ---- the distribution check -------------------------------------------------------------------
def toy_pair(vocab: int = 6, scale: float = 30.0) -> tuple[GPT, GPT]:
    """A tiny-vocabulary target and a *different* draft (random, sharpened weights), so exact
    probabilities can be computed by enumeration."""
    cfg = GPTConfig(vocab_size=vocab, context_length=16, n_layer=1, n_head=2, n_embd=16)
    models = []
    for seed in (0, 5):
        m = GPT.from_config(cfg, seed=seed)
        with torch.no_grad():
            for p in m.parameters():
                if p.dim() == 2:
                    p.mul_(scale)
        models.append(m.eval())
    return models[0], models[1]


def exact_last_token(model, prompt: list[int], n: int, temperature: float = 1.0) -> list[float]:
    """Exact distribution of the n-th generated token (summing over the tokens before it),
    to 3 decimals: enough to judge a sampler by 400 draws (whose own noise is ~0.02), and few
    enough that the CPU's summation order (changing the 6th or 7th digit) never shows."""
    V = model.config.vocab_size
    seqs = list(itertools.product(range(V), repeat=n - 1))
    ids = torch.tensor([list(prompt) + list(s) + [0] for s in seqs])
    with torch.inference_mode():
        lp = (model(ids)[:, len(prompt) - 1:-1] / temperature).log_softmax(-1)  # (S, n, V)
    prefix = torch.zeros(len(seqs))
    for i in range(n - 1):
        prefix += lp[torch.arange(len(seqs)), i, torch.tensor([s[i] for s in seqs])]
    last = (prefix[:, None] + lp[:, n - 1]).exp().sum(0)
    return [round(float(x), 3) for x in last]


def target_counts(model, prompt: list[int], n: int, samples: int, seed: int = 0,
                  temperature: float = 1.0) -> list[int]:
    """Counts of the n-th token over `samples` target-only generations (one batch)."""
    torch.manual_seed(seed)
    params = SamplingParams(temperature=temperature, max_new_tokens=n, ignore_eos=True)
    outs = generate(model, [list(prompt)] * samples, params)
    c = Counter(o.token_ids[n - 1] for o in outs)
    return [c[v] for v in range(model.config.vocab_size)]


def spec_counts(target, draft, prompt: list[int], n: int, samples: int, k: int = 2,
                temperature: float = 1.0,
                accept: spec.AcceptRule = spec.accept_with_ratio) -> list[int]:
    """Counts of the n-th token over `samples` seeded speculative generations.

    Each run generates n + 1 tokens, so with n = k + 1 the n-th token is the round's last draft
    (kept or replaced by the rule), not the bonus token drawn from the target itself.
    `accept`: the acceptance rule (pass `always_accept` to see a wrong one).
    """
    drafter = ModelDrafter(draft)
    c: Counter = Counter()
    for i in range(samples):
        params = SamplingParams(temperature=temperature, max_new_tokens=n + 1, ignore_eos=True,
                                seed=i)
        c[speculative_generate(target, drafter, prompt, params, k=k, accept=accept)[0].token_ids[n - 1]] += 1
    return [c[v] for v in range(target.config.vocab_size)]


def always_accept(p_d: torch.Tensor, q_d: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """A deliberately wrong acceptance rule (keep every draft), for the demonstration."""
    return torch.ones_like(p_d, dtype=torch.bool)


def tv_distance(p: Sequence[float], counts: Sequence[int]) -> float:
    """Total-variation distance between probabilities `p` and the frequencies of `counts`, to 2
    significant figures (what telling 0.02 from 0.5 needs)."""
    n = sum(counts)
    return sig(0.5 * sum(abs(a - c / n) for a, c in zip(p, counts)), 2)


def distribution_figure(exact: Sequence[float], series: dict[str, Sequence[int]]) -> go.Figure:
    """Exact target probabilities vs empirical frequencies of each sampler."""
    xs = [str(v) for v in range(len(exact))]
    fig = go.Figure(go.Bar(x=xs, y=list(exact), name="target, exact"))
    for name, counts in series.items():
        n = sum(counts)
        fig.add_trace(go.Bar(x=xs, y=[round(c / n, 4) for c in counts],
                             name=f"{name} (TV {tv_distance(exact, counts):.2g})"))
    return style(fig, "Distribution of one generated token", "token id", "probability",
                 width=860)
