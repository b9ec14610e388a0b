"""The codec threads: decoding requests' bodies and encoding their answers, finishing work first.

An encode belongs to a request already computed: its statistics are accepted and its answer is
all that is left. A decode belongs to a request that has not started. With one first-in
first-out pool, an answer waited behind the bodies of every request that arrived while it
computed: under load its latency grew with the queue, its result's memory was held as long, and
at a shutdown deadline the computed requests were cut off with their connections while the
threads parsed bodies of requests that would be refused anyway. Here an encode runs before any
waiting decode (in order of submission within each kind).
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

FINISH = 0  # work of a request that has computed (encoding its answer)
START = 1  # work of a request that has not (decoding its body, deriving its inputs)
_STOP = 2  # after everything submitted before the shutdown

_Item = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None


class CodecPool:
    """``workers`` threads taking the submitted work by priority (``FINISH`` first), then in
    order of submission. Like a ``ThreadPoolExecutor``: ``submit`` returns a
    ``concurrent.futures.Future``; a future cancelled before its work started is skipped."""

    def __init__(self, workers: int, name: str) -> None:
        self._queue: queue.PriorityQueue[tuple[int, int, _Item]] = queue.PriorityQueue()
        self._order = itertools.count()
        self._lock = threading.Lock()
        self._stopped = False
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True)
            for i in range(max(1, workers))
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, priority: int, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run ``fn(*args)`` on a codec thread after the waiting work of a lower ``priority``
        (``FINISH`` or ``START``) and of the same one submitted before."""
        future: Future[T] = Future()
        with self._lock:
            if self._stopped:
                raise RuntimeError("the codec pool is shut down")
            self._queue.put((priority, next(self._order), (future, fn, args)))
        return future

    @property
    def pending(self) -> int:
        """Work submitted and not yet taken by a thread."""
        return self._queue.qsize()

    def shutdown(self, wait: bool = True) -> None:
        """Run what was submitted, then stop the threads (waiting for them with ``wait``)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            for _ in self._threads:
                self._queue.put((_STOP, next(self._order), None))
        if wait:
            for thread in self._threads:
                thread.join()

    def _work(self) -> None:
        while True:
            item = self._queue.get()[2]
            if item is None:
                return
            future, fn, args = item
            # (Dropped before the next wait: a decoded body must not outlive its work here.)
            del item
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args)
                except BaseException as exc:  # (the caller's to see, as from an executor)
                    future.set_exception(exc)
                else:
                    future.set_result(result)
                    del result
            del future, fn, args


__all__ = ["FINISH", "START", "CodecPool"]
