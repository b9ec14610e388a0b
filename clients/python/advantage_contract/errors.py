"""The one error the clients raise: the service's error object, wherever it came from."""

from __future__ import annotations

from typing import Any


class AdvantageError(Exception):
    """A request the service refused (or the client could not send), with where the problem is.

    ``code`` is the service's stable word (``invalid_type``, ``limit_exceeded``, ``overloaded``,
    ...); ``group_id``/``rollout_index``/``field`` locate the offending value (None where they
    do not apply). ``status`` is the HTTP status, ``grpc_code`` the gRPC status code name, for
    errors that came over the wire. ``retry_after`` is the whole seconds the service asked to
    wait (``Retry-After``), ``retry_after_ms`` the same hint in milliseconds where the service
    gave it (an overload refusal: the body's ``retry_after_ms``, gRPC's ``retry-after-ms``).
    """

    def __init__(
        self,
        code: str,
        message: str,
        *,
        group_id: str | None = None,
        rollout_index: int | None = None,
        field: str | None = None,
        status: int | None = None,
        grpc_code: str | None = None,
        retry_after: float | None = None,
        retry_after_ms: int | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.group_id = group_id
        self.rollout_index = rollout_index
        self.field = field
        self.status = status
        self.grpc_code = grpc_code
        self.retry_after = retry_after
        self.retry_after_ms = retry_after_ms

    def to_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "message": self.message,
            "group_id": self.group_id,
            "rollout_index": self.rollout_index,
            "field": self.field,
        }

    def __str__(self) -> str:
        where = ", ".join(
            f"{k}={v!r}"
            for k, v in (
                ("group_id", self.group_id),
                ("rollout_index", self.rollout_index),
                ("field", self.field),
            )
            if v is not None
        )
        return f"{self.code}: {self.message}" + (f" ({where})" if where else "")
