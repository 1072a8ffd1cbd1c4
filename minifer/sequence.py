"""One request's state, and the one place where a request's input is checked.

Every loop (`generation.stream`, speculative decoding, the serving engine) advances a request's
`Sequence` the same way: ``event = seq.append(token, now)``. `prepare` turns user input into
Sequences, with a clear `ValueError`/`TypeError` naming the parameter for anything the model
cannot take (nothing fails later deep inside torch)."""

from __future__ import annotations

import math
from collections import abc
from dataclasses import dataclass, field

import torch

from .device import as_device
from .sampling import SamplingParams
from .tokenizer import TokenizerLike, encode_prompt


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
    back, so a reader never sees part of a stop string that is later cut away."""

    def __init__(self, tokenizer: TokenizerLike, stop: abc.Sequence[str]) -> None:
        self.detok = tokenizer.detokenizer()
        self.stop = tuple(stop)
        self.pending = ""
        self.stopped = False

    def feed(self, token_id: int, match: bool = True) -> str:
        """Text released by this token ("" while held back). Sets `stopped` on a stop string.
        With no stop strings, or ``match=False`` (before a request's ``min_tokens``): all of it."""
        if not match or not self.stop:
            text, self.pending = self.pending + self.detok.feed(token_id), ""
            return text
        return self._release(self.pending + self.detok.feed(token_id), final=False)

    def flush(self) -> str:
        """End of generation: release everything still held (REQ-3), cut at a stop string."""
        buf = self.pending + self.detok.flush()
        return self._release(buf, final=True) if self.stop else buf

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


# ---- one request ---------------------------------------------------------------------------
class Sequence:
    """One request: its prompt, the tokens and text generated so far, and when it finished.

    `append` records a sampled token and decides whether the request is finished: on the
    end-of-sequence token, a stop string (matched on the text) or `max_new_tokens`; it fills
    the `Completion` users get back (`result`). `min_tokens` (the serving engine's, which also
    bans the end-of-sequence token until then): stop strings count only after that many."""

    min_tokens = 0

    def __init__(self, index: int, prompt_ids: list[int], params: SamplingParams,
                 tokenizer: TokenizerLike | None = None, eos_ids: abc.Iterable[int] = ()) -> None:
        self.index = index
        self.params = params
        # the ids that end this request: a model may have several (Llama 3's ends of turn and text)
        self.eos_ids = frozenset() if params.ignore_eos else frozenset(eos_ids)
        self.result = Completion(index=index, prompt_token_ids=prompt_ids)
        self.stopper = TextStopper(tokenizer, params.stop) if tokenizer is not None else None
        self._texts: list[str] = []

    @property
    def prompt_ids(self) -> list[int]:
        return self.result.prompt_token_ids

    @property
    def output_ids(self) -> list[int]:
        return self.result.token_ids

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.result.prompt_token_ids) + len(self.result.token_ids)

    @property
    def max_len(self) -> int:
        """Most tokens the model ever sees for this request: the last sampled token is never
        fed back, so the KV cache needs ``prompt + max_new_tokens - 1`` slots."""
        return len(self.result.prompt_token_ids) + self.params.max_new_tokens - 1

    @property
    def finish_reason(self) -> str | None:
        return self.result.finish_reason

    @property
    def finished(self) -> bool:
        return self.result.finish_reason is not None

    def append(self, token: int, now: float) -> TokenEvent:
        """Record one sampled token (`now`: seconds since the request started)."""
        if self.finished:
            raise RuntimeError(f"sequence {self.index} is already finished ({self.finish_reason})")
        c = self.result
        c.token_ids.append(token)
        c.token_times.append(now)
        early = len(c.token_ids) <= self.min_tokens
        text = self.stopper.feed(token, match=not early) if self.stopper is not None else ""
        reason = ("stop" if self.stopper is not None and self.stopper.stopped
                  else "eos" if token in self.eos_ids and not early
                  else "length" if len(c.token_ids) >= self.params.max_new_tokens else None)
        if self.stopper is not None:
            if reason in ("eos", "length"):
                text += self.stopper.flush()
                if self.stopper.stopped:  # the held-back text completed a stop string at the end
                    reason = "stop"
            self._texts.append(text)
            if reason is not None:
                c.text = "".join(self._texts)
        c.finish_reason = reason
        return TokenEvent(self.index, token, text, now, reason)


# ---- input checks --------------------------------------------------------------------------
@dataclass
class Prepared:
    """Checked request input: one `Sequence` per prompt, and what sampling needs to know."""

    sequences: list[Sequence]
    vocab: int  # leading vocabulary entries that may be sampled (the rest is padding)
    device: torch.device


