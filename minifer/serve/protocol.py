"""The OpenAI protocol's requests: bodies checked into engine requests (no HTTP here).

Each body is a Pydantic model (`CompletionBody`, `ChatCompletionBody`), which the OpenAPI schema
is made from: strict types (``"5"`` is not a number, ``1`` not ``true``; ``16.0`` is an integer,
as JSON Schema counts), every number bounded, unknown fields and OpenAI fields not implemented
refused. `parse_completion_request` / `parse_chat_request` then apply what depends on the server
and return a `CompletionRequest`. Every refusal is an `APIError` (400) naming the parameter and
what is allowed. Replies are shaped in `minifer.serve.replies`."""

from __future__ import annotations

import inspect
import time
import typing
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from ..chat_template import chat_prompt, render_template
from ..checks import check_int, check_number
from ..engine.errors import APIError, error_body
from ..engine.logprobs import MAX_TOP_LOGPROBS
from ..engine.scheduler import PRIORITY_LIMIT
from ..sampling import SEED_RANGE, SamplingParams
from ..sequence import encode_prompts

__all__ = ["APIError", "CompletionRequest", "Limits", "CompletionBody", "ChatCompletionBody",
           "parse_completion_request", "parse_completion_requests", "parse_chat_request", "validation_error", "error_body"]

MAX_STOP = 4  # OpenAI's limit on stop strings
MAX_PROMPTS = 128  # prompts in one completions request (each its own choice)
NEG_INF_LOGPROB = -9999.0  # what vLLM reports for a logprob of -inf
MAX_NAME_SHOWN = 64  # an unknown field's name is echoed back at most this long


def _bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code=code)


@dataclass(frozen=True)
class Limits:
    """What the server accepts (claim MET-5): context window, output tokens, time per request."""

    max_model_len: int
    max_tokens: int
    request_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_tokens"):
            check_int(name, getattr(self, name), 1)
        check_number("request_timeout_s", self.request_timeout_s, gt=0, finite=True)


@dataclass
class CompletionRequest:
    """A checked request: what the engine needs, and how to answer. `kind`: ``"text"`` or
    ``"chat"``; `logprobs`: alternatives per token (None: none); `echo`: the prompt first."""

    prompt_ids: list[int]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    priority: int = 0
    model: str = ""
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))
    kind: str = "text"
    logprobs: int | None = None
    echo: bool = False
    prompt_text: str | None = None
    min_tokens: int = 0
    index: int = 0  # the choice's index: the prompt's place in a list of prompts
    score_only: bool = False  # max_tokens 0 with echo: the prompt's logprobs, no new token

    def engine_options(self) -> dict:
        """Keyword arguments for `LLMEngine.add_request` beyond prompt, params and priority."""
        opts = {"logprobs": self.logprobs} if self.logprobs is not None else {}
        return opts | ({"min_tokens": self.min_tokens} if self.min_tokens else {})


# ---- request bodies ------------------------------------------------------------------------
def _f(default: Any, allowed: str, doc: str = "", *, unsupported: bool = False) -> Any:
    """A field whose schema says what is allowed (``x-allowed``, also used in error messages)."""
    extra: dict[str, Any] = {"x-allowed": allowed}
    if unsupported:
        extra["x-unsupported"] = True
    return Field(default, description=f"{doc} Allowed: {allowed}.".strip(), json_schema_extra=extra)


def _integral(value: Any) -> Any:
    """JSON Schema's integers include 3.0: take an integral float as the int it is."""
    return int(value) if type(value) is float and value.is_integer() else value


