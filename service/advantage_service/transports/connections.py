"""HTTP connections before they are requests: a header deadline, a budget of their own, 431.

A connection that has not sent a request's headers whole (a new one, or one kept alive between
requests) is **pending**. A client can open pending connections by the thousand within a second
and send their headers a byte at a time; what they hold must never be what a request needs. So:

- a pending connection has ``ADV_HEADER_TIMEOUT_SECONDS`` to send its headers whole, from its
  opening or from the previous answer, then it is closed (uvicorn has no such deadline);
- at most ``ADV_MAX_PENDING_CONNECTIONS`` are pending at once: a new connection beyond it
  closes the *oldest* pending one (the one most likely to be an attacker's, and the one that
  has had the longest to speak), so that a client that connects now is always heard;
- pending connections take no place among the requests handled at once
  (``ADV_MAX_CONNECTIONS``, counted by :class:`RequestLimit` over requests whose headers are
  whole: uvicorn's ``limit_concurrency`` counts every open connection, so slow headers alone
  refused every request, ``/readyz`` included);
- a request line and headers over ``ADV_MAX_HEADER_BYTES`` are answered 431, not 400 or a
  reset (:class:`HeaderLimit` for headers that arrive whole in one read).

The protocol is uvicorn's h11 protocol with these hooks; :func:`protocol_class` binds one
:class:`PendingConnections` to it per server.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..errors import Overloaded, RequestError

log = logging.getLogger("advantage_service.connections")

# The retry hint of a request refused at ADV_MAX_CONNECTIONS (requests handled at once end fast).
RETRY_AFTER_MS = 1000
# At most one log line per this many seconds about closed pending connections.
CLOSE_LOG_SECONDS = 10.0


class PendingConnections:
    """The connections whose request headers are not whole, oldest first, each with its
    deadline. Use it from the event loop.

    ``on_pending(count)``: the number pending changed; ``on_closed(reason)``: one was closed
    (``header_timeout``, ``pending_full``, ``headers_too_large``)."""

    def __init__(
        self,
        *,
        timeout: float,
        limit: int,
        on_pending: Callable[[int], None] | None = None,
        on_closed: Callable[[str], None] | None = None,
    ) -> None:
        self.timeout = timeout
        self.limit = limit
        self._pending: OrderedDict[GuardedH11Protocol, asyncio.TimerHandle] = OrderedDict()
        self._on_pending = on_pending
        self._on_closed = on_closed
        self._closed: dict[str, int] = {}
        self._logged = 0.0

    def __len__(self) -> int:
        return len(self._pending)

    def wait(self, connection: GuardedH11Protocol) -> None:
        """``connection`` waits for a request's headers (from now, unless it already does)."""
        if connection in self._pending:
            return
        while len(self._pending) >= self.limit:
            oldest = next(iter(self._pending))
            self._close(oldest, "pending_full")
        loop = asyncio.get_running_loop()
        self._pending[connection] = loop.call_later(self.timeout, self._expire, connection)
        self._changed()

    def done(self, connection: GuardedH11Protocol) -> None:
        """``connection``'s headers are whole (or it closed)."""
        timer = self._pending.pop(connection, None)
        if timer is not None:
            timer.cancel()
            self._changed()

    def _expire(self, connection: GuardedH11Protocol) -> None:
        if connection in self._pending:
            self._close(connection, "header_timeout")

    def _close(self, connection: GuardedH11Protocol, reason: str) -> None:
        self.done(connection)
        connection.transport.close()
        self.closed(reason)

    def closed(self, reason: str) -> None:
        """Count (and now and then log) a connection closed for ``reason``."""
        if self._on_closed is not None:
            self._on_closed(reason)
        self._closed[reason] = self._closed.get(reason, 0) + 1
        now = asyncio.get_running_loop().time()
        if now - self._logged >= CLOSE_LOG_SECONDS:
            log.warning(
                "closed HTTP connections that did not send their headers in time or in bounds "
                "since the last such line: %s",
                ", ".join(f"{n} {why}" for why, n in sorted(self._closed.items())),
            )
            self._closed, self._logged = {}, now

    def _changed(self) -> None:
        if self._on_pending is not None:
            self._on_pending(len(self._pending))

    def close_all(self) -> None:
        """Close every pending connection (the server is stopping: none of them is a request)."""
        for connection in list(self._pending):
            self.done(connection)
            connection.transport.close()


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, its pending phase watched by :attr:`pending` (set per server by
    :func:`protocol_class`)."""

    pending: PendingConnections

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Requests at once are RequestLimit's to count (over requests, not connections).
        self.limit_concurrency = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self.pending.done(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def _watch(self) -> None:
        # h11's their_state is IDLE until a request's headers are whole (then SEND_BODY, then
        # DONE until the answer is sent and the next cycle starts).
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            self.pending.done(self)
        else:
            self.pending.wait(self)

    def send_400_response(self, msg: str) -> None:
        """uvicorn answers 400 to whatever h11 refuses; headers over h11's limit (its receive
        buffer past ``max_incomplete_event_size`` with no request yet) are a 431."""
        buffered, _ = self.conn.trailing_data
        if (
            self.conn.their_state is h11.ERROR
            and len(buffered) > self.conn._max_incomplete_event_size
        ):
            self._send_431()
            self.pending.closed("headers_too_large")
            return
        super().send_400_response(msg)

    def _send_431(self) -> None:
        body = json.dumps({"error": too_large(self.conn._max_incomplete_event_size)}).encode()
        head = (
            b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: application/json\r\n"
            b"connection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n"
        )
        # (Written raw: h11 refuses to send once the peer's side is in error.)
        self.transport.write(head + body)
        self.transport.close()


def too_large(limit: int) -> dict[str, Any]:
    return RequestError(
        "headers_too_large",
        f"the request line and headers are over {limit} bytes (ADV_MAX_HEADER_BYTES)",
        field="headers",
        status=431,
    ).to_dict()


class HeaderLimit:
    """ASGI middleware: a request whose line and headers are over ``limit`` bytes is a 431.
    (h11 refuses them only while they arrive in pieces: headers that come whole in one read
    pass its buffer check, so they are measured again here.)"""

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            size = len(scope["method"]) + len(scope["raw_path"]) + len(scope["query_string"]) + 12
            size += sum(len(name) + len(value) + 4 for name, value in scope["headers"])
            if size > self.limit:
                body = json.dumps({"error": too_large(self.limit)}).encode()
                await send(
                    {
                        "type": "http.response.start",
                        "status": 431,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"connection", b"close"),
                            (b"content-length", str(len(body)).encode()),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def protocol_class(pending: PendingConnections) -> type[GuardedH11Protocol]:
    """The protocol class for uvicorn's ``http=`` (one per server: its connections share
    ``pending``)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"pending": pending})


class RequestLimit:
    """ASGI middleware: at most ``limit`` HTTP requests handled at once (headers whole, not yet
    answered); beyond it a 503 with a retry hint. (Pending connections are not requests: they
    are :class:`PendingConnections`'.)"""

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit
        self.active = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.active >= self.limit:
            refusal = Overloaded(
                f"the service handles {self.active} HTTP requests, its limit "
                "(ADV_MAX_CONNECTIONS): retry later",
                retry_after_ms=RETRY_AFTER_MS,
                field="connections",
            )
            body = json.dumps({"error": refusal.to_dict()}).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 503,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"retry-after", str(refusal.retry_after_seconds).encode()),
                        (b"connection", b"close"),
                        (b"content-length", str(len(body)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1


__all__ = [
    "GuardedH11Protocol",
    "HeaderLimit",
    "PendingConnections",
    "RequestLimit",
    "protocol_class",
]