def prepare(model: torch.nn.Module, prompts, params: SamplingParams | None,
            tokenizer: TokenizerLike | None = None, *, device=None,
            context_lengths: abc.Mapping[str, int] | None = None) -> Prepared:
    """Check everything about a request before any tensor is touched; build its Sequences.
    `context_lengths`: every context window the request must fit (default: the model's)."""
    params = SamplingParams() if params is None else params
    check_types(params, tokenizer)
    check_model(model)
    cfg = model.config
    ids_list = encode_prompts(prompts, tokenizer, cfg.vocab_size)
    vocab = usable_vocab(cfg, tokenizer, params)
    for i, ids in enumerate(ids_list):
        check_context(i, len(ids), params.max_new_tokens,
                      context_lengths or {"model": cfg.context_length})
    dev = generation_device(model, device)
    eos = eos_ids(cfg, tokenizer)
    seqs = [Sequence(i, ids, params, tokenizer, eos) for i, ids in enumerate(ids_list)]
    return Prepared(seqs, vocab, dev)


def check_types(params, tokenizer) -> None:
    """A TypeError naming the argument that is not a SamplingParams or a minifer tokenizer."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams (e.g. SamplingParams(temperature=0)), "
                        f"got {type(params).__name__} {params!r}")
    if tokenizer is not None and not all(hasattr(tokenizer, a) for a in ("encode", "detokenizer")):
        raise TypeError(f"tokenizer must be a minifer tokenizer (ByteTokenizer, Tokenizer), "
                        f"got {type(tokenizer).__name__} {tokenizer!r}")
    if params.stop and tokenizer is None:
        raise ValueError("stop strings are matched on text: pass tokenizer= to use stop")


def check_model(model: torch.nn.Module, name: str = "model") -> None:
    """A TypeError unless `model` is a minifer GPT; a ValueError if its weights are on meta."""
    cfg = getattr(model, "config", None)
    if not isinstance(model, torch.nn.Module) or not all(
            isinstance(getattr(cfg, a, None), int) for a in ("vocab_size", "context_length")):
        raise TypeError(f"{name} must be a minifer GPT (a module with a GPTConfig), got "
                        f"{type(model).__name__}")
    if any(p.device.type == "meta" for p in model.parameters()):
        raise ValueError(f"{name} is on the meta device (shapes, no weights): load its weights "
                         "before generating, e.g. model.to_empty(device='cpu') then a checkpoint")


def check_context(i: int, prompt_tokens: int, max_new_tokens: int,
                  windows: abc.Mapping[str, int]) -> None:
    """A ValueError unless prompt `i` and its new tokens fit every context window: the model
    sees ``prompt + max_new_tokens - 1`` tokens (the last new token is never fed back)."""
    need = prompt_tokens + max_new_tokens - 1
    for name, context in windows.items():
        if need > context:
            where = "" if len(windows) == 1 else f" (the {name}'s context)"
            raise ValueError(
                f"prompt {i} has {prompt_tokens} tokens; with max_new_tokens={max_new_tokens} "
                f"the model must see {need} > the context window of {context} tokens{where}; "
                f"allowed: prompt tokens + max_new_tokens - 1 <= {context}")


def generation_device(model: torch.nn.Module, device=None) -> torch.device:
    """Where a request runs: `device` (checked to exist), else where the model's weights are."""
    dev = as_device(device) if device is not None else next(model.parameters()).device
    if dev.type == "meta":
        raise ValueError("device='meta' holds shapes, no values: generation needs a real "
                         "device such as 'cpu' or 'cuda'")
    return dev


# ---- prompts: text or token ids ------------------------------------------------------------
def encode_prompts(prompts, tokenizer: TokenizerLike | None, vocab_size: int) -> list[list[int]]:
    """Token ids for each prompt, with clear errors for anything the model cannot take."""
    return [prompt_ids(i, p, tokenizer, vocab_size) for i, p in enumerate(_as_prompt_list(prompts))]


def prompt_ids(i: int, prompt, tokenizer: TokenizerLike | None, vocab_size: int) -> list[int]:
    """Prompt `i`'s token ids (from text or ids), checked to lie in the vocabulary."""
    ids = _text_ids(i, prompt, tokenizer) if isinstance(prompt, str) else _token_ids(i, prompt)
    if not ids or not 0 <= min(ids) <= max(ids) < vocab_size:
        raise _unusable_ids(i, ids, vocab_size)
    return ids


def _unusable_ids(i: int, ids: list[int], vocab_size: int) -> ValueError:
    """The error for prompt `i`'s ids: empty, or one of them outside the vocabulary."""
    if not ids:
        return ValueError(f"prompt {i} is empty: give at least one token")
    bad = next(t for t in ids if not 0 <= t < vocab_size)
    return ValueError(f"prompt {i}: token id {bad} outside the vocabulary [0, {vocab_size})")


