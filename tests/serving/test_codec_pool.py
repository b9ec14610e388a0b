"""The codec threads take an answer's encoding before any waiting decoding, in order of
submission within each kind, like an executor otherwise (cancelled work skipped, errors to the
caller, shutdown after the work submitted)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError

import pytest
from advantage_service.serving.codec_pool import FINISH, START, CodecPool


def held_pool() -> tuple[CodecPool, threading.Event]:
    """A pool of one thread, busy until the event is set (so that the work submitted next
    waits and its order is the pool's choice)."""
    pool = CodecPool(1, "test-codec")
    release, started = threading.Event(), threading.Event()

    def hold() -> None:
        started.set()
        assert release.wait(30)

    pool.submit(START, hold)
    assert started.wait(30)
    return pool, release


def test_finishing_work_runs_before_waiting_starting_work_and_each_in_order() -> None:
    pool, release = held_pool()
    ran: list[str] = []
    futures = [
        pool.submit(priority, ran.append, name)
        for priority, name in [
            (START, "decode 1"),
            (START, "decode 2"),
            (FINISH, "encode 1"),
            (START, "decode 3"),
            (FINISH, "encode 2"),
        ]
    ]
    assert pool.pending == 5
    release.set()
    for future in futures:
        future.result(30)
    assert ran == ["encode 1", "encode 2", "decode 1", "decode 2", "decode 3"]
    pool.shutdown()


def test_results_errors_and_cancelled_work_reach_the_caller_as_from_an_executor() -> None:
    pool, release = held_pool()
    ran: list[int] = []
    answer = pool.submit(FINISH, lambda x: x * 2, 21)
    failing = pool.submit(START, int, "not a number")
    skipped = pool.submit(START, ran.append, 1)
    assert skipped.cancel()
    release.set()
    assert answer.result(30) == 42
    with pytest.raises(ValueError, match="not a number"):
        failing.result(30)
    with pytest.raises(CancelledError):
        skipped.result(30)
    pool.submit(START, ran.append, 2).result(30)
    assert ran == [2]  # the cancelled work never ran
    pool.shutdown()


def test_shutdown_runs_what_was_submitted_then_refuses_more() -> None:
    pool, release = held_pool()
    ran: list[int] = []
    futures = [pool.submit(START, ran.append, i) for i in range(3)]
    threading.Timer(0.2, release.set).start()
    started = time.monotonic()
    pool.shutdown(wait=True)
    assert time.monotonic() - started >= 0.15  # it waited for the held work
    assert ran == [0, 1, 2] and all(f.done() for f in futures)
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(START, ran.append, 3)
