"""What stands between the network and the server's routes: `Guard`, ASGI middleware that
refuses before any route runs what the server must not take (a foreign ``Host``: DNS rebinding;
no API key; a body that is not JSON: a web page cannot post one without a CORS preflight; too
large or too slow), and `h11_protocol`, which stops slow clients."""

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

from ..engine.errors import APIError

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
    """Pure ASGI middleware around the whole app: the guards, the body's deadline and size
    limit, one JSON 500 for any unexpected exception, every error counted by status."""

    BODY_METHODS = ("POST", "PUT", "PATCH")
    POST_PATHS = ("/v1/completions", "/v1/chat/completions")  # the routes that take a body

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
        state = {"started": False, "done": False, "body_read": not _has_body(scope)}

        async def counted_send(message) -> None:
            if message["type"] == "http.response.start":
                state["started"] = True
                if message["status"] >= 400:
                    self.metrics.rejected.labels(str(message["status"])).inc()
                    if not state["body_read"]:  # the rest of it would keep the connection
                        message = dict(message, headers=[*message.get("headers", []),
                                                         (b"connection", b"close")])
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                state["done"] = True
            await send(message)

        refusal = self._check(scope)
        if refusal is not None:
            await _send_error(counted_send, refusal)
            return
        scope["minifer.trusted"] = True  # past the key: `h11_protocol` never evicts it
        try:
            await self.app(scope, self._reader(scope, receive, state), counted_send)
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
        if self.allowed_hosts is not None and not _host_allowed(h.get("host"), self.allowed_hosts):
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
        if scope.get("method") == "POST" and scope.get("path") in self.POST_PATHS:  # else 405
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

    def _reader(self, scope, receive, state: dict):
        """`receive` with the body's deadline and size limit (APIError 408 / 413); sets
        ``state["body_read"]`` once the whole body is in."""
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
                state["body_read"] = done
            else:
                done = True
            return message

        return read


def _has_body(scope) -> bool:
    """Whether the request says a body follows its headers (a length > 0, or chunks)."""
    return any((k.lower() == b"content-length" and v.strip() not in (b"0", b""))
               or k.lower() == b"transfer-encoding" for k, v in scope.get("headers", []))


def _body_too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit:,} bytes", code="body_too_large")


def h11_protocol(header_timeout_s: float, max_header_bytes: int = MAX_HEADER_BYTES):
    """uvicorn's h11 protocol, plus what stops slow clients from holding connections:

    - a deadline for each request's headers (`header_timeout_s`, 408; uvicorn's own timer
      restarts with each byte), and one of twice that for the whole request, body included;
    - at the connection limit, a new connection evicts the oldest one still sending headers
      that never passed the guard (authenticated connections are never crowded out);
    - headers that outgrow `max_header_bytes` get `Guard`'s JSON 431 (`SlowClients`)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    return type("Protocol", (SlowClients, H11Protocol), {
        "h11": h11, "header_timeout_s": header_timeout_s, "max_header_bytes": max_header_bytes})


class SlowClients:
    """`h11_protocol`'s methods, a mixin before uvicorn's ``H11Protocol``; `h11_protocol` sets
    ``h11`` (the module), ``header_timeout_s`` and ``max_header_bytes``."""

    _header_timer = None
    _request_timer = None
    trusted = False  # a request on it passed the guard
    opened = 0.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.opened = self.loop.time()
        self._arm()
        limit = self.limit_concurrency
        while limit is not None and len(self.connections) >= limit and self._evict():
            pass

    def _evict(self) -> bool:
        """Close the oldest untrusted connection still in its headers; False if none."""
        idle = [c for c in self.connections if c is not self and not c.trusted
                and not c.scope_trusted() and c.conn.their_state is self.h11.IDLE
                and not c.transport.is_closing()]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c.opened)
        oldest._close(b"503 Service Unavailable", b"the server is full: this connection "
                      b"sent no complete request in time and gave way to a new one")
        self.connections.discard(oldest)
        return True

    def scope_trusted(self) -> bool:
        return bool(getattr(self, "scope", None) and self.scope.get("minifer.trusted"))

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._too_slow)
        if self._request_timer is None:
            self._request_timer = self.loop.call_later(2 * self.header_timeout_s,
                                                       self._request_too_slow)

    def _disarm(self, request: bool = True) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        if request and self._request_timer is not None:
            self._request_timer.cancel()
            self._request_timer = None

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        their = self.conn.their_state
        if self.transport.is_closing():
            self._disarm()
        elif their is self.h11.IDLE:
            self._arm()  # (more of) the next request's headers: they have a deadline
        elif their is self.h11.SEND_BODY:
            self._disarm(request=False)  # the headers are in; the body has the rest
        else:
            self._disarm()

    def on_response_complete(self) -> None:
        if self.scope_trusted():
            self.trusted = True
        super().on_response_complete()
        if self.conn.their_state is not self.h11.SEND_BODY:
            self._disarm()  # idle again: uvicorn's keep-alive timeout takes over

    def _close(self, status: bytes, body: bytes) -> None:
        self.transport.write(b"HTTP/1.1 " + status + b"\r\nconnection: close\r\n"
                             b"content-type: text/plain\r\ncontent-length: %d\r\n\r\n%s"
                             % (len(body), body))
        self.transport.close()

    def _too_slow(self) -> None:
        self._header_timer = None
        if self.conn.their_state is self.h11.IDLE and not self.transport.is_closing():
            self._close(b"408 Request Timeout", b"request headers did not arrive in time")

    def _request_too_slow(self) -> None:
        self._request_timer = None
        if self.transport.is_closing() or self.conn.their_state not in (self.h11.IDLE,
                                                                         self.h11.SEND_BODY):
            return
        if self.cycle is None or not self.cycle.response_started:
            self._close(b"408 Request Timeout", b"the request did not arrive in time")
        else:
            self.transport.close()  # answered already; the rest of the body is not wanted

    def send_400_response(self, msg: str) -> None:
        # uvicorn's answer to any h11.RemoteProtocolError; h11 raises one for a buffer past
        # its limit with the headers not yet ended (its only 431 case), and keeps the buffer
        h11, limit = self.h11, self.max_header_bytes
        pending, _ = self.conn.trailing_data
        if self.conn.their_state is not h11.ERROR or len(pending) <= limit:
            return super().send_400_response(msg)
        err = APIError(431, f"the request headers are over {limit:,} bytes ({len(pending):,} "
                       f"arrived before they ended); this server takes at most {limit:,}",
                       code="headers_too_large")
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