def Int(**bounds: int) -> Any:  # noqa: N802 - used as a type
    """An integer field (strict otherwise: not ``"3"``, not ``true``) within `bounds`."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


NonEmpty = Annotated[str, Field(min_length=1)]
TokenId = Int(ge=0, le=2**31 - 1)
Stop = NonEmpty | Annotated[list[NonEmpty], Field(max_length=MAX_STOP)]
Penalty = Annotated[float, Field(ge=0, le=0)]  # presence/frequency penalties: only 0
Bias = dict[Annotated[str, Field(pattern=r"^[0-9]{1,10}$")],
            Annotated[float, Field(ge=-100, le=100)]]
Priority = Int(ge=-PRIORITY_LIMIT, le=PRIORITY_LIMIT)


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool | None = _f(None, "true or false", "Send a last chunk with usage.")


class _Sampling(_Body):
    """The fields completions and chat share."""

    model: NonEmpty = _f(..., "the name of a served model (see GET /v1/models)")
    max_tokens: Int(ge=1) | None = _f(
        None, "an integer >= 1, at most the server's --max-tokens", "Most tokens to generate.")
    temperature: Annotated[float, Field(ge=0, le=2)] | None = _f(
        None, "a number in [0, 2]", "Sampling temperature; 0 = greedy. Default 1.")
    top_p: Annotated[float, Field(gt=0, le=1)] | None = _f(None, "a number in (0, 1]",
                                                          "Nucleus sampling. Default 1.")
    top_k: Int(ge=-1, le=2**31 - 1) | None = _f(
        None, "an integer >= 0 (0 or -1 = off)", "Keep the k most likely tokens (vLLM).")
    repetition_penalty: Annotated[float, Field(gt=0)] | None = _f(
        None, "a number > 0", "CTRL's penalty on tokens already seen; 1 = off (vLLM).")
    stop: Stop | None = _f(None, f"a non-empty string or a list of at most {MAX_STOP} of them",
                           "Generation stops before the first stop string.")
    seed: Int(ge=SEED_RANGE[0], lt=SEED_RANGE[1]) | None = _f(
        None, "an integer in [0, 2**64) or null", "Makes sampling reproducible.")
    stream: bool | None = _f(None, "true or false", "Answer as server-sent events.")
    stream_options: StreamOptions | None = _f(
        None, 'an object like {"include_usage": true}, only with stream', "Streaming options.")
    n: Int(ge=1, le=1) | None = _f(None, "1", "Choices per request.", unsupported=True)
    presence_penalty: Penalty | None = _f(None, "0", unsupported=True)
    frequency_penalty: Penalty | None = _f(None, "0", unsupported=True)
    logit_bias: Bias | None = _f(None, "an object mapping token ids (strings) to numbers in "
                                 "[-100, 100]", "Added to those tokens' logits.")
    user: str | None = _f(None, "any string", "An end-user id (accepted, unused).")
    ignore_eos: bool | None = _f(None, "true or false",
                                 "Keep going past the end-of-sequence token (vLLM).")
    min_tokens: Int(ge=0) | None = _f(
        None, "an integer >= 0, at most max_tokens",
        "The end-of-sequence token is not sampled before this many tokens, and stop strings "
        "count only in the text after them (vLLM).")
    priority: Priority | None = _f(
        None, "an integer in [-2**53, 2**53]; non-zero only if the server schedules by "
        "priority", "Lower = served first (vLLM).")


class CompletionBody(_Sampling):
    """``POST /v1/completions``."""

    prompt: (NonEmpty | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[NonEmpty], Field(min_length=1, max_length=MAX_PROMPTS)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                         Field(min_length=1, max_length=MAX_PROMPTS)]) = _f(
        ..., f"a non-empty string, a non-empty list of token ids, or a list of at most "
        f"{MAX_PROMPTS} of either (each its own choice, batched on the server)", "The prompt.")
    max_tokens: Int(ge=0) | None = _f(
        None, "an integer >= 1, at most the server's --max-tokens (0: only with echo, to score "
        "the prompt)", "Most tokens to generate. Default 16.")
    echo: bool | None = _f(None, "true or false", "Return the prompt before the completion.")
    logprobs: Int(ge=0, le=MAX_TOP_LOGPROBS) | None = _f(
        None, f"an integer in [0, {MAX_TOP_LOGPROBS}] or null",
        "Report each token's logprob and this many alternatives.")
    best_of: Int(ge=1, le=1) | None = _f(None, "1", unsupported=True)
    suffix: Annotated[str, Field(max_length=0)] | None = _f(None, '""', unsupported=True)


class TextPart(_Body):
    type: Literal["text"] = _f(..., '"text"')
    text: str = _f(..., "a string")


SpeakerName = Annotated[str, Field(pattern=r"^[^:\s]([^:\r\n]{0,62}[^:\s])?$")]


class ChatMessage(_Body):
    """One message; ``name`` is the speaker in the chat template (see `minifer.play_chat`)."""

    role: Literal["system", "developer", "user", "assistant"] = _f(
        ..., '"system", "developer", "user" or "assistant"')
    content: str | Annotated[list[TextPart], Field(min_length=1)] = _f(
        ..., 'a string or a list of {"type": "text", "text": ...} parts')
    name: SpeakerName | None = _f(None, "1 to 64 characters, no colon or line break",
                                  "The speaker's name.")


class ResponseFormat(_Body):
    type: Literal["text"] = _f(..., '"text"', unsupported=True)


class ChatCompletionBody(_Sampling):
    """``POST /v1/chat/completions``."""

    # the schema says what `parse_chat_request` checks: top_logprobs only with logprobs true
    model_config = ConfigDict(json_schema_extra={
        "if": {"required": ["top_logprobs"],
               "properties": {"top_logprobs": {"type": "integer"}}},
        "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}})

    messages: Annotated[list[ChatMessage], Field(min_length=1)] = _f(
        ..., "a non-empty list of messages", "The conversation so far.")
    max_completion_tokens: Int(ge=1) | None = _f(
        None, "an integer >= 1, at most the server's --max-tokens",
        "Most tokens to generate (OpenAI's newer name for max_tokens).")
    logprobs: bool | None = _f(None, "true or false", "Report each token's logprob.")
    top_logprobs: Int(ge=0, le=MAX_TOP_LOGPROBS) | None = _f(
        None, f"an integer in [0, {MAX_TOP_LOGPROBS}], only with logprobs",
        "Alternatives reported per token.")
    response_format: ResponseFormat | None = _f(None, '{"type": "text"}', unsupported=True)
    tools: Annotated[list[dict[str, Any]], Field(max_length=0)] | None = _f(
        None, "an empty list or null (no tool calling)", unsupported=True)
    tool_choice: Literal["none"] | None = _f(None, '"none" or null', unsupported=True)
    parallel_tool_calls: bool | None = _f(None, "true or false (no tool calling)")


# ---- validation errors ---------------------------------------------------------------------
def _submodel(annotation: Any) -> type[BaseModel] | None:
    """The model class inside an annotation (``list[ChatMessage] | None`` → ChatMessage)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next(filter(None, map(_submodel, typing.get_args(annotation))), None)


