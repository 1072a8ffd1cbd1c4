"""The OpenAI completions protocol, as plain functions: check a request body, shape the replies.

`parse_completion_request` turns the JSON body of ``POST /v1/completions`` into a
`CompletionRequest` (prompt ids + `SamplingParams`) or raises `APIError` with the HTTP status and
an OpenAI-style error body that names the offending parameter and what is allowed. Nothing here
knows about HTTP frameworks or the engine, so every rule is testable on its own.

Fields follow OpenAI's completions API: ``model``, ``prompt`` (text or token ids; one prompt per
request), ``max_tokens`` (default 16), ``temperature`` (default 1), ``top_p``, ``stop`` (up to
4 strings), ``seed``, ``stream``, ``stream_options.include_usage``, ``n`` (only 1), ``user``.
Extensions, as vLLM names them: ``top_k``, ``repetition_penalty``, ``priority`` (lower = served
first), ``ignore_eos``. Fields we do not implement are refused at anything but their neutral
value, rather than silently ignored.

OpenAI's ``finish_reason`` is ``"stop"`` for a natural end (the end-of-sequence token or a stop
string) and ``"length"`` when ``max_tokens`` ran out.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..sampling import SamplingParams

__all__ = ["APIError", "CompletionRequest", "Limits", "parse_completion_request",
           "openai_finish_reason", "completion_body", "chunk_body", "usage_body", "error_body"]

MAX_STOP = 4  # OpenAI's limit on stop strings


class APIError(Exception):
    """An error the client caused (4xx) or the server cannot take now (429/503), OpenAI-shaped."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return error_body(self.message, param=self.param, type=self.type, code=self.code)


