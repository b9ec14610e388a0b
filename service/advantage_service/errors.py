"""The one error type a request can fail with.

Every check that rejects client input raises :class:`RequestError`; the transports map it to
HTTP 422/413 or gRPC INVALID_ARGUMENT/RESOURCE_EXHAUSTED without looking inside.
"""

from __future__ import annotations

from typing import Any


class RequestError(ValueError):
    """A request the service will not compute, with where the problem is.

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
        super().__init__(message)
        self.code = code
        self.message = message
        self.group_id = group_id
        self.rollout_index = rollout_index
        self.field = field
        self.status = status

    def to_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "message": self.message,
            "group_id": self.group_id,
            "rollout_index": self.rollout_index,
            "field": self.field,
        }

    def __repr__(self) -> str:
        return f"RequestError({self.to_dict()!r})"


class LimitExceeded(RequestError):
    """A request over a configured size limit (HTTP 413, gRPC RESOURCE_EXHAUSTED)."""

    def __init__(self, message: str, *, field: str | None = None, **where: Any) -> None:
        super().__init__("limit_exceeded", message, field=field, status=413, **where)
