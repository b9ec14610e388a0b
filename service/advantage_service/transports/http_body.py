"""Reading a request's body over HTTP within its limits: its size (413 before a byte is read
when Content-Length says so), its deadline and minimum rate (408), into one buffer of its size;
and dropping what is left of a refused body so that its client reads the answer."""

from __future__ import annotations

import asyncio
import contextlib
import io
from collections.abc import Callable

from starlette.requests import ClientDisconnect, Request

from ..errors import LimitExceeded, RequestError

__all__ = ["declared_length", "discard_body", "read_body"]


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
    is freed before the error is answered. Sets ``request.state.body_read`` once it is whole.
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
    request.state.body_read = True
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
