"""What stands between the network and the server's routes.

`Guard` is plain ASGI middleware around the whole app: the ``Host`` header must name this
machine (loopback binds; stops DNS rebinding), an ``Authorization: Bearer`` key when the server
has one (every route but ``/health``), POST bodies must be JSON (415 otherwise: a web page
cannot post to the server without a CORS preflight, which it does not answer), at most
`MAX_BODY_BYTES` (413) arriving within `READ_TIMEOUT_S` (408), headers of at most
`MAX_HEADER_BYTES` (431). Any exception a route raises becomes one OpenAI-style JSON 500 and
the connection stays usable; every error response is counted by status. `h11_protocol` gives
uvicorn's HTTP protocol a deadline for each request's headers.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import time
import traceback
from typing import Any

from .errors import APIError

__all__ = ["Guard", "h11_protocol", "json_bytes", "LOOPBACK_HOSTS", "MAX_BODY_BYTES",
           "MAX_HEADER_BYTES", "READ_TIMEOUT_S"]

log = logging.getLogger("minifer.serve")

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")  # the Host names a loopback server answers
MAX_BODY_BYTES = 1 << 20  # a request body larger than 1 MiB is refused (413)
MAX_HEADER_BYTES = 16 << 10  # request headers larger than 16 KiB are refused (431)
READ_TIMEOUT_S = 10.0  # headers, and then the body, must arrive within this (408)


def json_bytes(obj: Any) -> bytes:
    """JSON bytes, never failing on text Python can hold but UTF-8 cannot (a lone surrogate)."""
    try:
        return json.dumps(obj, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (UnicodeEncodeError, ValueError):
        return json.dumps(obj, ensure_ascii=True, allow_nan=True).encode("ascii")


async def _send_error(send, err: APIError) -> None:
    """Answer with `err` as a whole response (from the guard: no framework involved)."""
    body = json_bytes(err.body())
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _host_allowed(host: str | None, allowed: frozenset[str]) -> bool:
    if not host:
        return False
    host = host.strip().lower()
    if host.startswith("["):  # [::1]:8000
        name = host[1:host.find("]")] if "]" in host else host
    else:
        name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    if name in allowed:
        return True
    try:  # another spelling of an allowed address (127.000.000.001 is not one: it fails here)
        return str(ipaddress.ip_address(name)) in allowed
    except ValueError:
        return False


class Guard:
    """Pure ASGI middleware around the whole app (see the module docstring): the guards, a
    deadline and a size limit on reading the body, one JSON 500 for any unexpected exception,
    and the count of every error response by status."""

    BODY_METHODS = ("POST", "PUT", "PATCH")

    def __init__(self, app, *, metrics: Any, api_key: str | None,
                 allowed_hosts: frozenset[str] | None, max_body_bytes: int,
                 max_header_bytes: int, read_timeout_s: float) -> None:
        self.app, self.metrics, self.api_key = app, metrics, api_key
        self.allowed_hosts, self.max_body_bytes = allowed_hosts, max_body_bytes
        self.max_header_bytes, self.read_timeout_s = max_header_bytes, read_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope["minifer.arrival"] = time.monotonic()  # the request timeout counts from here
        state = {"started": False, "done": False}

        async def counted_send(message) -> None:
            if message["type"] == "http.response.start":
                state["started"] = True
                if message["status"] >= 400:
                    self.metrics.rejected.labels(str(message["status"])).inc()
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                state["done"] = True
            await send(message)

        refusal = self._check(scope)
        if refusal is not None:
            await _send_error(counted_send, refusal)
            return
        try:
            await self.app(scope, self._reader(scope, receive), counted_send)
        except Exception as err:  # a bug: answer it, log it, keep the connection and the server
            log.error("request %s %s failed\n%s", scope.get("method"), scope.get("path"),
                      traceback.format_exc())
            with contextlib.suppress(Exception):
                if not state["started"]:
                    await _send_error(counted_send, APIError(
                        500, f"internal error: {type(err).__name__}: {err}", type="server_error",
                        code="internal_error"))
                elif not state["done"]:  # mid-stream: end the response cleanly
                    await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _check(self, scope) -> APIError | None:
        headers = scope.get("headers", [])
        size = sum(len(k) + len(v) + 4 for k, v in headers)
        if size > self.max_header_bytes:
            return APIError(431, f"the request headers are {size:,} bytes; this server takes at "
                            f"most {self.max_header_bytes:,}", code="headers_too_large")
        h = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in headers}
        if self.allowed_hosts is not None and not _host_allowed(h.get("host"),
                                                                self.allowed_hosts):
            return APIError(400, f"the Host header {h.get('host')!r} is not one this server "
                            f"answers to ({', '.join(sorted(self.allowed_hosts))}); this guards "
                            "a local server against DNS rebinding (--allowed-hosts adds names)",
                            code="invalid_host")
        if self.api_key is not None and scope.get("path") != "/health":
            scheme, _, key = h.get("authorization", "").strip().partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                    key.strip().encode("utf-8", "replace"), self.api_key.encode("utf-8")):
                why = "no API key" if not h.get("authorization") else "an incorrect API key"
                return APIError(401, f"{why} was provided: send the server's key as "
                                "'Authorization: Bearer <key>'", code="invalid_api_key",
                                headers={"WWW-Authenticate": "Bearer"})
        if scope.get("method") == "POST":  # the routes' only method with a body (PUT: 405)
            ctype = h.get("content-type", "").split(";")[0].strip().lower()
            if ctype != "application/json" and not (ctype.startswith("application/")
                                                    and ctype.endswith("+json")):
                return APIError(415, f"request bodies must be JSON (Content-Type: "
                                f"application/json), got {h.get('content-type', 'none')!r:.60}",
                                code="unsupported_media_type")
            length = h.get("content-length", "")
            if length.isdigit() and int(length) > self.max_body_bytes:
                return _body_too_large(self.max_body_bytes)
        return None

    def _reader(self, scope, receive):
        """`receive` with the body's deadline and size limit (APIError 408 / 413)."""
        if scope.get("method") not in self.BODY_METHODS:
            return receive
        deadline = time.monotonic() + self.read_timeout_s
        seen, done = 0, False

        async def read():
            nonlocal seen, done
            if done:
                return await receive()
            try:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise asyncio.TimeoutError
                message = await asyncio.wait_for(receive(), left)
            except asyncio.TimeoutError:
                raise APIError(408, f"the request body did not arrive within the server's read "
                               f"timeout of {self.read_timeout_s:g} s", type="timeout_error",
                               code="read_timeout") from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise _body_too_large(self.max_body_bytes)
                done = not message.get("more_body", False)
            else:
                done = True
            return message

        return read


