"""OpenAI-style errors: `APIError` (an HTTP status and a body naming the bad parameter), plain
Python, shared by the engine thread and the protocol."""

from __future__ import annotations

__all__ = ["APIError", "error_body"]


class APIError(Exception):
    """An error the client caused (4xx) or the server cannot take now (429/503), OpenAI-shaped.

    `headers`: extra response headers (``Retry-After`` on a 429, ``Allow`` on a 405, ...)."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = dict(headers or {})

    def __reduce__(self):  # pickles whole (the engine process sends these to the server)
        return type(self), (self.status, self.message), self.__dict__

    def body(self) -> dict:
        return error_body(self.message, param=self.param, type=self.type, code=self.code)


def error_body(message: str, *, param: str | None = None, type: str = "invalid_request_error",
               code: str | None = None) -> dict:
    """``{"error": {"message", "type", "param", "code"}}`` — what OpenAI's API returns."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
