"""Did a change (quantization, an int8 KV cache) change what the model says? Three measures.

* `max_logit_diff`: the largest change of any logit over a prompt — local, exact, cheap;
* `greedy_agreement`: run both models greedily and compare the tokens — what a user would see;
  near-ties make this fragile once the two texts part (after the first different token the
  two models continue from different texts), so the first divergence is reported too;
* `validation_perplexity`: the loss on held-out text — quality over many tokens, not one prompt
  (claim QUANT-3: measure on real text).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minifer.generation import encode_prompts, generate
from minifer.sampling import SamplingParams
from minifer.tokenizer import TokenizerLike
from minifer_course.evaluate import PerplexityResult, perplexity

__all__ = ["max_logit_diff", "top1_tokens", "top1_agreement", "GreedyAgreement", "greedy_agreement",
           "validation_perplexity"]


@torch.inference_mode()
def max_logit_diff(reference: torch.nn.Module, model: torch.nn.Module, prompt,
                   tokenizer: TokenizerLike | None = None, *, last_only: bool = False) -> float:
    """max |logit_model − logit_reference| over every position and vocabulary entry of `prompt`
    (``last_only``: only the next-token logits after the prompt, the ones generation uses)."""
    ids = torch.tensor([encode_prompts(prompt, tokenizer, reference.config.vocab_size)[0]])
    a = reference(ids.to(next(reference.parameters()).device), last_only=last_only)
    b = model(ids.to(next(model.parameters()).device), last_only=last_only)
    return float((a.float().cpu() - b.float().cpu()).abs().max())


@torch.inference_mode()
def top1_tokens(model: torch.nn.Module, ids: list[int], batch_size: int = 8) -> torch.Tensor:
    """The model's most likely next token at every position of `ids` (teacher forcing), as a
    1-d CPU tensor. Long `ids` are cut into windows of the model's context, run `batch_size`
    windows per forward call (the last, shorter window alone)."""
    ctx = model.config.context_length
    device = next(model.parameters()).device
    windows = [ids[i:i + ctx] for i in range(0, len(ids), ctx)]
    out = []
    for i in range(0, len(windows), batch_size):
        group = windows[i:i + batch_size]
        full = [w for w in group if len(w) == len(group[0])]
        for rows in (full, group[len(full):]):
            if rows:
                x = torch.tensor(rows, device=device)
                out.append(model(x).argmax(-1).cpu().reshape(-1))
    return torch.cat(out)


def top1_agreement(reference: torch.nn.Module, model: torch.nn.Module, ids: list[int], *,
                   reference_top1: torch.Tensor | None = None) -> float:
    """Fraction of positions of `ids` where both models' most likely next token is the same.

    Both read the same text (teacher forcing), so one early difference does not derail the
    rest the way it does in free-running greedy generation. `reference_top1`: the reference's
    `top1_tokens` of `ids`, when several models are compared with one reference.
    """
    a = top1_tokens(reference, ids) if reference_top1 is None else reference_top1
    b = top1_tokens(model, ids)
    if a.shape != b.shape:
        raise ValueError(f"reference_top1 holds {a.numel()} positions, ids {b.numel()}")
    return float((a == b).sum()) / a.numel()


@dataclass(frozen=True)
class GreedyAgreement:
    """Greedy tokens of a reference and a model from the same prompt."""

    reference_tokens: list[int]
    tokens: list[int]

    @property
    def n(self) -> int:
        return len(self.reference_tokens)

    @property
    def agreement(self) -> float:
        """Fraction of positions with the same token (1.0 = identical output)."""
        same = sum(a == b for a, b in zip(self.reference_tokens, self.tokens))
        return same / max(self.n, 1)

    @property
    def identical(self) -> bool:
        return self.tokens == self.reference_tokens

    @property
    def first_divergence(self) -> int | None:
        """Index of the first different token, None when identical."""
        return next((i for i, (a, b) in enumerate(zip(self.reference_tokens, self.tokens))
                     if a != b), None)


def greedy_agreement(reference: torch.nn.Module, model: torch.nn.Module, prompt, n: int = 32,
                     tokenizer: TokenizerLike | None = None, *, kv_dtype=None,
                     reference_tokens: list[int] | None = None) -> GreedyAgreement:
    """Generate `n` greedy tokens with both models (EOS ignored) and compare them.

    `kv_dtype` applies to `model` only (e.g. ``"int8"`` to test the int8 KV cache);
    `reference_tokens` skips re-running the reference.
    """
    params = SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)
    ids = encode_prompts(prompt, tokenizer, reference.config.vocab_size)[0]
    if reference_tokens is None:
        reference_tokens = generate(reference, ids, params)[0].token_ids
    tokens = generate(model, ids, params, kv_dtype=kv_dtype)[0].token_ids
    return GreedyAgreement(list(reference_tokens), tokens)


def validation_perplexity(model: torch.nn.Module, tokenizer: TokenizerLike,
                          text: str | None = None, max_chars: int | None = None,
                          **kwargs) -> PerplexityResult:
    """`perplexity` on held-out Shakespeare (or `text`), optionally its first `max_chars`."""
    if text is None:
        from minifer.pretrained import load_validation_text
        text = load_validation_text()
    if max_chars is not None:
        text = text[:max_chars]
    return perplexity(model, tokenizer, text, **kwargs)
