"""What `LLMEngine.add_request` takes beyond a prompt and `SamplingParams`, checked, and the two
things those options do inside a step.

- ``priority``: at most ``PRIORITY_LIMIT`` = 2**53 either way (the scheduler's floats exact);
- ``logprobs``: each sampled token's logprob and that many alternatives (`record_logprobs`);
- ``min_tokens``: no end-of-sequence token before that many tokens (`ban_early_eos`).

A prompt is text, a list of token ids or a 1-D tensor (not a bare integer)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..checks import check_int, check_number
from ..sampling import SamplingParams
from ..sequence import Sequence as SequenceState
from ..sequence import check_context, check_types, eos_ids, prompt_ids, usable_vocab
from .logprobs import MAX_TOP_LOGPROBS, token_logprobs
from .scheduler import PRIORITY_LIMIT

__all__ = ["prepare_request", "check_request", "check_options", "ban_early_eos", "record_logprobs",
           "generate_arguments"]


def generate_arguments(prompts, params) -> tuple[list, list]:
    """``generate(prompts, params)``'s arguments as a list of prompts and one `SamplingParams`
    per prompt: one `SamplingParams` (None: the defaults) is shared, so its rows sample together."""
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                    and all(isinstance(p, int) for p in prompts)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of prompts (texts or id lists)")
    if params is None or isinstance(params, SamplingParams):
        params = [SamplingParams() if params is None else params] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
    return list(prompts), list(params)


def prepare_request(model, tokenizer, prompt, params: SamplingParams | None, *,
                    priority: int = 0, arrival_time: float | None = None,
                    request_id: str | None = None, logprobs: int | None = None,
                    min_tokens: int = 0, max_model_len: int | None = None):
    """The one check of a request, for every front: its `Sequence` and the vocabulary it may
    sample from, or a ValueError naming what is wrong (`model` is checked once by the front)."""
    check_request(prompt, priority)
    if arrival_time is not None:
        check_number("arrival_time", arrival_time, finite=True,
                     why=" (time.perf_counter() seconds)")
    if request_id is not None and (not isinstance(request_id, str) or not request_id):
        raise ValueError(f"request_id must be a non-empty string, got {request_id!r:.60}")
    params = SamplingParams() if params is None else params
    check_types(params, tokenizer)
    cfg = model.config
    ids = prompt_ids(0, prompt, tokenizer, cfg.vocab_size)
    vocab = usable_vocab(cfg, tokenizer, params)
    windows = {"model": cfg.context_length, "max_model_len": max_model_len or cfg.context_length}
    check_context(0, len(ids), params.max_new_tokens, windows)
    seq = SequenceState(0, ids, params, tokenizer, eos_ids(cfg, tokenizer))
    check_options(seq, logprobs, min_tokens)
    return seq, vocab


def check_request(prompt, priority) -> None:
    """ValueErrors naming `priority` or `prompt` (before the prompt is encoded)."""
    check_int("priority", priority, -PRIORITY_LIMIT, PRIORITY_LIMIT,
              allowed="be an integer in [-2**53, 2**53]", why=" (lower = served first)")
    if isinstance(prompt, (list, tuple)) and not all(hasattr(p, "__index__") for p in prompt):
        raise ValueError("add_request takes one prompt (text or a flat list of token ids); "
                         "use generate() for a list of prompts")
    if not isinstance(prompt, (str, list, tuple, torch.Tensor)) or (
            isinstance(prompt, torch.Tensor) and prompt.dim() != 1):
        raise ValueError(f"prompt must be text, a list of token ids or a 1-D tensor of them, "
                         f"got {type(prompt).__name__} {prompt!r:.60}")


def check_options(seq, logprobs: int | None, min_tokens: int) -> None:
    """Check ``logprobs`` and ``min_tokens`` for a prepared `Sequence`; set its `min_tokens`."""
    if logprobs is not None:
        check_int("logprobs", logprobs, 0, MAX_TOP_LOGPROBS,
                  allowed=f"be None or an integer in [0, {MAX_TOP_LOGPROBS}]")
    n = seq.params.max_new_tokens
    check_int("min_tokens", min_tokens, 0, n, allowed=f"be an integer in [0, max_new_tokens={n}]")
    if min_tokens and any(seq.params.logit_bias.get(t) == float("inf") for t in seq.eos_ids):
        raise ValueError("min_tokens bans the end-of-sequence token that logit_bias forces")
    seq.min_tokens = min_tokens


def ban_early_eos(logits: torch.Tensor, seqs: Sequence) -> None:
    """Rows of ``logits (B, V)`` whose sequence has fewer than ``min_tokens`` tokens: their
    end-of-sequence token gets -inf (in place), so it cannot be sampled yet."""
    for row, seq in enumerate(seqs):
        if seq.eos_ids and len(seq.output_ids) < seq.min_tokens:
            logits[row, list(seq.eos_ids)] = float("-inf")


def record_logprobs(logits: torch.Tensor, requests: Sequence, picked: Sequence[int]) -> None:
    """Append each request's `TokenLogprob` for its `picked` token, for those that asked
    (``request.logprobs`` is a list). `logits`: the rows' raw (vocabulary-masked) logits."""
    rows = [j for j, r in enumerate(requests) if r.logprobs is not None]
    if not rows:
        return
    scored = token_logprobs(logits[rows], [picked[j] for j in rows],
                            [requests[j].num_logprobs for j in rows])
    for j, lp in zip(rows, scored):
        requests[j].logprobs.append(lp)