def _as_prompt_list(prompts) -> list:
    """One prompt (a string, a flat list of ids, a 1-D tensor) or many, as a list of prompts."""
    if isinstance(prompts, torch.Tensor):
        return _tensor_prompts(prompts)
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, abc.Sequence) or len(prompts) == 0:
        raise ValueError(f"prompts must be a string, a list of token ids, or a non-empty list of "
                         f"those, got {type(prompts).__name__} {prompts!r:.80}")
    scalars = [_is_scalar(p) for p in prompts]
    if all(scalars):
        return [list(prompts)]  # one prompt given as a flat list of ids
    if any(scalars):
        raise ValueError("prompts mixes token ids and nested prompts: give one flat list of ids, "
                         "or a list of prompts (each a string or a list of ids)")
    return list(prompts)


def _tensor_prompts(prompts: torch.Tensor) -> list[list[int]]:
    if prompts.dim() == 1:
        prompts = prompts.unsqueeze(0)
    if prompts.dim() != 2:
        raise ValueError(f"a prompt tensor must be 1-D or 2-D, got shape {tuple(prompts.shape)}")
    if prompts.is_floating_point() or prompts.dtype == torch.bool:
        raise ValueError(f"prompt token ids must be integers, got dtype {prompts.dtype}")
    return prompts.tolist()


def _is_scalar(x) -> bool:
    """Not a prompt of its own: neither text, nor a list, nor a tensor with a dimension."""
    if isinstance(x, torch.Tensor):
        return x.dim() == 0
    return not isinstance(x, (str, abc.Sequence))


def _text_ids(i: int, text: str, tokenizer: TokenizerLike | None) -> list[int]:
    if tokenizer is None:
        raise ValueError(f"prompt {i} is text but no tokenizer was given; pass tokenizer=")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"prompt {i} is not valid Unicode text (a lone surrogate at "
                         f"character {err.start}); pass well-formed text") from None
    return encode_prompt(tokenizer, text)


def _token_ids(i: int, p) -> list[int]:
    if isinstance(p, torch.Tensor):
        if p.is_floating_point():
            raise ValueError(f"prompt {i}: token ids must be integers, got dtype {p.dtype}")
        p = p.tolist()
    if not isinstance(p, abc.Sequence):
        raise ValueError(f"prompt {i} must be a string or a list of token ids, "
                         f"got {type(p).__name__} {p!r:.80}")
    for t in p:
        if not _is_token_id(t):
            raise ValueError(f"prompt {i}: token ids must be integers, got "
                             f"{type(t).__name__} {t!r:.80}")
    return [int(t) for t in p]


def _is_token_id(x) -> bool:
    """An integer-like scalar (int, numpy integer, 0-d integer tensor), not a bool."""
    if isinstance(x, bool):
        return False
    if isinstance(x, torch.Tensor):
        return x.dim() == 0 and not x.is_floating_point() and x.dtype != torch.bool
    return hasattr(x, "__index__")


# ---- the vocabulary ------------------------------------------------------------------------
def usable_vocab(cfg, tokenizer: TokenizerLike | None, params: SamplingParams) -> int:
    """How many leading vocabulary entries may be sampled: the tokenizer's, where the model
    pads its vocabulary past it (tokens there mean nothing, so they are never sampled)."""
    vocab = cfg.vocab_size
    if tokenizer is not None:
        if tokenizer.vocab_size > cfg.vocab_size:
            raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model "
                             f"only {cfg.vocab_size}")
        vocab = tokenizer.vocab_size
    if params.logit_bias:
        check_logit_bias(params.logit_bias, vocab, cfg.vocab_size)
    return vocab


def check_logit_bias(bias: dict[int, float], vocab: int, vocab_size: int) -> None:
    """A ValueError for a biased token outside the model's vocabulary, or a bias that bans
    (-inf) every token of the first `vocab`, leaving nothing to sample."""
    bad = [t for t in bias if t >= vocab_size]
    if bad:
        raise ValueError(f"logit_bias token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    if all(bias.get(t, 0.0) == -math.inf for t in range(vocab)):
        raise ValueError("logit_bias bans every token of the vocabulary (-inf on all of them): "
                         "leave at least one token that can be sampled")


def eos_ids(cfg, tokenizer: TokenizerLike | None) -> frozenset[int]:
    """The ids that end a sequence: the tokenizer's end-of-sequence token with any others it
    lists (a Hugging Face checkpoint's), else the model config's."""
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return frozenset({tokenizer.eos_token_id, *getattr(tokenizer, "more_eos_token_ids", ())})
    return frozenset(() if cfg.eos_token_id is None else (cfg.eos_token_id,))
