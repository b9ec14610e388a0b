"""One accounting boundary for every call a transport answers (as KServe's interceptors are):
whatever the call ends with (an answer, a request error, the caller going away, a fault), it is
timed, counted in the request metrics and written as one access line.

Refusals for overload are counted like every other answer but not logged one line each (a
fleet of retrying clients would write thousands a second): the scheduler logs them at a bounded
rate with their count.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from ..errors import Overloaded, RequestError
from ..observability.logs import access
from ..observability.metrics import Metrics
from ..wire.request import ComputeRequest
from .auth import Principal

# Estimator label for calls that end before their estimator is known.
UNKNOWN_ESTIMATOR = "unknown"


@dataclass
class Call:
    """One call, filled in as it goes (``estimator``, ``request``, ``summary``, ``namespace``)
    by whoever learns them; ``with call:`` accounts for it once, however it ends.

    ``count``: whether it counts in the request metrics (listings and statistics reads are
    only logged)."""

    metrics: Metrics
    transport: str
    principal: Principal | None = None
    started: float = field(default_factory=time.perf_counter)
    count: bool = True
    estimator: str = UNKNOWN_ESTIMATOR
    request: ComputeRequest | None = None
    summary: dict[str, Any] | None = None
    namespace: str | None = None
    done: bool = False

    def __enter__(self) -> Call:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.done:
            return
        if exc is None:
            self.finish(200)
        elif isinstance(exc, RequestError):
            self.finish(exc.status, exc.code, log=not isinstance(exc, Overloaded))
        elif isinstance(exc, asyncio.CancelledError):
            # The client went away (gRPC cancels the handler) or shutdown ran out of time.
            self.finish(499, "cancelled", count=False)
        elif isinstance(exc, Exception):
            self.finish(500, "internal")

    def skip(self) -> None:
        """Nothing to account for here: the call's work is accounted elsewhere (a stream's
        groups, each as it is computed)."""
        self.done = True

    def finish(
        self, status: int, error: str | None = None, *, log: bool = True, count: bool = True
    ) -> None:
        """Account for the call now (once): ``status`` and the error code it ended with."""
        if self.done:
            return
        self.done = True
        elapsed = time.perf_counter() - self.started
        if self.count and count:
            m = self.metrics
            m.requests_total.labels(self.transport, self.estimator, str(status)).inc()
            if error is None:
                m.request_duration_seconds.labels(self.transport, self.estimator).observe(elapsed)
            else:
                m.request_errors_total.labels(self.transport, error).inc()
        if log:
            self._log(status, error, elapsed)

    def _log(self, status: int, error: str | None, elapsed: float) -> None:
        req, summary = self.request, self.summary
        batch = req.batch if req is not None else None
        access(
            request_id=req.request_id if req is not None else None,
            namespace=req.namespace if req is not None else self.namespace,
            principal=self.principal.name if self.principal is not None else None,
            transport=self.transport,
            estimator=self.estimator,
            groups=batch.num_groups if batch is not None else None,
            rollouts=batch.num_rollouts if batch is not None else None,
            tokens=batch.num_tokens if batch is not None else None,
            history=summary["history"] if summary is not None else None,
            compute_ms=round(summary["compute_ms"], 3) if summary is not None else None,
            total_ms=round(1000.0 * elapsed, 3),
            status=status,
            error=error,
        )


__all__ = ["UNKNOWN_ESTIMATOR", "Call"]
