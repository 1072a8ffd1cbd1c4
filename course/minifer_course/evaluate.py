"""How good is a language model on a text? Loss per token, per character, and perplexity.

The model assigns each next token a probability; the loss of a text is the average of
``-log p(token | tokens before it)`` in nats. Two views of that number:

- **nats per token** and its exponential, **perplexity** (``e^loss``: as unsure as a uniform
  choice among that many tokens). Both depend on the tokenizer: a tokenizer with longer tokens
  has fewer, harder predictions.
- **nats per character**: total nats divided by the number of characters. Comparable across
  tokenizers (a byte-level model and a BPE model of the same text can be compared with it).

A text longer than the context window is scored with *sliding windows*: each window sees up to
`context` tokens and scores only the tokens not scored by the previous window, so every token
is scored once and (except in the first window) with at least ``context - stride`` tokens of
history. A smaller stride gives more history per token but costs more forward passes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minifer.checks import check_int
from minifer.tokenizer import TokenizerLike


@dataclass(frozen=True)
class PerplexityResult:
    """Loss of a model on a text. ``nats_per_token`` is the mean cross-entropy."""

    nats_per_token: float
    nats_per_char: float
    perplexity: float  # exp(nats_per_token)
    tokens: int  # tokens scored
    chars: int  # characters those tokens cover

    @property
    def bits_per_char(self) -> float:
        return self.nats_per_char / math.log(2)


def score_windows(n: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """Windows over a sequence of `n` ids that score targets 1..n-1 once each.

    Returns ``(begin, end, first_new)``: the window feeds ids ``[begin, end)`` and scores the
    predictions of targets ``first_new..end-1`` (target t is predicted from ids before t).
    """
    out = []
    scored = 0  # targets 1..scored are done
    begin = 0
    while scored < n - 1:
        end = min(begin + context + 1, n)  # context inputs predict up to `context` targets
        out.append((begin, end, scored + 1))
        scored = end - 1
        begin += stride
        begin = min(begin, max(n - context - 1, 0)) if end < n else begin
    return out


@torch.inference_mode()
def perplexity(
    model: torch.nn.Module,
    tokenizer: TokenizerLike,
    text: str,
    context: int | None = None,
    stride: int | None = None,
    batch_size: int = 8,
) -> PerplexityResult:
    """Score `text` with `model`: nats per token and per character, and perplexity.

    If the tokenizer has an end-of-text token it is put in front of the text (as it is between
    documents in training), so every token of the text is scored and all its characters count.
    `context` defaults to the model's context window, `stride` to half of `context`. Runs on the
    model's device and dtype; the loss is summed in float64.
    """
    if not isinstance(text, str) or not text:
        raise ValueError("text must be a non-empty str")
    max_ctx = model.config.context_length
    context = max_ctx if context is None else context
    check_int("context", context, 1, max_ctx, why=" (the model's window)")
    stride = max(context // 2, 1) if stride is None else stride
    check_int("stride", stride, 1, context, why=f" (context={context})")
    check_int("batch_size", batch_size, 1)

    ids = tokenizer.encode(text)
    if tokenizer.eos_token_id is not None:
        ids = [tokenizer.eos_token_id, *ids]
        chars = len(text)
    else:  # the first token has nothing to be predicted from: its characters do not count
        chars = len(text) - len(tokenizer.decode(ids[:1]))
    if len(ids) < 2 or chars < 1:
        raise ValueError("text is too short to score (it needs at least two tokens)")

    device = next(model.parameters()).device
    seq = torch.tensor(ids, dtype=torch.long, device=device)
    windows = score_windows(len(ids), context, stride)
    total = 0.0
    for i in range(0, len(windows), batch_size):
        total += _score_batch(model, seq, windows[i : i + batch_size])
    tokens = len(ids) - 1
    nats = total / tokens
    return PerplexityResult(nats, total / chars, math.exp(nats), tokens, chars)


def _score_batch(model, seq: torch.Tensor, windows: list[tuple[int, int, int]]) -> float:
    """Summed loss of the new targets of some windows (windows of unequal length run one by one)."""
    total = 0.0
    lengths = {end - begin for begin, end, _ in windows}
    groups = [windows] if len(lengths) == 1 else [[w] for w in windows]
    for group in groups:
        x = torch.stack([seq[b : e - 1] for b, e, _ in group])  # (B, T) inputs
        y = torch.stack([seq[b + 1 : e] for b, e, _ in group])  # (B, T) targets
        logits = model(x).float()  # (B, T, vocab)
        loss = F.cross_entropy(logits.transpose(1, 2), y, reduction="none")  # (B, T)
        for row, (b, _e, first_new) in enumerate(group):
            total += loss[row, first_new - 1 - b :].double().sum().item()
    return total
