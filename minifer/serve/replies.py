"""OpenAI-shaped replies, whole or streamed chunk by chunk, from the engine's `RequestOutput`s:
``finish_reason`` is ``"stop"`` for EOS or a stop string, ``"length"`` when ``max_tokens`` ran
out. A token is shown as its text, or ``token_id:N`` without a tokenizer; -inf as -9999.0."""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from ..engine.logprobs import TokenLogprob
from .protocol import NEG_INF_LOGPROB, CompletionRequest

__all__ = ["openai_finish_reason", "usage_body", "token_text", "token_bytes", "completion_body",
           "chunk_body", "chat_body", "chat_chunk_body", "Streamer", "reply_body", "merge_bodies"]

def openai_finish_reason(reason: str | None) -> str | None:
    """The engine's reason as OpenAI spells it: "eos" and "stop" are both a natural "stop"."""
    return {"eos": "stop", "stop": "stop", "length": "length"}.get(reason, reason)


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _finite(x: float) -> float:
    return x if x > NEG_INF_LOGPROB else NEG_INF_LOGPROB


def token_text(tokenizer, token_id: int) -> str:
    """How a token is shown in logprobs: its text, or ``token_id:N`` without a tokenizer."""
    return tokenizer.token_to_text(token_id) if tokenizer is not None else f"token_id:{token_id}"


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: printable character → the byte it stands for."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
          *range(ord("®"), ord("ÿ") + 1)]
    cs = bs + [256 + n for n in range(256 - len(bs))]  # the other bytes, shifted past 255
    bs += [b for b in range(256) if b not in bs]
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_DECODER = _byte_decoder()


def token_bytes(tokenizer, token_id: int) -> list[int] | None:
    """A token's UTF-8 bytes (OpenAI chat logprobs' ``bytes``): part of a character, maybe."""
    if tokenizer is None:
        return None
    if hasattr(tokenizer, "specials"):  # ByteTokenizer: one byte per token, then specials
        return [token_id] if token_id < 256 else list(tokenizer.token_to_text(token_id).encode())
    hf = getattr(tokenizer, "hf", None)
    raw = hf.id_to_token(token_id) if hf is not None else None
    if raw is not None and all(c in _BYTE_DECODER for c in raw):
        return [_BYTE_DECODER[c] for c in raw]
    return list(tokenizer.token_to_text(token_id).encode("utf-8", "replace"))


class _Tokens:
    """Token ids with their logprob entries, shaped as a choice's ``logprobs``; one per answer
    (it counts the characters of the answer's text so far, for ``text_offset``)."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self.chars = 0  # characters of the text before the next token
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def _offset(self, token_id: int) -> int:
        """Where `token_id` starts in the text: the index of the character its first byte
        begins, or continues (a token may hold part of a character)."""
        at = self.chars
        raw = token_bytes(self.tok, token_id)
        text = token_text(self.tok, token_id) if raw is None else self._utf8.decode(bytes(raw))
        self.chars += len(text)
        return at

    def text(self, ids: Sequence[int], entries: Sequence[TokenLogprob | None]) -> dict:
        """Completions' ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``; the
        chosen token is always among its position's ``top_logprobs`` (as vLLM does). Each
        offset indexes into the choice's ``text`` (echo: the prompt, special tokens kept)."""
        tokens, lps, tops, offsets = [], [], [], []
        for tid, e in zip(ids, entries):
            s = token_text(self.tok, tid)
            tokens.append(s)
            offsets.append(self._offset(tid))
            if e is None:
                lps.append(None)
                tops.append(None)
                continue
            lps.append(_finite(e.logprob))
            top = {token_text(self.tok, t): _finite(lp) for t, lp in e.top}
            top.setdefault(s, _finite(e.logprob))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
                "text_offset": offsets}

    def chat(self, ids: Sequence[int], entries: Sequence[TokenLogprob]) -> dict:
        """Chat's ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``."""
        def one(t: int, lp: float) -> dict:
            return {"token": token_text(self.tok, t), "logprob": _finite(lp),
                    "bytes": token_bytes(self.tok, t)}

        return {"content": [{**one(t, e.logprob), "top_logprobs": [one(a, lp) for a, lp in e.top]}
                            for t, e in zip(ids, entries)]}


def completion_body(req: CompletionRequest, text: str, finish_reason: str | None,
                    completion_tokens: int, *, token_ids: Sequence[int] = (),
                    logprobs: Sequence[TokenLogprob] | None = None,
                    prompt_logprobs: Sequence[TokenLogprob | None] | None = None,
                    tokenizer=None) -> dict:
    """The whole answer of a non-streamed completion (``echo``: the prompt first)."""
    lp = None
    if req.score_only:  # max_tokens 0: the one token generated is not part of the answer
        text, token_ids, completion_tokens, finish_reason = "", (), 0, "length"
        logprobs = [] if logprobs is not None else None
    if req.logprobs is not None and logprobs is not None:
        ids, entries = list(token_ids), list(logprobs)
        if req.echo:
            ids = req.prompt_ids + ids
            entries = list(prompt_logprobs or [None] * len(req.prompt_ids)) + entries
        lp = _Tokens(tokenizer).text(ids, entries)
    if req.echo:
        text = (req.prompt_text or "") + text
    return {"id": req.id, "object": "text_completion", "created": req.created,
            "model": req.model,
            "choices": [{"index": req.index, "text": text, "logprobs": lp,
                         "finish_reason": openai_finish_reason(finish_reason)}],
            "usage": usage_body(len(req.prompt_ids), completion_tokens)}


