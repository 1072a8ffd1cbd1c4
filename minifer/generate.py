"""The generation loop: tokenize → prefill → (sample → append → decode)* → stop.

`prefill` runs every prompt token through the model in one parallel pass and fills the KV cache;
`decode_step` feeds one token per sequence and reads everything else from the cache. `generate`
drives them for a batch of prompts and returns one `Completion` each; `stream` yields each token
the moment it exists (claim REQ-1).

Prompts of different lengths share a batch by *left padding*: row b's real tokens start at slot
``start[b]`` and the attention mask hides the padding, so every row computes exactly what it
would compute alone.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from .cache import StaticKVCache
from .device import sync
from .sampling import SamplingParams, make_generators, sample
from .tokenizer import TokenizerLike

Prompt = str | Sequence[int]


# ---- the two kinds of forward pass ---------------------------------------------------------
def prefill(model: torch.nn.Module, ids: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
    """Run all prompt tokens ``(B, T)`` in one pass, writing their K/V into `cache`.

    Call ``cache.reset(start)`` first for a new batch. Returns the next-token logits ``(B, V)``.
    """
    return model(ids, cache=cache, last_only=True)[:, -1]


def decode_step(model: torch.nn.Module, tokens: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
    """Feed one new token per row ``(B,)``; attention reads all earlier tokens from `cache`.

    The shapes are the same at every step (B×1 in, B×V out), which is what lets a GPU capture
    the step once as a CUDA graph.
    """
    return model(tokens.view(-1, 1), cache=cache)[:, -1]


# ---- results -------------------------------------------------------------------------------
@dataclass
class TokenEvent:
    """One streamed token of prompt `index`: its id, the new text it releases, when it came."""

    index: int
    token_id: int
    text: str  # may be "" while the bytes or a possible stop string are held back
    time: float  # seconds since the request started
    finish_reason: str | None = None  # set on the row's last event: "eos", "stop" or "length"


@dataclass
class Completion:
    """The result for one prompt: tokens, text, why it stopped, usage and timings."""

    index: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None  # None without a tokenizer
    finish_reason: str | None = None  # "eos" | "stop" | "length"
    token_times: list[float] = field(default_factory=list)  # seconds since start, per token

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def ttft(self) -> float:
        """Time to first token (s): prefill plus the first sampling step."""
        return self.token_times[0] if self.token_times else float("nan")

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies (s): the gaps between consecutive tokens."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first (s)."""
        gaps = self.itl
        return sum(gaps) / len(gaps) if gaps else float("nan")

    @property
    def e2e(self) -> float:
        """End-to-end latency (s) until the last token."""
        return self.token_times[-1] if self.token_times else float("nan")