def _short(value: Any) -> str:
    try:
        return f"{value!r:.60}"
    except ValueError:  # an int too large to print
        return "a huge number"


def _cut(name: str, most: int = MAX_NAME_SHOWN) -> str:
    """A name the client sent, as an error message shows it: at most `most` characters."""
    return name if len(name) <= most else f"{name[:most]}…({len(name):,} characters)"


def validation_error(errors: Sequence[dict], model: type[BaseModel]) -> APIError:
    """Pydantic's errors for a `model` body as one OpenAI-style 400 naming the parameter
    (``messages[0].content``) and what it allows."""
    e = errors[0]
    loc = list(e.get("loc", ()))
    if loc and loc[0] == "body":  # FastAPI's prefix
        loc = loc[1:]
    if e.get("type") == "json_invalid":
        why = (e.get("ctx") or {}).get("error", e.get("msg", ""))
        return APIError(400, f"the request body is not valid JSON: {why}", code="invalid_json")
    names: list[str] = []
    cls: type[BaseModel] | None = model
    allowed, unsupported = None, False
    for part in loc:
        if isinstance(part, int):
            if names:
                names[-1] += f"[{part}]"
            continue
        if cls is None or part not in cls.model_fields:
            if e.get("type") == "extra_forbidden":  # the client's name, cut short if huge
                names.append(_cut(str(part)))
            break
        info = cls.model_fields[part]
        names.append(part)
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        allowed, unsupported = extra.get("x-allowed"), bool(extra.get("x-unsupported"))
        cls = _submodel(info.annotation)
    param = ".".join(names) or None
    kind = e.get("type")
    if param is None:
        return APIError(400, "the request body must be a JSON object with the fields of "
                        f"{model.__name__} (see /openapi.json), got {_short(e.get('input'))}")
    if kind == "extra_forbidden":
        known = sorted(cls.model_fields) if cls is not None else []
        return _bad(param, f"unrecognized request argument (supported: {', '.join(known)})",
                    code="unknown_parameter")
    if kind == "missing":
        return _bad(param, f"required: {allowed}" if allowed else "required", code="missing")
    if unsupported:
        return _bad(param, f"{_short(e.get('input'))} is not supported by this server (allowed: "
                    f"{allowed})", code="unsupported")
    what = allowed or e.get("msg", "valid")
    return _bad(param, f"must be {what}, got {_short(e.get('input'))}")


def _validate(cls: type[BaseModel], body: Any) -> Any:
    if isinstance(body, cls):
        return body
    try:
        return cls.model_validate(body)
    except ValidationError as err:
        raise validation_error(err.errors(include_url=False), cls) from None


# ---- server-dependent checks ---------------------------------------------------------------
class _SpecialTokens:
    """`tokenizer` whose ``encode`` recognises special tokens in text, as vLLM does (where the
    tokenizer has the option); `bos_token_id` is None for a rendered chat (its own BOS)."""

    def __init__(self, tokenizer, *, bos: bool) -> None:
        self.tok = tokenizer
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None) if bos else None
        try:
            self.option = "special_tokens" in inspect.signature(tokenizer.encode).parameters
        except (TypeError, ValueError):
            self.option = False

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, special_tokens=True) if self.option else self.tok.encode(text)