def _stream_chunk(req: CompletionRequest, obj: str, choice: dict | None,
                  usage: dict | None) -> dict:
    """One server-sent event of either endpoint; ``choice=None`` is the usage-only last chunk
    (``choices`` empty), sent when ``stream_options.include_usage`` is true."""
    body = {"id": req.id, "object": obj, "created": req.created, "model": req.model,
            "choices": [] if choice is None else [choice]}
    if req.include_usage:
        body["usage"] = usage  # null on every chunk but the last, as OpenAI does
    return body


def chunk_body(req: CompletionRequest, text: str | None, finish_reason: str | None = None,
               usage: dict | None = None, logprobs: dict | None = None) -> dict:
    """One server-sent event of a streamed completion (``text=None``: usage only)."""
    choice = None if text is None else {"index": req.index, "text": text, "logprobs": logprobs,
                                        "finish_reason": openai_finish_reason(finish_reason)}
    return _stream_chunk(req, "text_completion", choice, usage)


def chat_body(req: CompletionRequest, text: str, finish_reason: str | None,
              completion_tokens: int, *, token_ids: Sequence[int] = (),
              logprobs: Sequence[TokenLogprob] | None = None, tokenizer=None) -> dict:
    """The whole answer of a non-streamed chat completion."""
    lp = (_Tokens(tokenizer).chat(list(token_ids), list(logprobs))
          if req.logprobs is not None and logprobs is not None else None)
    return {"id": req.id, "object": "chat.completion", "created": req.created,
            "model": req.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": lp, "finish_reason": openai_finish_reason(finish_reason)}],
            "usage": usage_body(len(req.prompt_ids), completion_tokens)}


def chat_chunk_body(req: CompletionRequest, delta: dict | None, finish_reason: str | None = None,
                    usage: dict | None = None, logprobs: dict | None = None) -> dict:
    """One server-sent event of a streamed chat completion (``delta=None``: usage only)."""
    choice = None if delta is None else {"index": 0, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": openai_finish_reason(finish_reason)}
    return _stream_chunk(req, "chat.completion.chunk", choice, usage)


class Streamer:
    """Turns a request's successive `RequestOutput`s into its server-sent event bodies (text or
    chat chunks), keeping what the stream has sent so far (tokens, text offset)."""

    def __init__(self, req: CompletionRequest, tokenizer=None,
                 prompt_logprobs: Sequence[TokenLogprob | None] | None = None) -> None:
        self.req, self.tok = req, tokenizer
        self.shape = _Tokens(tokenizer)
        self.sent_tokens = 0
        self.prompt_logprobs = prompt_logprobs

    def first(self) -> list[dict]:
        """Events before any token: chat's role, completions' echoed prompt."""
        req = self.req
        if req.kind == "chat":
            return [chat_chunk_body(req, {"role": "assistant", "content": ""})]
        if not req.echo:
            return []
        lp = None
        if req.logprobs is not None:
            entries = list(self.prompt_logprobs or [None] * len(req.prompt_ids))
            lp = self.shape.text(req.prompt_ids, entries)
        return [chunk_body(req, req.prompt_text or "", None, logprobs=lp)]

    def step(self, out) -> dict:
        """The event for one engine step's output (one new token)."""
        req = self.req
        if req.score_only:  # max_tokens 0: nothing but the end
            return chunk_body(req, "", "length", logprobs=None if req.logprobs is None else
                              {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                               "text_offset": []})
        new_ids = out.token_ids[self.sent_tokens:]
        entries = (out.logprobs or [])[self.sent_tokens:] if req.logprobs is not None else None
        self.sent_tokens = len(out.token_ids)
        reason = out.finish_reason if out.finished else None
        if req.kind == "chat":
            lp = self.shape.chat(new_ids, entries) if entries is not None else None
            delta = {"content": out.delta} if out.delta or not out.finished else {}
            return chat_chunk_body(req, delta, reason, logprobs=lp)
        lp = self.shape.text(new_ids, entries) if entries is not None else None
        return chunk_body(req, out.delta, reason, logprobs=lp)

    def usage(self, completion_tokens: int, prompt_tokens: int | None = None) -> dict:
        """The usage-only last chunk (`prompt_tokens`: a batch's, default this request's)."""
        u = usage_body(len(self.req.prompt_ids) if prompt_tokens is None else prompt_tokens,
                       completion_tokens)
        if self.req.kind == "chat":
            return chat_chunk_body(self.req, None, usage=u)
        return chunk_body(self.req, None, usage=u)


def reply_body(req: CompletionRequest, out, tokenizer=None,
               prompt_logprobs: Sequence[TokenLogprob | None] | None = None) -> dict:
    """The whole answer for a finished `RequestOutput` (completions or chat)."""
    text = out.text if out.text is not None else ""
    kw = dict(token_ids=out.token_ids, logprobs=getattr(out, "logprobs", None), tokenizer=tokenizer)
    if req.kind == "chat":
        return chat_body(req, text, out.finish_reason, len(out.token_ids), **kw)
    return completion_body(req, text, out.finish_reason, len(out.token_ids),
                           prompt_logprobs=prompt_logprobs, **kw)


def merge_bodies(bodies: Sequence[dict]) -> dict:
    """One answer for a list of prompts: every body's choice in order, the usage added up."""
    if len(bodies) == 1:
        return bodies[0]
    merged = dict(bodies[0], choices=[c for b in bodies for c in b["choices"]])
    merged["usage"] = usage_body(sum(b["usage"]["prompt_tokens"] for b in bodies),
                                 sum(b["usage"]["completion_tokens"] for b in bodies))
    return merged
