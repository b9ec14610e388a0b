"""Reading a request's body over HTTP within its limits: its size (413 before a byte is read
when Content-Length says so), its deadline and minimum rate (408), into one buffer of its size;
what is left of a body its answer came before, dropped so that its client reads the answer, and
the connection closed (:class:`UnreadBodies`, on every route); the bodies the service cannot
frame or decode, refused."""

from __future__ import annotations

import asyncio
import contextlib
import io
from collections.abc import Callable
from typing import Any

from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from ..errors import LimitExceeded, RequestError

__all__ = ["UnreadBodies", "closing", "declared_length", "discard_body", "read_body"]


def _deadline(start: float, seconds: float, min_rate: int, grace: float) -> Callable[[int], float]:
    """When a body that began at ``start`` is late, given the bytes it has sent: at its final
    deadline, ``seconds`` later, or once what it has sent falls under ``min_rate`` bytes per
    second (0: no minimum) after the first ``grace`` seconds (bytes / min_rate seconds of credit
    after the grace period)."""
    final = start + seconds
    if not min_rate:
        return lambda sent: final
    return lambda sent: min(final, start + grace + sent / min_rate)


def declared_length(
    request: Request, limit: int, setting: str = "ADV_MAX_BODY_BYTES"
) -> int | None:
    """The body's Content-Length (None without one); a 413 when it is over ``limit``."""
    declared = request.headers.get("content-length")
    length = int(declared) if declared is not None and declared.isdigit() else None
    if length is not None and length > limit:
        raise LimitExceeded(
            f"the body has {length} bytes; the limit is {limit} ({setting})", field="body"
        )
    return length


async def read_body(
    request: Request,
    limit: int,
    timeout: float,
    hold: Callable[[int], None] | None = None,
    *,
    setting: str = "ADV_MAX_BODY_BYTES",
    min_rate: int = 0,
    grace: float = 0.0,
) -> bytes:
    """The request body in one buffer, refusing more than ``limit`` bytes (413, naming
    ``setting``) and slow senders (408): the whole body within ``timeout`` seconds and, after
    the first ``grace`` seconds, an average of at least ``min_rate`` bytes per second (0: no
    minimum), so that a client trickling bytes holds its place for seconds, not for the whole
    timeout. ``hold(n)`` is told the bytes received so far (the byte budget: it may refuse).

    With Content-Length, a body over ``limit`` is refused before a byte is read; otherwise one
    buffer of that size is allocated (zeroed by calloc: its pages become resident only as
    bytes arrive) and each received message is copied into it, so the body costs its own size
    (chunks kept in a list and joined cost twice that at the join). Without Content-Length
    (chunked), the buffer grows as messages arrive, by an eighth at least each time (glibc
    moves a large block by remapping its pages, not by copying them), and a message that would
    take it past ``limit`` is refused before it is copied. The buffer is an ``io.BytesIO`` over
    a ``bytes`` object it owns alone, so it is written in place, and ``getvalue()`` hands that
    same object over without a copy: decoders get immutable ``bytes``. A refused body's buffer
    is freed before the error is answered.
    """
    length = declared_length(request, limit, setting)
    # (bytes(n) passed straight in: the BytesIO holds the only reference, so it writes in place)
    buffer = io.BytesIO(bytes(length)) if length else io.BytesIO()
    received = 0
    loop = asyncio.get_running_loop()
    start = loop.time()
    due = _deadline(start, timeout, min_rate, grace)
    try:
        async with asyncio.timeout_at(due(received)) as deadline:
            async for chunk in request.stream():
                received += len(chunk)
                if received > limit:
                    raise LimitExceeded(
                        f"the body is over the limit of {limit} bytes ({setting})", field="body"
                    )
                buffer.write(chunk)
                if hold is not None:
                    hold(received)
                deadline.reschedule(due(received))
        if received != length:  # chunked (or, which the server prevents, short of its length)
            buffer.truncate(received)
        body = buffer.getvalue()
    except TimeoutError as exc:
        elapsed = loop.time() - start
        message = (
            f"the body did not arrive within {timeout:g} s (ADV_REQUEST_TIMEOUT_SECONDS or "
            "ADV_BODY_TIMEOUT_SECONDS)"
            if elapsed >= timeout
            else f"the body arrived at {received / max(elapsed, 1e-9):.0f} bytes/s ({received} "
            f"bytes in {elapsed:.1f} s), under the minimum of {min_rate} bytes/s after the "
            f"first {grace:g} s (ADV_BODY_MIN_RATE, ADV_BODY_RATE_GRACE_SECONDS)"
        )
        raise RequestError("body_timeout", message, field="body", status=408) from exc
    finally:
        buffer.close()  # frees a refused body's buffer now (the traceback keeps this frame)
    return body