# ---- stop strings on text ------------------------------------------------------------------
class TextStopper:
    """Detokenizes one row incrementally and matches stop strings on the text.

    Stop strings are matched on text, not token ids, because a stop string can be split across
    tokens in many ways. Text that could still turn out to be the start of a stop string is held
    back, so a reader never sees part of a stop string that is later cut away.
    """

    def __init__(self, tokenizer: TokenizerLike, stop: Sequence[str]) -> None:
        self.detok = tokenizer.detokenizer()
        self.stop = tuple(stop)
        self.pending = ""
        self.stopped = False

    def feed(self, token_id: int) -> str:
        """Text released by this token ("" while held back). Sets `stopped` on a stop string."""
        return self._release(self.pending + self.detok.feed(token_id), final=False)

    def flush(self) -> str:
        """End of generation: release everything still held (REQ-3)."""
        return self._release(self.pending + self.detok.flush(), final=True)

    def _release(self, buf: str, final: bool) -> str:
        hits = [i for i in (buf.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped, self.pending = True, ""
            return buf[: min(hits)]
        hold = 0 if final else self._held_suffix(buf)
        self.pending = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold]

    def _held_suffix(self, buf: str) -> int:
        """Length of the longest end of `buf` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if s.startswith(buf[-k:]):
                    best = k
                    break
        return best


# ---- input checks --------------------------------------------------------------------------
def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() == 1:
            prompts = prompts.unsqueeze(0)
        if prompts.dim() != 2:
            raise ValueError(f"a prompt tensor must be 1-D or 2-D, got shape {tuple(prompts.shape)}")
        if prompts.is_floating_point() or prompts.dtype == torch.bool:
            raise ValueError(f"prompt token ids must be integers, got dtype {prompts.dtype}")
        return prompts.tolist()
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be a string, a list of token ids, or a non-empty list of those")
    if all(not isinstance(p, (str, Sequence, torch.Tensor)) for p in prompts):
        return [list(prompts)]  # one prompt given as a flat list of ids
    return list(prompts)


def encode_prompts(prompts, tokenizer: TokenizerLike | None, vocab_size: int) -> list[list[int]]:
    """Token ids for each prompt, with clear errors for anything the model cannot take."""
    out = []
    for i, p in enumerate(_as_prompt_list(prompts)):
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError(f"prompt {i} is text but no tokenizer was given; pass tokenizer=")
            ids = tokenizer.encode(p)
        else:
            if isinstance(p, torch.Tensor):
                if p.is_floating_point():
                    raise ValueError(f"prompt {i}: token ids must be integers, got dtype {p.dtype}")
                p = p.tolist()
            ids = list(p)
            bad = next((t for t in ids if isinstance(t, bool) or not hasattr(t, "__index__")), None)
            if bad is not None:
                raise ValueError(f"prompt {i}: token ids must be integers, got {type(bad).__name__} {bad!r}")
            ids = [int(t) for t in ids]
        if not ids:
            raise ValueError(f"prompt {i} is empty: give at least one token")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i}: token id {bad[0]} outside the vocabulary [0, {vocab_size})")
        out.append(ids)
    return out


def _check_lengths(prompts: list[list[int]], params: SamplingParams, context: int) -> None:
    for i, ids in enumerate(prompts):
        if len(ids) + params.max_new_tokens > context:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens; with max_new_tokens={params.max_new_tokens} that is "
                f"{len(ids) + params.max_new_tokens} > the context window of {context} tokens"
            )


# ---- the loop ------------------------------------------------------------------------------
def stream(
    model: torch.nn.Module,
    prompts,
    params: SamplingParams | None = None,
    tokenizer: TokenizerLike | None = None,
    *,
    use_cache: bool = True,
    device: torch.device | str | None = None,
    completions: list[Completion] | None = None,
    kv_dtype: torch.dtype | str | None = None,
) -> Iterator[TokenEvent]:
    """Yield a `TokenEvent` for every generated token of every prompt, as soon as it exists.

    Pass a list as `completions` to have it filled with the final `Completion`s.
    `use_cache=False` recomputes the whole sequence at every step: the reference path.
    `kv_dtype`: the KV cache's dtype (default: the model's); ``"int8"`` quantizes the cache.
    """
    params = params or SamplingParams()
    cfg = model.config
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if params.stop and tokenizer is None:
        raise ValueError("stop strings are matched on text: pass tokenizer= to use stop")
    ids_list = encode_prompts(prompts, tokenizer, cfg.vocab_size)
    vocab = _usable_vocab(cfg, tokenizer, params)
    _check_lengths(ids_list, params, cfg.context_length)
    B, T = len(ids_list), max(len(p) for p in ids_list)
    total = T + params.max_new_tokens
    start = torch.tensor([T - len(p) for p in ids_list], dtype=torch.long)
    buf = torch.zeros(B, total, dtype=torch.long)  # left-padded prompts, then generated tokens
    for b, p in enumerate(ids_list):
        buf[b, T - len(p):T] = torch.tensor(p)
    buf = buf.to(device)
    padded = bool((start > 0).any())
    start = start.to(device)

    results = [Completion(index=b, prompt_token_ids=p) for b, p in enumerate(ids_list)]
    if completions is not None:  # the caller's list may already hold earlier results
        completions.extend(results)
    stoppers = [TextStopper(tokenizer, params.stop) if tokenizer is not None else None for _ in range(B)]
    texts: list[list[str]] = [[] for _ in range(B)]
    eos = None if params.ignore_eos else _eos_id(cfg, tokenizer)
    gens = make_generators(params, B, device)
    seen = None
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(B, cfg.vocab_size, dtype=torch.bool, device=device)
        for b, p in enumerate(ids_list):  # the prompt's tokens count as already seen
            seen[b, torch.tensor(p, device=device)] = True
    active = [True] * B

    with torch.inference_mode():
        t0 = time.perf_counter()
        if use_cache:
            cache = StaticKVCache.for_model(model, B, total, dtype=kv_dtype, device=device)
            cache.reset(start)
            logits = prefill(model, buf[:, :T], cache)
        else:
            logits = model(buf[:, :T], start=start if padded else None, last_only=True)[:, -1]
        for step in range(params.max_new_tokens):
            if vocab < cfg.vocab_size:  # rows past the tokenizer's vocabulary are padding
                logits[:, vocab:] = float("-inf")
            tokens = sample(logits, params, seen, gens)
            host = tokens.tolist()  # waits for the device: the token now exists
            now = time.perf_counter() - t0
            buf[:, T + step] = tokens
            if seen is not None:
                seen[torch.arange(B, device=device), tokens] = True
            last_step = step == params.max_new_tokens - 1
            for b in range(B):
                if not active[b]:
                    continue
                event = _advance_row(results[b], stoppers[b], host[b], now, eos, last_step)
                if stoppers[b] is not None:
                    texts[b].append(event.text)
                if event.finish_reason is not None:
                    active[b] = False
                    if stoppers[b] is not None:
                        results[b].text = "".join(texts[b])
                yield event
            if not any(active):
                break
            if use_cache:
                logits = decode_step(model, tokens, cache)
            else:
                seq = buf[:, : T + step + 1]
                logits = model(seq, start=start if padded else None, last_only=True)[:, -1]
        sync(device)


def _usable_vocab(cfg, tokenizer: TokenizerLike | None, params: SamplingParams) -> int:
    """How many leading vocabulary entries may be sampled.

    Models often pad their vocabulary (to a multiple of 64, or here the reference model's 1,024
    entries with a 257-token byte tokenizer); tokens past the tokenizer's vocabulary mean nothing,
    so they are never sampled.
    """
    vocab = cfg.vocab_size
    if tokenizer is not None:
        if tokenizer.vocab_size > cfg.vocab_size:
            raise ValueError(
                f"the tokenizer has {tokenizer.vocab_size} tokens but the model only {cfg.vocab_size}"
            )
        vocab = tokenizer.vocab_size
    bad = [t for t in params.logit_bias if t >= cfg.vocab_size]
    if bad:
        raise ValueError(f"logit_bias token id {bad[0]} outside the vocabulary [0, {cfg.vocab_size})")
    return vocab


def _eos_id(cfg, tokenizer) -> int | None:
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    return cfg.eos_token_id


def _advance_row(c: Completion, stopper: TextStopper | None, token: int, now: float,
                 eos: int | None, last_step: bool) -> TokenEvent:
    """Record one token for a row and decide whether the row is finished."""
    c.token_ids.append(token)
    c.token_times.append(now)
    text = stopper.feed(token) if stopper is not None else ""
    reason = None
    if stopper is not None and stopper.stopped:
        reason = "stop"
    elif eos is not None and token == eos:
        reason = "eos"
    elif last_step:
        reason = "length"
    if reason is not None and reason != "stop" and stopper is not None:
        text += stopper.flush()
        if stopper.stopped:  # the held-back text completed a stop string only at the very end
            reason = "stop"
    c.finish_reason = reason
    return TokenEvent(c.index, token, text, now, reason)


def generate(
    model: torch.nn.Module,
    prompts,
    params: SamplingParams | None = None,
    tokenizer: TokenizerLike | None = None,
    *,
    use_cache: bool = True,
    device: torch.device | str | None = None,
    kv_dtype: torch.dtype | str | None = None,
) -> list[Completion]:
    """Generate for one prompt or a batch; returns one `Completion` per prompt, in order.

    `kv_dtype`: the KV cache's dtype (default: the model's); ``"int8"`` quantizes the cache.
    """
    completions: list[Completion] = []
    for _ in stream(model, prompts, params, tokenizer, use_cache=use_cache, device=device,
                    completions=completions, kv_dtype=kv_dtype):
        pass
    return completions
