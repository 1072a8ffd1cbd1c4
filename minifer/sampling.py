"""Choosing the next token: `SamplingParams` and the logits processors.

The model outputs one logit per vocabulary entry (claim SAMP-1). A decoding strategy turns them
into one token, in this order (the order Hugging Face and vLLM use):

0. logit bias (OpenAI/vLLM `logit_bias`): a fixed number added to chosen tokens' logits, e.g.
   -inf to ban a token;
1. repetition penalty (CTRL): logits of tokens already seen are divided by the penalty when
   positive and multiplied by it when negative, so they become less likely either way;
2. temperature: logits / T — T < 1 sharpens, T > 1 flattens; T = 0 means greedy (argmax);
3. top-k: keep the k largest logits;
4. top-p (nucleus): keep the smallest set of most likely tokens whose probabilities reach p.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop; validated on construction.

    Names follow vLLM so what you learn here transfers. ``temperature=0`` is greedy decoding.
    `seed` makes sampling reproducible: each prompt gets its own generator seeded with it, so a
    prompt gives the same text alone or inside a batch.
    """

    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    repetition_penalty: float = 1.0  # 1 = off
    max_new_tokens: int = 16
    stop: tuple[str, ...] = field(default=())
    seed: int | None = None
    ignore_eos: bool = False  # keep going past the end-of-sequence token (benchmarks)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        _check_number("temperature", self.temperature, "≥ 0", lambda t: t >= 0)
        _check_number("top_p", self.top_p, "in (0, 1]", lambda p: 0 < p <= 1)
        _check_number("repetition_penalty", self.repetition_penalty, "> 0", lambda r: r > 0)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer ≥ 0 (0 = off), got {self.top_k!r}")
        if (isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int)
                or self.max_new_tokens < 1):
            raise ValueError(f"max_new_tokens must be an integer ≥ 1, got {self.max_new_tokens!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        for tok, bias in dict(self.logit_bias).items():
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers ≥ 0), got {tok!r}")
            _check_number(f"logit_bias[{tok}]", bias, "a number", lambda b: True)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def plain_argmax(self) -> bool:
        """Greedy with nothing that can move the argmax: the raw logits' argmax is the token.

        Top-k keeps the largest logit (and every tie with it); a logit bias, a repetition penalty
        or top-p (which may cut between tied top tokens) can change it.
        """
        return (self.greedy and not self.logit_bias and self.repetition_penalty == 1.0
                and self.top_p == 1.0)


def _check_number(name: str, value, allowed: str, ok) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or not ok(value):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's penalty on ``(B, V)`` logits for the tokens marked in the boolean mask `seen` ``(B, V)``."""
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row (ties at the k-th value are kept too); -inf elsewhere."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probabilities sum to at least `p`."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability mass strictly before each token
    drop_sorted = before >= p  # once p is reached, drop the rest (the top token is always kept)
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def process_logits(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None) -> torch.Tensor:
    """Bias → penalty → temperature → top-k → top-p on ``(B, V)`` logits, in float32.

    Returns the processed logits; their softmax is the distribution the next token is drawn from.
    Greedy (T = 0) skips temperature: argmax of the processed logits is the greedy choice.
    """
    logits = logits.float()
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=logits.device)
        bias = torch.tensor(list(params.logit_bias.values()), device=logits.device)
        logits = logits.index_add(1, ids, bias.expand(logits.shape[0], -1))
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if params.temperature > 0:
        logits = logits / params.temperature
    logits = apply_top_k(logits, params.top_k)
    return apply_top_p(logits, params.top_p)


def sample(
    logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None,
    generators: list[torch.Generator] | None = None,
) -> torch.Tensor:
    """Pick one token per row of ``(B, V)`` logits; returns ``(B,)`` token ids."""
    processed = process_logits(logits, params, seen)
    if params.greedy:
        return processed.argmax(dim=-1)
    probs = processed.softmax(dim=-1)
    if generators is None:
        return draw(probs)
    return torch.cat([draw(probs[i : i + 1], g) for i, g in enumerate(generators)])


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One index per row of ``(..., V)`` non-negative weights, drawn in proportion to them.

    Inverse CDF on one uniform number per row: the first index whose cumulative weight exceeds
    ``u × total``. Unlike ``torch.multinomial``, whose algorithm (and so the token a seed gives)
    changed between torch releases, this gives the same token for the same seed on every torch
    version (``torch.rand``'s stream is stable) and every CPU (the sums are in float64, so only a
    draw within ~1e-16 of a boundary could land differently). Zero weights are never drawn.
    """
    dtype = torch.float32 if probs.device.type == "mps" else torch.float64  # MPS has no float64
    cdf = probs.to(dtype).cumsum(-1)
    u = torch.rand((*probs.shape[:-1], 1), generator=generator, dtype=dtype, device=probs.device)
    idx = torch.searchsorted(cdf, u * cdf[..., -1:], right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def mask_padded_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Set the logits of entries past the first `vocab` to -inf, in place, so they are never
    sampled: models pad their vocabulary beyond the tokenizer's (see `sequence.usable_vocab`)."""
    if vocab < logits.shape[-1]:
        logits[..., vocab:] = float("-inf")
    return logits


def make_generators(params: SamplingParams, batch: int, device: torch.device) -> list[torch.Generator] | None:
    """One generator per row, each seeded with `params.seed` (None: use torch's global RNG)."""
    if params.seed is None or params.greedy:
        return None
    return [torch.Generator(device=device).manual_seed(params.seed) for _ in range(batch)]
