"""The one error type a request can fail with.

Every check that rejects a request raises :class:`RequestError` (or a subclass): client input
(422/413), authentication (401/403), overload (:class:`Overloaded`, 503) and deadlines (504). The
transports map its ``status`` to HTTP or gRPC (INVALID_ARGUMENT, RESOURCE_EXHAUSTED,
UNAUTHENTICATED, PERMISSION_DENIED, UNAVAILABLE, DEADLINE_EXCEEDED) without looking inside.
"""

from __future__ import annotations

import reprlib
from typing import Any

from advantage_contract.errors import AdvantageError

# How much of a value a client sent an error message repeats (``shown``), and the longest an
# error's message, group id and field may be whatever built them: an error carries a megabyte
# name back to no one (over gRPC, trailing metadata that long would turn INVALID_ARGUMENT into
# RESOURCE_EXHAUSTED; over HTTP it would be a megabyte of answer).
ECHO_CHARS = 64
MAX_MESSAGE_CHARS = 1024
MAX_LOCATOR_CHARS = 256  # group_id and field: the longest id a request may carry


def shown(value: Any, limit: int = ECHO_CHARS) -> str:
    """``repr(value)`` for an error message, at most about ``limit`` characters: long strings
    and containers are abbreviated (reprlib), never rendered whole first."""
    if isinstance(value, str | bytes) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} characters)"
    text = _REPR.repr(value)
    return text if len(text) <= 2 * limit else f"{text[: 2 * limit]}..."


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = ECHO_CHARS
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 8
_REPR.maxlevel = 3


def is_text(value: str) -> bool:
    """Whether ``value`` is valid Unicode text, i.e. encodes as UTF-8: no lone surrogate (a
    Python str can hold one, from JSON's ``"\\ud800"`` or bytes decoded with
    ``surrogateescape``; UTF-8 cannot). O(1) for ASCII, which CPython flags."""
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def escaped(value: str) -> str:
    """``value`` with each lone surrogate written as its escape (``\\ud800``): text every
    encoder, log and answer takes, and that still shows what was sent."""
    if is_text(value):
        return value
    return value.encode("utf-8", "backslashreplace").decode("utf-8")


def _bounded(text: str | None, limit: int) -> str | None:
    # (escaped: an error repeats names and ids a client sent, and its answer must be writable)
    if text is None:
        return None
    shown_text = escaped(text[:limit])  # (cut before escaping: no work in proportion to junk)
    if len(text) <= limit and len(shown_text) <= limit:
        return shown_text
    return f"{shown_text[:limit]}... ({len(text)} characters)"


class RequestError(AdvantageError, ValueError):
    """A request the service will not compute, with where the problem is: the contract's
    :class:`AdvantageError` (the error object of every wire) with the service's bounds on what
    it repeats.

    ``code`` is a stable machine-readable word; ``group_id``/``rollout_index``/``field`` locate the
    offending value (``None`` where they do not apply); ``status`` is the HTTP status to answer.
    """

    def __init__(
        self,
        code: str,
        message: str,
        *,
        group_id: str | None = None,
        rollout_index: int | None = None,
        field: str | None = None,
        status: int = 422,
    ) -> None:
        super().__init__(
            code,
            _bounded(message, MAX_MESSAGE_CHARS) or "",
            group_id=_bounded(group_id, MAX_LOCATOR_CHARS),
            rollout_index=rollout_index,
            field=_bounded(field, MAX_LOCATOR_CHARS),
            status=status,
        )
        self.status: int = status

    @classmethod
    def from_contract(cls, exc: AdvantageError, *, field: str | None = None) -> RequestError:
        """The one mapping of a contract check's error (the shared builders and checks raise
        :class:`AdvantageError`) onto the service's answer: 413 for a limit, 422 otherwise;
        ``field`` renames the field where a wire calls it otherwise."""
        if isinstance(exc, RequestError) and field is None:
            return exc
        return cls(
            exc.code,
            exc.message,
            group_id=exc.group_id,
            rollout_index=exc.rollout_index,
            field=field or exc.field,
            status=413 if exc.code == "limit_exceeded" else 422,
        )

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"RequestError({self.to_dict()!r})"


# What a request over the request-wide limits may do (never split for it by the clients or the
# scheduler: a request-wide mean, std or scope would change the answer).
SPLIT_HINT = (
    "raise the limit, or split the batch where the estimator is group-scoped (a request-wide "
    "mean, std or scope would change)"
)


class LimitExceeded(RequestError):
    """A request over a configured size limit (HTTP 413, gRPC RESOURCE_EXHAUSTED)."""

    def __init__(self, message: str, *, field: str | None = None, **where: Any) -> None:
        super().__init__("limit_exceeded", message, field=field, status=413, **where)


class Overloaded(RequestError):
    """The service cannot take the request now: its queue is full, or the request waited in it
    past ``ADV_QUEUE_TIMEOUT_SECONDS`` (HTTP 503 with ``Retry-After``, gRPC UNAVAILABLE), as
    Triton, KServe and Knative answer overload. ``retry_after_ms`` is sized from the rate the
    queue drains at; clients that retry 5xx / UNAVAILABLE retry it."""

    def __init__(self, message: str, *, retry_after_ms: int, field: str | None = "queue") -> None:
        super().__init__("overloaded", message, field=field, status=503)
        self.retry_after_ms: int = int(retry_after_ms)

    @property
    def retry_after_seconds(self) -> int:
        """Whole seconds for ``Retry-After`` (rounded up, at least 1)."""
        return max(1, -(-int(self.retry_after_ms) // 1000))

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "retry_after_ms": self.retry_after_ms}


def deadline_exceeded(seconds: float) -> RequestError:
    """The answer to a request whose computation outlived ``ADV_REQUEST_TIMEOUT_SECONDS``
    (HTTP 504, gRPC DEADLINE_EXCEEDED)."""
    return RequestError(
        "deadline_exceeded",
        f"the computation took longer than {seconds:g} s (ADV_REQUEST_TIMEOUT_SECONDS): "
        "split the batch or retry later",
        status=504,
    )
