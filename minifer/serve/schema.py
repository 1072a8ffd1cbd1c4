"""The replies as Pydantic models: what the server's OpenAPI schema (``/openapi.json``) says
each route answers, errors included. The server builds its bodies as plain dicts
(`minifer.serve.replies`); the schema test checks every answer against these models."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error: OpenAI's shape."""

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FinishReason = Literal["stop", "length"] | None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason = None


class CompletionResponse(BaseModel):
    """A completion (``stream: false``); streamed, each event is one of these with the new text
    and ``usage`` null, and with ``stream_options.include_usage`` a last one with ``choices``
    empty and the usage."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason = None


class ChatCompletionResponse(BaseModel):
    """A chat completion (``stream: false``); streamed, events are ``chat.completion.chunk``s
    whose ``choices[0].delta`` holds the role (first event) or the new text."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason = None


class ChatCompletionChunk(BaseModel):
    """One event of a streamed chat completion (``usage`` only on the last, if asked for)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelPermission(BaseModel):
    id: str
    object: Literal["model_permission"] = "model_permission"
    created: int
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(BaseModel):
    """A served model, with the fields OpenAI's and vLLM's clients read."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "minifer"
    root: str
    parent: str | None = None
    max_model_len: int
    permission: list[ModelPermission]


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    """``ok``; ``degraded`` when some engine replicas have stopped and the rest serve."""

    status: Literal["ok", "degraded"]
    replicas: int | None = None  # with --engine-replicas: how many in all
    replicas_alive: int | None = None  # ... and how many serve now
