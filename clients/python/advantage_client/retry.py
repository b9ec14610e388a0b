"""Retries with exponential backoff and jitter, honouring the service's Retry-After."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


class Retryable(Exception):
    """Raised by an attempt that may be retried; ``last`` is what to raise when out of tries."""

    def __init__(self, last: BaseException, retry_after: float | None = None) -> None:
        super().__init__(str(last))
        self.last = last
        self.retry_after = retry_after


@dataclass(frozen=True)
class RetryPolicy:
    """``retries`` more tries after the first; the n-th waits a random time in
    [backoff * 2^n / 2, backoff * 2^n], at most ``max_backoff``, and at least the service's
    Retry-After (itself capped by ``max_backoff``)."""

    retries: int = 3
    backoff: float = 0.1
    max_backoff: float = 10.0

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        ceiling = min(self.max_backoff, self.backoff * 2**attempt)
        wait = random.uniform(ceiling / 2, ceiling)
        if retry_after is not None:
            wait = max(wait, min(retry_after, self.max_backoff))
        return wait

    def run(self, attempt_fn: Callable[[], T], sleep: Callable[[float], None] = time.sleep) -> T:
        """``attempt_fn()`` until it returns, raises something other than :class:`Retryable`,
        or the retries are spent (then the last error is raised)."""
        attempt = 0
        while True:
            try:
                return attempt_fn()
            except Retryable as exc:
                if attempt >= self.retries:
                    raise exc.last from None
                sleep(self.delay(attempt, exc.retry_after))
                attempt += 1