def error_body(message: str, *, param: str | None = None, type: str = "invalid_request_error",
               code: str | None = None) -> dict:
    """``{"error": {"message", "type", "param", "code"}}`` — what OpenAI's API returns."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code=code)


@dataclass(frozen=True)
class Limits:
    """What the server accepts (claim MET-5): the context window, the most output tokens a
    request may ask for, and how long a request may run before it is aborted."""

    max_model_len: int
    max_tokens: int
    request_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        t = self.request_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ValueError(f"request_timeout_s must be a positive number, got {t!r}")


@dataclass
class CompletionRequest:
    """A checked completion request: what the engine needs, and how to answer."""

    prompt_ids: list[int]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    priority: int = 0
    model: str = ""
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))


# neutral values of OpenAI fields we do not implement: anything else is refused
_NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "n": lambda v: v in (None, 1),
    "best_of": lambda v: v in (None, 1),
    "echo": lambda v: v in (None, False),
    "logprobs": lambda v: v is None,
    "suffix": lambda v: v in (None, ""),
    "presence_penalty": lambda v: v in (None, 0),
    "frequency_penalty": lambda v: v in (None, 0),
    "logit_bias": lambda v: v in (None, {}),
    "user": lambda v: True,  # an end-user id for abuse monitoring: accepted, unused
}
_KNOWN = {"model", "prompt", "max_tokens", "temperature", "top_p", "stop", "seed", "stream",
          "stream_options", "top_k", "repetition_penalty", "priority", "ignore_eos", *_NEUTRAL}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: dict, name: str, default: float, allowed: str, ok: Callable[[float], bool]):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or not ok(v):
        raise _bad(name, f"must be {allowed}, got {v!r}")
    return v


def _prompt_ids(prompt: Any, tokenizer, vocab_size: int) -> list[int]:
    """One prompt: text, a list of token ids, or a list holding exactly one of those."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # OpenAI's batch form with a single prompt
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("prompt", "must not be empty")
        if tokenizer is None:
            raise _bad("prompt", "this server has no tokenizer: send token ids (a list of integers)")
        return list(tokenizer.encode(prompt))
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise _bad("prompt", f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise _bad("prompt", f"got {len(prompt)} prompts; this server takes one prompt per "
                   "request (send several requests: they are batched on the server)")
    raise _bad("prompt", "must be a non-empty string or a non-empty list of token ids, got "
               f"{type(prompt).__name__} {prompt!r:.60}")


def parse_completion_request(body: Any, *, model_name: str, limits: Limits, tokenizer=None,
                             vocab_size: int) -> CompletionRequest:
    """Check a ``/v1/completions`` JSON body; raise `APIError` (400) naming the bad parameter."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise _bad(unknown[0], "unrecognized request argument (supported: "
                   f"{', '.join(sorted(_KNOWN))})", code="unknown_parameter")
    for name, neutral in _NEUTRAL.items():
        if name in body and not neutral(body[name]):
            raise _bad(name, f"{body[name]!r} is not supported by this server", code="unsupported")

    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "required: the name of a served model (see GET /v1/models)")
    if model != model_name:
        raise _bad("model", f"the model {model!r} does not exist; this server serves "
                   f"{model_name!r}", code="model_not_found")
    if "prompt" not in body:
        raise _bad("prompt", "required")
    ids = _prompt_ids(body["prompt"], tokenizer, vocab_size)

    max_tokens = body.get("max_tokens", 16)
    max_tokens = 16 if max_tokens is None else max_tokens
    if not _is_int(max_tokens) or not 1 <= max_tokens <= limits.max_tokens:
        raise _bad("max_tokens", f"must be an integer in [1, {limits.max_tokens}], "
                   f"got {max_tokens!r}")
    need = len(ids) + max_tokens - 1  # the last token is never fed back
    if need > limits.max_model_len:
        raise APIError(400, f"prompt: this model's maximum context length is "
                       f"{limits.max_model_len} tokens; the prompt has {len(ids)} tokens and "
                       f"max_tokens={max_tokens} (prompt + max_tokens - 1 = {need}); shorten the "
                       "prompt or lower max_tokens", param="prompt",
                       code="context_length_exceeded")

    temperature = _number(body, "temperature", 1.0, "a number in [0, 2]", lambda t: 0 <= t <= 2)
    top_p = _number(body, "top_p", 1.0, "a number in (0, 1]", lambda p: 0 < p <= 1)
    penalty = _number(body, "repetition_penalty", 1.0, "a number > 0", lambda r: 0 < r < math.inf)
    top_k = body.get("top_k")
    top_k = 0 if top_k in (None, -1) else top_k  # vLLM: -1 = off
    if not _is_int(top_k) or top_k < 0:
        raise _bad("top_k", f"must be an integer >= 0 (0 or -1 = off), got {top_k!r}")

    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if (not isinstance(stop, list) or len(stop) > MAX_STOP
            or not all(isinstance(s, str) and s for s in stop)):
        raise _bad("stop", f"must be a non-empty string or a list of at most {MAX_STOP} of them, "
                   f"got {body.get('stop')!r:.60}")
    if stop and tokenizer is None:
        raise _bad("stop", "stop strings are matched on text, and this server has no tokenizer")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not -2**63 <= seed < 2**64):
        raise _bad("seed", f"must be an integer in [-2**63, 2**64) or null, got {seed!r:.40}")
    priority = body.get("priority", 0)
    priority = 0 if priority is None else priority
    if not _is_int(priority):
        raise _bad("priority", f"must be an integer (lower = served first), got {priority!r}")
    flags = {}
    for name in ("stream", "ignore_eos"):
        v = body.get(name, False)
        if v is not None and not isinstance(v, bool):
            raise _bad(name, f"must be true or false, got {v!r}")
        flags[name] = bool(v)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not flags["stream"]:
            raise _bad("stream_options", "only allowed when stream is true")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise _bad("stream_options", f"must be an object like {{\"include_usage\": true}}, "
                       f"got {options!r:.60}")
        include_usage = options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise _bad("stream_options.include_usage", f"must be true or false, got "
                       f"{include_usage!r}")

    params = SamplingParams(temperature=float(temperature), top_p=float(top_p), top_k=top_k,
                            repetition_penalty=float(penalty), max_new_tokens=max_tokens,
                            stop=tuple(stop), seed=seed, ignore_eos=flags["ignore_eos"])
    return CompletionRequest(ids, params, stream=flags["stream"], include_usage=include_usage,
                             priority=priority, model=model)


# ---- replies -------------------------------------------------------------------------------
def openai_finish_reason(reason: str | None) -> str | None:
    """The engine's reason as OpenAI spells it: "eos" and "stop" are both a natural "stop"."""
    return {"eos": "stop", "stop": "stop", "length": "length"}.get(reason, reason)


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(req: CompletionRequest, text: str, finish_reason: str | None,
                    completion_tokens: int) -> dict:
    """The whole answer of a non-streamed completion."""
    return {"id": req.id, "object": "text_completion", "created": req.created,
            "model": req.model,
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": openai_finish_reason(finish_reason)}],
            "usage": usage_body(len(req.prompt_ids), completion_tokens)}


def chunk_body(req: CompletionRequest, text: str | None, finish_reason: str | None = None,
               usage: dict | None = None) -> dict:
    """One server-sent event of a streamed completion. ``text=None``: the usage-only last chunk
    (``choices`` empty), sent when ``stream_options.include_usage`` is true."""
    body = {"id": req.id, "object": "text_completion", "created": req.created,
            "model": req.model,
            "choices": [] if text is None else [
                {"index": 0, "text": text, "logprobs": None,
                 "finish_reason": openai_finish_reason(finish_reason)}]}
    if req.include_usage:
        body["usage"] = usage  # null on every chunk but the last, as OpenAI does
    return body