async def discard_body(
    request: Request, max_bytes: int, max_seconds: float, min_rate: int = 0, grace: float = 0.0
) -> int:
    """Read and drop what is left of the request's body, at most ``max_bytes`` within
    ``max_seconds`` (as nginx's lingering close does): a client that sends its whole body before
    reading the answer then reads it instead of a connection reset. A client sending under
    ``min_rate`` bytes per second after ``grace`` seconds is not waited for (a slow sender's
    refusal must not hold its connection for long either). The bytes dropped."""
    dropped = 0
    due = _deadline(asyncio.get_running_loop().time(), max_seconds, min_rate, grace)
    with contextlib.suppress(TimeoutError, ClientDisconnect):
        async with asyncio.timeout_at(due(dropped)) as deadline:
            while dropped < max_bytes:
                message = await request.receive()
                if message["type"] != "http.request":
                    break
                dropped += len(message.get("body", b""))
                if not message.get("more_body", False):
                    break
                deadline.reschedule(due(dropped))
    return dropped


def declares_body(headers: Headers) -> bool:
    """Whether a request says a body follows (a Content-Length above 0, or chunked)."""
    declared = headers.get("content-length")
    if declared is not None:
        return declared.strip() not in ("", "0")
    return "transfer-encoding" in headers


def closing(message: Any) -> Any:
    """A response start with ``Connection: close`` (in place of any it had)."""
    headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
    return {**message, "headers": [*headers, (b"connection", b"close")]}


class UnreadBodies:
    """ASGI middleware: every route's answer to a request whose body is not whole yet (a refusal
    before or while reading it, a route that takes no body, a 404) closes the connection, after
    reading and dropping what is left (:func:`discard_body`, bounded in bytes, time and rate) so
    that a client still sending reads the answer, not a reset. A client waiting for ``100
    Continue`` has sent nothing and is answered at once (the server sends 100 only once the
    body is first read). Without this, a connection whose declared body never ends stays open
    after its answer, outside every limit (uvicorn waits for the rest before the next request).

    It refuses what the service cannot frame or decode, on every route: Content-Length beside
    Transfer-Encoding (400 ``invalid_request``, closed with the body unread: RFC 9112 6.3, the
    shape of request smuggling through a front end that frames by the other header), and a
    Content-Encoding other than identity (415 ``unsupported_media_type``: no body is decoded,
    so a compressed one would be read as its compressed bytes)."""

    def __init__(
        self, app: Any, max_bytes: int, max_seconds: float, min_rate: int, grace: float
    ) -> None:
        self.app = app
        self.limits = (max_bytes, max_seconds, min_rate, grace)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        headers = Headers(scope=scope) if scope["type"] == "http" else None
        if headers is None or not declares_body(headers):
            await self.app(scope, receive, send)
            return
        whole = False  # the body read to its end (or the client gone: nothing more comes)
        asked = False  # the body asked for at least once (uvicorn's 100 Continue went out)

        async def tracking() -> Any:
            nonlocal whole, asked
            asked = True
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                whole = True
            return message

        async def finishing(message: Any) -> None:
            if message["type"] == "http.response.start" and not whole:
                waiting = "100-continue" in headers.get("expect", "").lower()
                if asked or not waiting:
                    await discard_body(Request(scope, tracking), *self.limits)
                message = closing(message)
            await send(message)

        if "content-length" in headers and "transfer-encoding" in headers:
            refusal = _refusal(
                400,
                "invalid_request",
                "the request has both Content-Length and Transfer-Encoding; send one",
                "Transfer-Encoding",
            )

            async def unread(message: Any) -> None:
                start = message["type"] == "http.response.start"
                await send(closing(message) if start else message)

            await refusal(scope, receive, unread)
            return
        encoding = headers.get("content-encoding", "").strip().lower()
        if encoding not in ("", "identity"):
            refusal = _refusal(
                415,
                "unsupported_media_type",
                f"Content-Encoding {encoding!r} is not supported; send the body uncompressed",
                "Content-Encoding",
            )
            await refusal(scope, tracking, finishing)
            return
        await self.app(scope, tracking, finishing)


def _refusal(status: int, code: str, message: str, field: str) -> JSONResponse:
    """The error answer of the contract, for a request refused before any route."""
    error = RequestError(code, message, field=field, status=status)
    return JSONResponse({"error": error.to_dict()}, status_code=status)
