"""Choosing the next token: `SamplingParams` and the logits processors.

The model outputs one logit per vocabulary entry (claim SAMP-1). A decoding strategy turns them
into one token, in this order (the order Hugging Face and vLLM use):

0. logit bias (OpenAI/vLLM `logit_bias`) added to chosen tokens' logits: -inf bans a token,
   +inf forces it (+inf tokens are drawn evenly; greedy takes the lowest such id);
1. repetition penalty (CTRL): seen tokens' logits divided by it when positive, multiplied when
   negative, so they become less likely either way;
2. temperature: logits / T — T < 1 sharpens, T > 1 flattens; T = 0 means greedy (argmax);
   T = inf is uniform over the tokens not banned;
3. top-k: keep the k largest logits (and every token tied with the k-th);
4. top-p (nucleus): keep the smallest set of most likely tokens whose probabilities reach p
   (and every token tied with the last one it needs).

Edge values never turn into NaN: a temperature so tiny (1e-45) that the division overflows is
applied as (logits - max) / T, its limit (all mass on the argmax, split between ties). A row
with nothing left to draw, or with NaN logits, is a ValueError from `sample`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from . import hooks
from .checks import check_int, check_number

INF = float("inf")
SEED_RANGE = (0, 2**64)  # what torch.Generator.manual_seed takes (as an unsigned 64-bit seed)
_F32_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop, validated on construction; names follow vLLM's.

    ``temperature=0`` is greedy. `seed` makes sampling reproducible: each prompt gets its own
    generator seeded with it, so a prompt gives the same text alone or inside a batch. Numbers
    may be NumPy scalars (stored as Python ones); ``logit_bias`` maps token ids to numbers,
    ±inf included (module doc)."""

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
        def put(name, value):
            object.__setattr__(self, name, value)

        put("stop", _as_stop(self.stop))
        put("temperature", check_number("temperature", self.temperature, ge=0, why=" (0: greedy)"))
        put("top_p", check_number("top_p", self.top_p, gt=0, le=1, why=" (1 = off)"))
        put("repetition_penalty", check_number("repetition_penalty", self.repetition_penalty,
                                               gt=0, why=" (1 = off)"))
        put("top_k", check_int("top_k", self.top_k, 0, why=" (0 = off)"))
        put("max_new_tokens", check_int("max_new_tokens", self.max_new_tokens, 1))
        if self.seed is not None:
            lo, hi = SEED_RANGE
            put("seed", check_int("seed", self.seed, lo, hi - 1,
                                  allowed="be None or an integer in [0, 2**64)"))
        put("logit_bias", _as_logit_bias(self.logit_bias))
        if not isinstance(self.ignore_eos, bool) and type(self.ignore_eos).__name__ != "bool_":
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        put("ignore_eos", bool(self.ignore_eos))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def plain_argmax(self) -> bool:
        """Greedy with nothing that can move the argmax (top-k and top-p keep it and its ties;
        a logit bias or a repetition penalty can): the raw logits' argmax is the token."""
        return self.greedy and not self.logit_bias and self.repetition_penalty == 1.0


