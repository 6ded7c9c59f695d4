"""Limits on what a client may make the server hold: request bodies are capped while they are read,
and a request that stops half-way is dropped.

- ``BodyGuard`` (pure ASGI, in front of the app): a ``Content-Length`` over the cap is answered 413
  before one byte of the body is read; a chunked body is counted as it arrives and answered 413 the
  moment it passes the cap, so the server never holds more than the cap of one body (measured in
  tests/serve/test_limits.py: the server's RSS stays flat while 200 MB are sent either way), and all
  requests' bodies together stay under ``max_held`` (503 past it). A body must arrive in full within
  ``body_timeout`` seconds, else 408. These answers close the connection, so the rest of the body is
  never read.
- ``GuardedH11Protocol`` (uvicorn's h11 protocol): a connection's request line and headers must
  arrive within ``header_timeout`` seconds of its opening (or of the previous response), else it is
  closed: uvicorn's keep-alive timer restarts on every byte, so a client sending a header byte now
  and then was held forever. h11's own bound (16 KiB of headers) caps their size.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Awaitable, Callable

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_HEADER_TIMEOUT = 10.0  # seconds for a request line and headers
DEFAULT_BODY_TIMEOUT = 60.0  # seconds for a whole body (a 32 MiB image at ~5 Mbit/s)
MAX_HELD_BODIES = 8  # all requests' bodies together: this many at the per-request cap


class BodyGuard:
    """Reads each request's body (bounded in size and time) before the app runs, then hands the
    app the body in one message; later ``receive`` calls (disconnect checks) go to the server.

    ``max_held`` bounds the bodies of all requests together (read, or handed to the app and not yet
    answered): past it a request is answered 503 (retry) instead of growing the server further, so
    many clients at the per-request cap cannot exhaust memory either. Everything runs on the event
    loop's one thread, so the count needs no lock."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_body: int,
        body_timeout: float = DEFAULT_BODY_TIMEOUT,
        max_held: int | None = None,
    ):
        self.app, self.max_body, self.body_timeout = app, max_body, body_timeout
        self.max_held = max_held if max_held is not None else MAX_HELD_BODIES * max_body
        self.held = 0  # bytes of bodies counted against max_held now

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        reserved = 0
        try:
            declared = [v for k, v in scope.get("headers", ()) if k.lower() == b"content-length"]
            if declared:  # (h11 has refused a malformed or conflicting Content-Length already)
                try:
                    n = int(declared[0])
                except ValueError:
                    await refuse(send, 400, "the Content-Length header is not a number", "invalid_request")
                    return
                if n > self.max_body:
                    await self.too_large(send, f"the body ({n:,} bytes, said Content-Length) is")
                    return
                if not self.hold(n):
                    await self.busy(send)
                    return
                reserved = n
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.body_timeout
            body = bytearray()
            while True:
                try:
                    msg = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:
                    await refuse(
                        send,
                        408,
                        f"the request body did not arrive within {self.body_timeout:g} s ({len(body):,} bytes came)",
                        "request_timeout",
                    )
                    return
                if msg["type"] == "http.disconnect":
                    return  # the client left before its body was complete: nothing to answer
                body += msg.get("body", b"")
                if len(body) > self.max_body:
                    del body[:]
                    await self.too_large(send, "the body is")
                    return
                if len(body) > reserved:  # a chunked body (or more than declared: h11 stops that)
                    if not self.hold(len(body) - reserved):
                        del body[:]
                        await self.busy(send)
                        return
                    reserved = len(body)
                if not msg.get("more_body", False):
                    break
            data: bytes | None = bytes(body)
            del body[:]

            async def replay() -> Message:
                nonlocal data
                if data is not None:
                    out, data = data, None
                    return {"type": "http.request", "body": out, "more_body": False}
                return await receive()

            await self.app(scope, replay, send)
        finally:
            self.held -= reserved

    def hold(self, n: int) -> bool:
        if self.held + n > self.max_held:
            return False
        self.held += n
        return True

    async def too_large(self, send: Send, what: str) -> None:
        await refuse(send, 413, f"{what} larger than {self.max_body >> 20} MiB", "body_too_large")

    async def busy(self, send: Send) -> None:
        await refuse(
            send,
            503,
            f"the server is reading {self.held >> 20} MiB of other requests' bodies (its bound): retry shortly",
            "server_busy",
            type_="server_error",
            retry_after=1,
        )


async def refuse(
    send: Send,
    status: int,
    message: str,
    code: str,
    type_: str = "invalid_request_error",
    retry_after: int | None = None,
) -> None:
    """An OpenAI-shaped error that closes the connection (the unread rest of a body is dropped)."""
    err = {"message": message, "type": type_, "param": None, "code": code}
    body = json.dumps({"error": err}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def guarded_h11(header_timeout: float = DEFAULT_HEADER_TIMEOUT):
    """uvicorn's h11 protocol class with a header timeout (pass as ``uvicorn.Config(http=...)``)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def on_response_complete(self) -> None:
            # the next request's headers have the same bound; armed before uvicorn starts a pipelined
            # request already here (then the cycle changes and the timer does nothing)
            self._arm_header_timer()
            super().on_response_complete()

        def connection_lost(self, exc) -> None:
            timer = getattr(self, "_header_timer", None)
            if timer is not None:
                timer.cancel()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            timer = getattr(self, "_header_timer", None)
            if timer is not None:
                timer.cancel()
            self._header_timer = self.loop.call_later(header_timeout, self._headers_overdue, self.cycle)

        def _headers_overdue(self, cycle_then) -> None:
            # no request began since the timer was armed (the cycle is the same): headers are overdue
            if self.cycle is cycle_then and not self.transport.is_closing():
                self.transport.close()

    return GuardedH11Protocol