def _body_too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit:,} bytes", code="body_too_large")


def h11_protocol(header_timeout_s: float, max_header_bytes: int = MAX_HEADER_BYTES):
    """uvicorn's h11 protocol, plus a deadline for each request's headers: a connection that
    sends nothing, or trickles its headers, is answered 408 and closed after `header_timeout_s`
    (uvicorn itself only times out idle keep-alive connections). Headers that outgrow h11's
    buffer (`max_header_bytes`, uvicorn's ``h11_max_incomplete_event_size``) before they end
    are answered with the same JSON 431 as `Guard` gives: which of the two sees them depends on
    how the bytes arrive (one read of the whole request, or several)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        _header_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout_s, self._too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self._arm()  # (more of) the next request's headers: they have a deadline
            else:
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._disarm()  # idle again: uvicorn's keep-alive timeout takes over

        def _too_slow(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                body = b"request headers did not arrive in time"
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\n"
                                     b"content-type: text/plain\r\ncontent-length: %d\r\n\r\n%s"
                                     % (len(body), body))
                self.transport.close()

        def send_400_response(self, msg: str) -> None:
            # uvicorn's answer to any h11.RemoteProtocolError; h11 raises one for a buffer past
            # its limit with the headers not yet ended (its only 431 case), and keeps the buffer
            pending, _ = self.conn.trailing_data
            if self.conn.their_state is not h11.ERROR or len(pending) <= max_header_bytes:
                return super().send_400_response(msg)
            err = APIError(431, f"the request headers are over {max_header_bytes:,} bytes "
                           f"({len(pending):,} arrived before they ended); this server takes "
                           f"at most {max_header_bytes:,}", code="headers_too_large")
            body = json_bytes(err.body())
            self.transport.write(self.conn.send(h11.Response(status_code=431, headers=[
                (b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
                (b"connection", b"close")])))
            self.transport.write(self.conn.send(h11.Data(data=body)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
            self.transport.close()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return Protocol
