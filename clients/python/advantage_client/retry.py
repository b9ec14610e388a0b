"""Retries with exponential backoff and jitter, honouring the service's retry hints."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

# A millisecond hint is waited out plus up to this share more, so that clients refused at the
# same moment (and given the same hint) do not all come back at the same moment.
HINT_JITTER = 0.2


class Retryable(Exception):
    """Raised by an attempt that may be retried; ``last`` is what to raise when out of tries.

    ``retry_after_ms``: the service's hint in milliseconds (the body's ``retry_after_ms``, the
    ``retry-after-ms`` trailing metadata); ``retry_after``: its whole seconds (``Retry-After``).
    """

    def __init__(
        self,
        last: BaseException,
        retry_after: float | None = None,
        retry_after_ms: int | None = None,
    ) -> None:
        super().__init__(str(last))
        self.last = last
        self.retry_after = retry_after
        self.retry_after_ms = retry_after_ms


@dataclass(frozen=True)
class RetryPolicy:
    """``retries`` more tries after the first; with ``retries=None`` (the default), tries until
    ``retry_for`` seconds have been waited in all, long enough to ride out a rolling restart of
    the service (a pod replaced, its readiness probe passing again). The n-th waits:

    - with the service's millisecond hint (``retry_after_ms``), that long plus up to 20% jitter,
      whatever the backoff would be (the service sizes it from how fast its queue drains);
    - else with ``Retry-After`` seconds, a random time in [backoff * 2^n / 2, backoff * 2^n]
      but at least Retry-After;
    - else that random time alone;

    and never longer than ``max_backoff``.
    """

    retries: int | None = None
    backoff: float = 0.1
    max_backoff: float = 10.0
    retry_for: float = 60.0

    def exhausted(self, attempt: int, waited: float) -> bool:
        """Whether to give up after ``attempt`` retries that waited ``waited`` seconds."""
        if self.retries is not None:
            return attempt >= self.retries
        return waited >= self.retry_for

    def delay(
        self, attempt: int, retry_after: float | None = None, retry_after_ms: int | None = None
    ) -> float:
        if retry_after_ms is not None and retry_after_ms >= 0:
            hint = retry_after_ms / 1000.0
            return min(self.max_backoff, random.uniform(hint, hint * (1.0 + HINT_JITTER)))
        ceiling = min(self.max_backoff, self.backoff * 2**attempt)
        wait = random.uniform(ceiling / 2, ceiling)
        if retry_after is not None:
            wait = max(wait, min(retry_after, self.max_backoff))
        return wait

    def run(self, attempt_fn: Callable[[], T], sleep: Callable[[float], None] = time.sleep) -> T:
        """``attempt_fn()`` until it returns, raises something other than :class:`Retryable`,
        or the retries are spent (then the last error is raised)."""
        attempt = 0
        waited = 0.0
        while True:
            try:
                return attempt_fn()
            except Retryable as exc:
                if self.exhausted(attempt, waited):
                    raise exc.last from None
                wait = self.delay(attempt, exc.retry_after, exc.retry_after_ms)
                sleep(wait)
                waited += wait
                attempt += 1
