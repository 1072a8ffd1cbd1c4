"""Log-probabilities of tokens under the model: what OpenAI's ``logprobs`` fields report.

A token's logprob is the log-softmax of the model's raw logits over the tokenizer's vocabulary,
before any sampling option shapes them: the model's own belief, as vLLM reports it by default.
`token_logprobs` scores one engine step's sampled tokens; `prompt_logprobs` every prompt token
but the first (OpenAI's ``echo`` with ``logprobs``), in one extra forward pass."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["TokenLogprob", "token_logprobs", "prompt_logprobs", "MAX_TOP_LOGPROBS"]

MAX_TOP_LOGPROBS = 20  # most alternatives per token (vLLM's default --max-logprobs)


@dataclass(frozen=True)
class TokenLogprob:
    """One token's logprob and the `top` most likely tokens at its position, most likely first
    (``(token id, logprob)`` pairs; empty when no alternatives were asked for)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], num_top: Sequence[int],
                   vocab: int | None = None) -> list[TokenLogprob]:
    """Row ``i`` of ``logits (B, V)`` scored at ``tokens[i]``, with ``num_top[i]`` alternatives,
    in one device→host copy. `vocab`: leading entries that are real tokens (the rest -inf)."""
    if logits.dim() != 2 or logits.shape[0] != len(tokens) or len(tokens) != len(num_top):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(tokens)} tokens")
    lg = logits.float()
    if vocab is not None and vocab < lg.shape[-1]:
        lg = lg.clone()
        lg[:, vocab:] = float("-inf")
    lp = torch.log_softmax(lg, dim=-1)
    idx = torch.tensor(list(tokens), dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, idx[:, None])[:, 0].tolist()
    k = min(max(num_top, default=0), lp.shape[-1])
    top_v, top_i = (t.tolist() for t in lp.topk(k, dim=-1)) if k > 0 else (None, None)
    return [TokenLogprob(int(tok), lpv,
                         tuple(zip(top_i[row][:n], top_v[row][:n])) if n and k > 0 else ())
            for row, (tok, lpv, n) in enumerate(zip(tokens, chosen, num_top))]


def prompt_logprobs(model: torch.nn.Module, prompt_ids: Sequence[int], num_top: int,
                    vocab: int | None = None, device=None) -> list[TokenLogprob | None]:
    """Each prompt token's logprob given the tokens before it (``None`` for the first, which
    has no context), with `num_top` alternatives: one forward pass over the prompt."""
    ids = list(prompt_ids)
    if not ids:
        return []
    device = next(model.parameters()).device if device is None else device
    with torch.inference_mode():
        x = torch.tensor([ids], dtype=torch.long, device=device)
        logits = model(x)[0, :-1]  # position p predicts token p + 1
        scored = token_logprobs(logits, ids[1:], [num_top] * (len(ids) - 1), vocab) \
            if len(ids) > 1 else []
    return [None, *scored]
