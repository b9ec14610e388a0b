"""The pre-parsers: what checks an untrusted request body before any decoder reads it, one per
wire format, behind one interface.

Every pre-parser takes the body's bytes and the one :class:`RequestLimits` the settings give
(``Settings.request_limits``, config.py) and either returns what it saw of
the body within its bounds (a shape: its own, as each decoder needs) or raises the
:class:`RequestError` the request gets, naming the group, rollout and field where it knows
them: 413 ``limit_exceeded`` over a limit (rollouts, groups, tokens, string lengths, teacher
conditions, ...), 422 otherwise. A request over a bound is refused alike whatever carries it
(tests/wire/test_guards.py holds the three to it).

:data:`PRE_PARSERS` is the table of them by wire format, where the Arrow and gRPC codecs look
theirs up (the JSON codec, wire/jsonio.py, runs the same pass on the body it has re-encoded):

- ``json``: wire/json_guard.py's pass over the bytes (its own limits value, ``BodyLimits``,
  taken from these), on a UTF-8 body (jsonio re-encodes UTF-16 and UTF-32 first);
- ``arrow``: the stream's messages walked (transports/arrow_ipc.py), its schema planned and
  every batch's layout counted (transports/arrow_columns.py), the options in its
  ``advantage.request`` metadata by the JSON pass;
- ``grpc``: a unary ``ComputeRequest``'s wire bytes scanned (transports/grpc_wire.py).

The pre-parsers themselves import nothing of this module: they satisfy :class:`PreParser` by
their signature alone.
"""

from __future__ import annotations

from typing import Protocol, TypedDict, TypeVar

from ..config import RequestLimits
from ..wire.json_guard import BodyShape, check_body
from ..wire.json_limits import BodyLimits
from .arrow_columns import StreamShape, check_stream
from .grpc_wire import MessageShape, check_compute_request

__all__ = [
    "PRE_PARSERS",
    "BodyShape",
    "MessageShape",
    "PreParser",
    "PreParsers",
    "RequestLimits",
    "StreamShape",
    "check_json",
]

Body = TypeVar("Body", contravariant=True)
Shape = TypeVar("Shape", covariant=True)


class PreParser(Protocol[Body, Shape]):
    """Checks a body (``bytes`` at least; Arrow's also a view of a buffer, as its decoder
    reads it) against the limits before a decoder reads it: its shape, or the
    :class:`RequestError` it gets (413 over a limit, 422 otherwise)."""

    def __call__(self, body: Body, limits: RequestLimits, /) -> Shape: ...


def check_json(body: bytes, limits: RequestLimits) -> BodyShape:
    """The JSON pass (wire/json_guard.py) on the service's limits."""
    return check_body(
        body, BodyLimits(max_tokens=limits.max_tokens, max_rollouts=limits.max_rollouts)
    )


class PreParsers(TypedDict):
    """The pre-parser of each wire format, each with its own shape."""

    json: PreParser[bytes, BodyShape]
    arrow: PreParser[bytes | bytearray | memoryview, StreamShape]
    grpc: PreParser[bytes, MessageShape]


PRE_PARSERS: PreParsers = {
    "json": check_json,
    "arrow": check_stream,
    "grpc": check_compute_request,
}
