"""The writes of the terms that keep state and of the vocabulary statistics, after the answer.

Each computed request's writes (``StateSession.update``, then ``record``) run after its answer
is sent, on one worker thread of their own (at lower priority: building them costs about as much
CPU as computing the request, and must not slow the next request's computation), so they never
delay an answer or take a compute worker. At most ``max_pending`` wait at once: past that the
store is slower than the traffic, and a request's statistics are dropped (counted) rather than
letting pending writes and their tensors grow without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ..estimators import AdvantageResult
from .term_state import StateSession

log = logging.getLogger("advantage_service.stats_writer")

# Niceness of the statistics worker (and the torch threads it starts, which inherit it).
STATS_NICENESS = 10


def _lower_priority() -> None:
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), STATS_NICENESS)


class StatsWriter:
    """Schedules and tracks the writes of computed requests. Use it from the event loop."""

    def __init__(self, max_pending: int, on_error: Callable[[str], None]) -> None:
        self.max_pending = max_pending
        self._on_error = on_error
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="advantage-stats", initializer=_lower_priority
        )
        self._pending: set[asyncio.Task[None]] = set()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def schedule(self, session: StateSession, result: AdvantageResult) -> None:
        """Write what ``session``'s request leaves (``result`` its computation), after now."""
        if len(self._pending) >= self.max_pending:
            self._on_error("record_dropped")
            return
        task = asyncio.get_running_loop().create_task(self._write(session, result))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _write(self, session: StateSession, result: AdvantageResult) -> None:
        loop = asyncio.get_running_loop()
        try:
            update = await loop.run_in_executor(self._executor, session.update, result)
            await session.record(update)
        except asyncio.CancelledError:
            raise
        except Exception:  # statistics must never take the service down
            log.exception("statistics write for request %s failed", session.req.request_id)
            self._on_error("record")

    async def settle(self, timeout: float | None = None) -> set[asyncio.Task[None]]:
        """Wait (up to ``timeout`` s) for the writes scheduled so far; the ones still running."""
        pending = list(self._pending)
        if not pending:
            return set()
        _, late = await asyncio.wait(pending, timeout=timeout)
        return late

    async def flush(self, timeout: float | None = None) -> None:
        """Wait (up to ``timeout`` s) for the scheduled writes; cancel the ones still running."""
        if self._pending:
            log.info("flushing %d statistics writes", len(self._pending))
        for task in await self.settle(timeout):
            task.cancel()

    def close(self) -> None:
        self._executor.shutdown(wait=True)


__all__ = ["StatsWriter"]