def _as_stop(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or any(not isinstance(s, str) or not s for s in stop):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    return tuple(stop)


def _as_logit_bias(bias) -> dict[int, float]:
    if bias is None:
        return {}
    if not isinstance(bias, Mapping):
        raise ValueError(f"logit_bias must be a dict {{token id: bias}}, got {bias!r}")
    out = {}
    for tok, b in bias.items():
        tok = check_int("logit_bias keys", tok, 0, allowed="be token ids (integers >= 0)")
        out[tok] = float(check_number(f"logit_bias[{tok}]", b, why=" (±inf allowed)"))
    return out


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's penalty on ``(B, V)`` logits for the tokens marked in the bool mask `seen`
    ``(B, V)``, clamped into float32's normal range so it never acts as 0 or inf (NaN)."""
    if penalty == 1.0:
        return logits
    f32 = torch.finfo(torch.float32)
    penalty = min(max(penalty, f32.tiny), f32.max)
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def apply_forced(logits: torch.Tensor) -> torch.Tensor:
    """Rows holding a +inf logit (a +inf `logit_bias`): those tokens become 0, all others -inf,
    so only they can be drawn (evenly). Other rows are returned unchanged."""
    pos = logits == INF
    forced = pos.any(dim=-1, keepdim=True)
    return torch.where(forced, torch.zeros_like(logits).masked_fill(~pos, -INF), logits)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / T`` for T > 0, never making NaN (use after `apply_forced`: no +inf). An
    infinite T is uniform over the tokens not banned; a T so tiny that ``max / T`` overflows
    uses the shift-invariant ``(logits - max) / T``: all mass on the argmax, as T → 0."""
    if temperature > _F32_MAX:
        return logits.masked_fill(torch.isfinite(logits), 0.0)
    scaled = logits / temperature
    if temperature >= 1:
        return scaled  # |x / T| <= |x|: cannot overflow
    top = logits.amax(dim=-1, keepdim=True)
    overflow = ~torch.isfinite(top / temperature) & torch.isfinite(top)  # (B, 1)
    if logits.device.type == "cpu" and not bool(overflow.any()):  # a host read is free here
        return scaled
    shifted = torch.where(logits == top, 0.0, (logits - top) / temperature)
    return torch.where(overflow, shifted, scaled)


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row (ties at the k-th value are kept too); -inf elsewhere."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probabilities sum to at least `p`
    (always the most likely one), and every token tied with the last one the set needs, so
    which of equally likely tokens survive never depends on a sort's order."""
    if p >= 1.0:
        return logits
    sorted_logits = torch.sort(logits, dim=-1, descending=True).values
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability mass strictly before each token
    n_keep = (before < p).sum(dim=-1, keepdim=True).clamp(min=1)  # once p is reached, stop
    boundary = sorted_logits.gather(-1, n_keep - 1)  # the last logit the set needs
    return logits.masked_fill(logits < boundary, float("-inf"))


def process_logits(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None) -> torch.Tensor:
    """Bias → penalty → temperature → top-k → top-p on ``(B, V)`` logits, in float32: their
    softmax is the next token's distribution. A ±inf bias *sets* a logit (+inf forces its
    token); a row that cannot be sampled (NaN, all -inf) is a ValueError, found from the row
    maxima (read on the host on the CPU; on an accelerator only with a ±inf bias)."""
    _check_shapes(logits, seen)
    logits = logits.float()
    bias = params.logit_bias
    if bias:
        logits = _add_bias(logits, bias)
    biased = logits
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    host = logits.device.type == "cpu" or any(math.isinf(b) for b in bias.values())
    top = logits.amax(dim=-1).tolist() if host else []  # per row: NaN, +inf (forced), -inf (empty)?
    if any(math.isnan(t) or t == -INF for t in top):
        _refuse_rows(top, biased, params)
    if INF in top or not host:  # unread: apply_forced is elementwise, a no-op on rows without +inf
        logits = apply_forced(logits)
    if params.temperature > 0:
        logits = apply_temperature(logits, params.temperature)
    logits = apply_top_k(logits, params.top_k)
    return apply_top_p(logits, params.top_p)


def _check_shapes(logits: torch.Tensor, seen: torch.Tensor | None) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or 0 in logits.shape \
            or not (logits.is_floating_point()):
        raise ValueError(f"logits must be a float tensor of shape (batch, vocab), got "
                         f"{_describe(logits)}")
    if seen is not None and (not isinstance(seen, torch.Tensor) or seen.dtype != torch.bool
                             or seen.shape != logits.shape):
        raise ValueError(f"seen must be a bool tensor shaped like logits "
                         f"{tuple(logits.shape)}, got {_describe(seen)}")


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__


def _add_bias(logits: torch.Tensor, bias: dict[int, float]) -> torch.Tensor:
    V = logits.shape[-1]
    bad = [t for t in bias if t >= V]
    if bad:
        raise ValueError(f"logit_bias token id {bad[0]} outside the vocabulary [0, {V})")
    ids = torch.tensor(list(bias))
    values = torch.tensor(list(bias.values()), dtype=torch.float32)  # beyond float32: ±inf
    finite = torch.isfinite(values)
    dev = logits.device
    if bool(finite.any()):
        logits = logits.index_add(1, ids[finite].to(dev),
                                  values[finite].to(dev).expand(logits.shape[0], -1))
    for sign in (INF, -INF):  # ±inf sets the logit: -inf + inf must not become NaN
        chosen = ids[values == sign]
        if chosen.numel():
            logits = logits.index_fill(1, chosen.to(dev), sign)
    return logits


def _refuse_rows(top: list[float], biased: torch.Tensor, params: SamplingParams) -> None:
    """The ValueError for the first row with NaN logits or nothing left to draw (row maxima
    `top`), blaming what did it: `biased` is the logits before the repetition penalty."""
    for row, t in enumerate(top):
        if math.isnan(t):
            raise ValueError(f"logits of row {row} contain NaN: the model's output is broken "
                             f"(an overflow in a low-precision dtype?)")
        if t == -INF:
            bans = any(b == -INF for b in params.logit_bias.values())
            why = ("logit_bias bans (-inf) every token the model may sample" if bans
                   else "the model gives every token a logit of -inf")
            if biased[row].amax() > -INF:  # the penalty did it
                why = (f"repetition_penalty={params.repetition_penalty:g} drives every logit "
                       f"{'logit_bias does not ban ' if bans else ''}to -inf; lower it")
            raise ValueError(f"no token left to sample in row {row}: {why}")


def sample(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None,
           generators: list[torch.Generator] | None = None) -> torch.Tensor:
    """Pick one token per row of ``(B, V)`` logits; returns ``(B,)`` token ids. Rows with NaN
    logits or nothing left to draw are a ValueError (see `process_logits`)."""
    processed = process_logits(logits, params, seen)
    if generators is not None and len(generators) != processed.shape[0]:
        raise ValueError(f"generators must hold one generator per row ({processed.shape[0]}), "
                         f"got {len(generators)}")
    if params.greedy:
        return hooks.argmax(processed)
    probs = processed.softmax(dim=-1)
    if generators is None:
        return draw(probs)
    return torch.cat([draw(probs[i : i + 1], g) for i, g in enumerate(generators)])


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One index per row of ``(..., V)`` non-negative weights, drawn in proportion to them
    (zero weights never): the first index whose cumulative weight exceeds ``u × total``, for
    one uniform ``u`` per row. Unlike ``torch.multinomial``, a seed gives the same token on
    every torch version and CPU (the sums are in float64)."""
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


def seen_mask(prompts: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """``(B, V)`` bool: the tokens each row has seen so far, its prompt to begin with (the
    repetition penalty counts the prompt's tokens as seen)."""
    seen = torch.zeros(len(prompts), vocab_size, dtype=torch.bool, device=device)
    for b, ids in enumerate(prompts):
        seen[b, torch.tensor(ids, device=device)] = True
    return seen


class BatchSampler:
    """Samples one token per row of a batch, keeping what sampling needs between steps: one
    random generator per row (so a row's text is the same alone or batched) and, for the
    repetition penalty, the tokens each row has seen. ``tokens = sampler(logits)``."""

    def __init__(self, params: SamplingParams, prompts: list[list[int]], vocab: int,
                 vocab_size: int, device: torch.device) -> None:
        self.params, self.vocab = params, vocab  # `vocab`: leading entries that may be sampled
        self.generators = make_generators(params, len(prompts), device)
        self.seen = (seen_mask(prompts, vocab_size, device)  # (B, V)
                     if params.repetition_penalty != 1.0 else None)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """One token per row ``(B,)`` from next-token logits ``(B, V)``."""
        logits = mask_padded_vocab(logits, self.vocab)
        tokens = sample(logits, self.params, self.seen, self.generators)
        if self.seen is not None:
            self.seen[torch.arange(len(tokens), device=tokens.device), tokens] = True
        return tokens
