"""Retries with exponential backoff and jitter, honouring the service's retry hints, and loud:
a call that fails and is retried logs a warning at once and then every few seconds, so that a
service restart never looks like a hung training step."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

log = logging.getLogger("advantage_client.retry")

# A millisecond hint is waited out plus up to this share more, so that clients refused at the
# same moment (and given the same hint) do not all come back at the same moment.
HINT_JITTER = 0.2
# Seconds between two warnings about one call that keeps failing (the first is at once).
LOG_EVERY = 5.0


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


class RetryStats:
    """Retries counted over a client's life (shared by its threads): a trainer reports the
    difference around a call as its metric."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.retries = 0

    def add(self) -> None:
        with self._lock:
            self.retries += 1


class RetryLog:
    """The warnings about one call's retries: one at its first failed attempt, then one every
    :data:`LOG_EVERY` seconds while it keeps failing, each saying what fails, for how long so
    far and how long it will keep trying; one when it recovers or gives up."""

    def __init__(
        self,
        policy: RetryPolicy,
        what: str,
        stats: RetryStats | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self.what = what
        self.stats = stats
        self.clock = clock
        self.began = clock()
        self.next_warning: float | None = None

    def _left(self, attempt: int, waited: float) -> str:
        if self.policy.retries is not None:
            return f"{self.policy.retries - attempt} more retries"
        return f"{max(0.0, self.policy.retry_for - waited):.0f} s more of waits"

    def retrying(self, error: BaseException, attempt: int, waited: float, wait: float) -> None:
        """Before the ``attempt``-th retry (0: the first), after ``waited`` seconds of waits."""
        if self.stats is not None:
            self.stats.add()
        elapsed = self.clock() - self.began
        if self.next_warning is not None and elapsed < self.next_warning:
            return
        self.next_warning = elapsed + LOG_EVERY
        log.warning(
            "%s failed (%s): %d failed tries in %.1f s so far; retrying in %.1f s, "
            "will keep trying for %s",
            self.what,
            error,
            attempt + 1,
            elapsed,
            wait,
            self._left(attempt, waited),
        )

    def recovered(self, attempt: int) -> None:
        if attempt:
            log.warning(
                "%s succeeded after %d retries in %.1f s",
                self.what,
                attempt,
                self.clock() - self.began,
            )

    def gave_up(self, error: BaseException, attempt: int) -> None:
        log.error(
            "%s failed; giving up after %d retries in %.1f s: %s",
            self.what,
            attempt,
            self.clock() - self.began,
            error,
        )


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

    def run(
        self,
        attempt_fn: Callable[[], T],
        sleep: Callable[[float], None] = time.sleep,
        *,
        what: str = "a call to the advantage service",
        stats: RetryStats | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> T:
        """``attempt_fn()`` until it returns, raises something other than :class:`Retryable`,
        or the retries are spent (then the last error is raised). Each retry is counted in
        ``stats`` and logged (see :class:`RetryLog`) under ``what``."""
        attempt = 0
        waited = 0.0
        retry_log = RetryLog(self, what, stats, clock)
        while True:
            try:
                result = attempt_fn()
            except Retryable as exc:
                if self.exhausted(attempt, waited):
                    if attempt:
                        retry_log.gave_up(exc.last, attempt)
                    raise exc.last from None
                wait = self.delay(attempt, exc.retry_after, exc.retry_after_ms)
                retry_log.retrying(exc.last, attempt, waited, wait)
                sleep(wait)
                waited += wait
                attempt += 1
                continue
            retry_log.recovered(attempt)
            return result