def _too_long(param: str, chars: int, most: int, limits: Limits) -> APIError:
    return APIError(400, f"{param}: this model's maximum context length is "
                    f"{limits.max_model_len} tokens, and the {param} has {chars:,} characters: "
                    f"more than that many tokens can hold (one token stands for at most {most} "
                    f"characters); shorten it", param=param, code="context_length_exceeded")


def _encode(text: str, tokenizer, vocab_size: int, param: str, limits: Limits, *,
            bos: bool = True) -> list[int]:
    """Text to ids through the engine's `encode_prompts`; a text too long for the context
    window whatever its tokens is refused before tokenizing."""
    if tokenizer is None:
        raise _bad(param, "this server has no tokenizer: send token ids (a list of integers)")
    most = getattr(tokenizer, "max_token_chars", None)
    if isinstance(most, int) and len(text) > limits.max_model_len * most:
        raise _too_long(param, len(text), most, limits)
    try:
        [ids] = encode_prompts([text], _SpecialTokens(tokenizer, bos=bos), vocab_size)
    except (ValueError, TypeError) as err:
        raise _bad(param, str(err).removeprefix("prompt 0 ").removeprefix("prompt 0: ")) from None
    return ids


def _prompt_ids(prompt: Any, tokenizer, vocab_size: int,
                limits: Limits) -> tuple[list[int], str | None]:
    """One prompt (text or ids) → ids, text."""
    if isinstance(prompt, str):
        return _encode(prompt, tokenizer, vocab_size, "prompt", limits), prompt
    if len(prompt) > limits.max_model_len:  # before decoding it
        raise _context_error(len(prompt), 1, limits, "max_tokens", "prompt")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise _bad("prompt", f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return list(prompt), (_decode(tokenizer, prompt) if tokenizer is not None else None)


def _decode(tokenizer, ids: list[int]) -> str:
    """An id prompt's text, special tokens kept (as its tokens show them)."""
    try:
        return tokenizer.decode(ids, special_tokens=True)
    except TypeError:  # a tokenizer without the option
        return tokenizer.decode(ids)


def _check_model(model: str, model_name: str) -> None:
    if model != model_name:
        raise _bad("model", f"the model {_short(model)} does not exist; this server serves "
                   f"{model_name!r}", code="model_not_found")


def _context_error(prompt_tokens: int, max_tokens: int, limits: Limits, param: str,
                   prompt_param: str) -> APIError:
    need = prompt_tokens + max_tokens - 1
    return APIError(400, f"{prompt_param}: this model's maximum context length is "
                    f"{limits.max_model_len} tokens; the {prompt_param} has {prompt_tokens} "
                    f"tokens and {param}={max_tokens} ({prompt_param} + {param} - 1 = {need}); "
                    f"shorten the {prompt_param} or lower {param}", param=prompt_param,
                    code="context_length_exceeded")


def _check_length(ids: list[int], max_tokens: int, limits: Limits, param: str,
                  prompt_param: str = "prompt") -> None:
    """`prompt_param`: the field the client sent the prompt in (``prompt``, ``messages``)."""
    if not 1 <= max_tokens <= limits.max_tokens:
        raise _bad(param, f"must be an integer in [1, {limits.max_tokens}], got {max_tokens!r}")
    if len(ids) + max_tokens - 1 > limits.max_model_len:  # the last token is never fed back
        raise _context_error(len(ids), max_tokens, limits, param, prompt_param)


def _sampling(b: _Sampling, max_tokens: int, stop: list[str],
              priorities: bool) -> tuple[SamplingParams, dict]:
    """`SamplingParams` and `CompletionRequest`'s other shared fields (what the engine checks is
    left to it: `add_failure` turns its ValueError into a 400 naming the parameter)."""
    if b.stream_options is not None and not b.stream:
        raise _bad("stream_options", "only allowed when stream is true")
    priority = b.priority or 0
    if priority and not priorities:
        raise _bad("priority", f"{priority} is not honoured: this server schedules first come, "
                   "first served (start it with --scheduling-policy priority)", code="unsupported")
    bias = {int(key): value for key, value in (b.logit_bias or {}).items()}
    top_k = 0 if b.top_k in (None, -1) else b.top_k  # vLLM: -1 = off
    params = SamplingParams(
        temperature=1.0 if b.temperature is None else float(b.temperature),
        top_p=1.0 if b.top_p is None else float(b.top_p), top_k=top_k,
        repetition_penalty=1.0 if b.repetition_penalty is None else float(b.repetition_penalty),
        max_new_tokens=max_tokens, stop=tuple(stop), seed=b.seed,
        ignore_eos=bool(b.ignore_eos), logit_bias=bias)
    include_usage = bool(b.stream_options and b.stream_options.include_usage)
    return params, dict(stream=bool(b.stream), include_usage=include_usage, priority=priority,
                        model=b.model, min_tokens=b.min_tokens or 0)


def _stops(stop: str | list[str] | None) -> list[str]:
    return [] if stop is None else [stop] if isinstance(stop, str) else list(stop)


def parse_completion_requests(body: Any, *, model_name: str, limits: Limits, tokenizer=None,
                              vocab_size: int, priorities: bool = False) -> list[CompletionRequest]:
    """Check a ``/v1/completions`` body (a dict or a `CompletionBody`): one request per prompt,
    sharing the answer's id, or an `APIError` (400). `priorities`: ``priority`` honoured."""
    b = _validate(CompletionBody, body)
    _check_model(b.model, model_name)
    prompts = [b.prompt] if isinstance(b.prompt, str) or isinstance(b.prompt[0], int) else b.prompt
    max_tokens = 16 if b.max_tokens is None else b.max_tokens
    score_only = max_tokens == 0
    if score_only and not b.echo:
        raise _bad("max_tokens", "0 is only allowed with echo (to score the prompt)")
    params, shared = _sampling(b, max(max_tokens, 1), _stops(b.stop), priorities)
    reqs: list[CompletionRequest] = []
    for i, prompt in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        try:
            ids, text = _prompt_ids(prompt, tokenizer, vocab_size, limits)
            _check_length(ids, max(max_tokens, 1), limits, "max_tokens")
        except APIError as err:
            if param == "prompt":
                raise
            message = err.message.replace("prompt", param, 1)  # which of the prompts
            raise APIError(err.status, message, param=param, type=err.type, code=err.code) from None
        reqs.append(CompletionRequest(
            ids, params, logprobs=b.logprobs, echo=bool(b.echo), prompt_text=text, index=i,
            score_only=score_only, **shared,
            **({"id": reqs[0].id, "created": reqs[0].created} if reqs else {})))
    return reqs


def parse_completion_request(body: Any, **options) -> CompletionRequest:
    """`parse_completion_requests` for a body with one prompt."""
    reqs = parse_completion_requests(body, **options)
    if len(reqs) != 1:
        raise _bad("prompt", f"one prompt expected here, got {len(reqs)}")
    return reqs[0]


def parse_chat_request(body: Any, *, model_name: str, limits: Limits, tokenizer=None,
                       vocab_size: int, priorities: bool = False,
                       render: Callable[..., str] = render_template) -> CompletionRequest:
    """Check a ``/v1/chat/completions`` body and render its messages (`chat_prompt`; a server's
    `render` is its `TemplateSandbox`'s, within its limits)."""
    b = _validate(ChatCompletionBody, body)
    _check_model(b.model, model_name)
    if tokenizer is None:
        raise _bad("messages", "this server has no tokenizer, and chat needs one")
    try:  # a template that fails to render, or a checkpoint without one, is the request's
        prompt, turn_stops = chat_prompt([{"role": m.role, "content": m.content if isinstance(
            m.content, str) else "".join(p.text for p in m.content), "name": m.name}
            for m in b.messages], tokenizer, render=render)
    except ValueError as err:
        raise _bad("messages", str(err)) from None
    ids = _encode(prompt, tokenizer, vocab_size, "messages", limits, bos=False)  # the template's own
    param = "max_completion_tokens" if b.max_completion_tokens is not None else "max_tokens"
    if b.max_tokens is not None and b.max_completion_tokens is not None \
            and b.max_tokens != b.max_completion_tokens:
        raise _bad("max_completion_tokens", f"{b.max_completion_tokens} contradicts max_tokens="
                   f"{b.max_tokens}; give one of them")
    max_tokens = b.max_completion_tokens or b.max_tokens
    if max_tokens is None:  # what the context window has left, within the server's limit
        max_tokens = max(1, min(limits.max_tokens, limits.max_model_len - len(ids) + 1))
    _check_length(ids, max_tokens, limits, param, "messages")
    if b.top_logprobs is not None and not b.logprobs:
        raise _bad("top_logprobs", "only allowed when logprobs is true")
    params, shared = _sampling(b, max_tokens, [*_stops(b.stop), *turn_stops], priorities)
    return CompletionRequest(ids, params, kind="chat", id=f"chatcmpl-{uuid.uuid4().hex[:24]}",
                             logprobs=(b.top_logprobs or 0) if b.logprobs else None,
                             prompt_text=prompt, **shared)
