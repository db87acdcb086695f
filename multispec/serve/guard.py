"""The checks every request passes before it is parsed: the API key and the body size.

A plain ASGI middleware, so that a refused request costs neither JSON parsing nor validation, and
an oversized body is refused as soon as it is known to be too large (from its Content-Length, or
while it is read when it is sent in chunks), never read whole.
"""

from __future__ import annotations

import secrets
from typing import Callable

from multispec.serve.errors import APIError


class Guard:
    """``/v1/*`` needs ``Authorization: Bearer <api_key>`` when a key is set (401 otherwise);
    bodies larger than ``max_bytes`` get 413. ``reject`` turns an ``APIError`` into the response
    (and counts it)."""

    def __init__(self, app, api_key: str | None, max_bytes: int, reject: Callable[[APIError], object]):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_bytes = max_bytes
        self.reject = reject

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            self._authorize(scope)
            body = await self._read_body(scope, receive)
        except APIError as error:
            return await self.reject(error)(scope, receive, send)
        return await self.app(scope, _replay(body, receive), send)

    def _authorize(self, scope) -> None:
        if self.expected is None or not scope["path"].startswith("/v1/"):
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not secrets.compare_digest(given, self.expected):
            raise APIError(401, "a valid API key is needed: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def _read_body(self, scope, receive) -> bytes:
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if not length.isdigit():
                raise APIError(400, f"Content-Length {length.decode(errors='replace')!r} is not a number")
            if int(length) > self.max_bytes:
                raise self._too_large()
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks)  # the client left; the app will find out
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                raise self._too_large()
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than this server's --max-request-bytes ({self.max_bytes})",
                        code="request_too_large")


def _replay(body: bytes, receive):
    """A ``receive`` that hands the app the body already read, then the client's own messages
    (such as the disconnect a streaming response watches for)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
