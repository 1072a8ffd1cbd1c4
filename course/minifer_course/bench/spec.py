"""Speculative decoding, measured: ``python -m minifer_course.bench spec``.

Tokens/s of plain greedy decoding and of speculative decoding (the shipped draft model, and
draft-free prompt lookup) on the shipped Shakespeare pair, batch 1, in the same run. Runs are
interleaved (plain, draft, lookup, plain, …) so a busy machine slows all of them alike, and each
figure is the median after warm-up. Next to the measurement: the acceptance rate α, tokens per
target pass, the cost ratio c = draft pass / target decode step, and Leviathan et al.'s expected
speed-up (1 − α^(k+1)) / ((1 − α)(k·c + 1)) — which assumes that verifying k + 1 tokens costs
the same as decoding one; where that fails (a small model on a CPU) the measurement falls short.

The functions are importable so the lesson measures exactly as the command does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minifer.generation import generate
from minifer.sampling import SamplingParams
from minifer.speculative import (
    Drafter,
    ModelDrafter,
    PromptLookupDrafter,
    SpecStats,
    expected_speedup,
    expected_tokens_per_pass,
    speculative_generate,
)

from .reference import SPEC
from .timing import round_robin

__all__ = ["REFERENCE", "PROMPT", "SpecPoint", "measure", "run", "format_report"]

REFERENCE = SPEC  # claim SPEC-3's reference run

PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?\n"


@dataclass(frozen=True)
class SpecPoint:
    """One configuration measured against plain decoding of the same length."""

    drafter: str
    k: int
    temperature: float
    stats: SpecStats  # of one run (the last)
    plain_s: float  # median wall time of plain decoding
    spec_s: float  # median wall time of speculative decoding

    @property
    def tokens(self) -> int:
        return self.stats.tokens

    @property
    def speedup(self) -> float:
        return self.plain_s / self.spec_s

    @property
    def plain_tok_s(self) -> float:
        return self.tokens / self.plain_s

    @property
    def spec_tok_s(self) -> float:
        return self.tokens / self.spec_s

    @property
    def alpha(self) -> float:
        return self.stats.alpha

    @property
    def cost_ratio(self) -> float:
        """c: one draft forward pass / one plain decode step of the target (0 for prompt lookup)."""
        s = self.stats
        if s.draft_passes == 0:
            return 0.0
        return (s.draft_time_s / s.draft_passes) / (self.plain_s / self.tokens)

    @property
    def expected_tokens_per_pass(self) -> float:
        return expected_tokens_per_pass(self.alpha, self.k)

    @property
    def expected_speedup(self) -> float:
        return expected_speedup(self.alpha, self.k, self.cost_ratio)


def measure(target, drafters: Sequence[Drafter], prompt_ids: list[int], *, k: int = 4,
            new_tokens: int = 80, temperature: float = 0.0, seed: int = 0,
            warmup: int = 1, repeats: int = 5) -> list[SpecPoint]:
    """Plain vs speculative decoding with each drafter, interleaved; one `SpecPoint` each.

    Timed round-robin (plain, each drafter, plain, …) with the models' device synchronised.
    """
    params = SamplingParams(temperature=temperature, max_new_tokens=new_tokens, ignore_eos=True,
                            seed=None if temperature == 0 else seed)
    last: dict[int, SpecStats] = {}

    def plain():
        return generate(target, prompt_ids, params)

    def spec_fn(i, d):
        def f():
            last[i] = speculative_generate(target, d, prompt_ids, params, k=k)[0].stats
        return f

    with torch.inference_mode():
        medians = round_robin([plain] + [spec_fn(i, d) for i, d in enumerate(drafters)],
                              warmup=warmup, repeats=repeats, device=next(target.parameters()).device)
    return [SpecPoint(d.name, k, temperature, last[i], medians[0], medians[i + 1])
            for i, d in enumerate(drafters)]


def run(*, k: int = 4, new_tokens: int = 80, repeats: int = 5, prompt: str = PROMPT,
        ks: Sequence[int] = (1, 2, 3, 4)) -> dict:
    """The benchmark on the shipped pair: a k sweep for the draft model, prompt lookup at `k`."""
    from minifer.pretrained import load_pretrained

    target, tok = load_pretrained("shakespeare")
    draft, _ = load_pretrained("shakespeare-draft")
    ids = tok.encode(prompt)
    sweep = []
    for kk in ks:
        sweep += measure(target, [ModelDrafter(draft)], ids, k=kk, new_tokens=new_tokens,
                         repeats=repeats)
    main = measure(target, [ModelDrafter(draft), PromptLookupDrafter()], ids, k=k,
                   new_tokens=new_tokens, repeats=repeats)
    return {"target_params": target.num_params(), "draft_params": draft.num_params(),
            "prompt_tokens": len(ids), "sweep": sweep, "main": main,
            "threads": torch.get_num_threads()}


def format_report(r: dict) -> str:
    ref = REFERENCE
    lines = [
        f"speculative decoding, shipped pair: target {r['target_params']:,} params, draft "
        f"{r['draft_params']:,} ({r['target_params'] / r['draft_params']:.0f}x smaller); "
        f"greedy, batch 1, {r['prompt_tokens']}-token prompt, {r['threads']} threads",
        f"  (claim SPEC-3 reference: draft {ref['draft_params']:,}, target "
        f"{ref['target_params']:,}, k={ref['k']}: {ref['tokens']} tokens in "
        f"{ref['target_passes']} target passes, {ref['accepted']} accepted)",
        "  drafter                                k  tokens  passes  accepted/proposed  alpha  "
        "tok/pass  c      plain tok/s  spec tok/s  speed-up  expected",
    ]
    for p in list(r["sweep"]) + list(r["main"]):
        s = p.stats
        lines.append(
            f"  {p.drafter[:37]:37}  {p.k:>2}  {p.tokens:>6}  {s.target_passes:>6}  "
            f"{s.accepted:>8}/{s.proposed:<8}  {p.alpha:5.2f}  {s.tokens_per_pass:8.2f}  "
            f"{p.cost_ratio:5.3f}  {p.plain_tok_s:11.1f}  {p.spec_tok_s:10.1f}  "
            f"x{p.speedup:7.2f}  x{p.expected_speedup:6.2f}")
    return "\n".join(lines)
