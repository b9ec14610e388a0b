"""The writes of the terms that keep state and of the vocabulary statistics, after the answer.

What an answer promises (its summary's ``recorded``): ``true`` when the writer accepted the
request's statistics. From then on they are written unless the store stays unreachable for
``retry_seconds`` or the process dies first, and both are counted (``advantage_stats_requests_
total{outcome="lost"}``, with the store's own errors) and logged with the request ids. ``false``
only when the writer did not accept them: the store is known to be unreachable
(``StatsStore.writable``) or the service is shutting down.

A write that does not reach the store (it is unreachable, in its backoff, or on a cluster one of
its masters did not answer) is not given up: the requests it could not count are written again
in the next rounds, after a pause that doubles (``RETRY_FIRST`` to ``RETRY_MAX`` seconds), for up
to ``retry_seconds`` after their first try; only then are they counted lost. A request id makes
this safe (a try that reached the store after all has claimed it: the next finds the claim and
counts it once), so only requests with an id are written again; one without an id is counted
lost at its first failure. (A replica that has just started on a busy machine can miss its 0.5 s
Redis timeout and take the store for unreachable for a moment; such a moment costs no request
with an id its statistics.) Requests waiting to be written again do not hold computations back
(``behind`` counts the others: an outage must not stop requests that do not need the store),
and at most ``max_backlog`` of them wait; past that the oldest are counted lost.

Writes never wait for a place: the queue does. While the writer is behind (``max_backlog`` or
more accepted requests not yet written) the scheduler starts no computation (``behind``), so
requests wait in the queue and, past its limits, are answered 503 with a retry hint; the
backlog is bounded by ``max_backlog`` plus what the computations already running hold, plus
at most ``max_backlog`` waiting to be written again.

The writer works in rounds, on one worker thread of its own at lower priority (building the
writes costs CPU that must not slow the next request's computation): a round takes every
accepted request waiting, builds each one's writes, folds them per namespace (``fold_writes``:
each record key written once, its visits folded in the order the requests were answered, the
statistics summed) and hands each namespace's update to the store in one call
(``StatsStore.record_requests``) that claims every request id of the round with it, so a resent
request id is counted once: where the store applied nothing for requests counted before (the
whole update on one Redis, the parts they touch on a cluster), it names the records to fold
again without them (``stats.base.FoldAgain``); the writer folds them here (the store keeps
bytes, it never folds) and sends them, until the store is done.
The busier the service, the more requests a round holds and the less each one costs.

One bad request never costs the others of its round their statistics. Each request's writes are
built and checked on their own before they are folded (a key or request id that is not valid
Unicode text, which no store can take; writes that cannot be built); a fold that fails is
redone without the requests whose records do not fold alone; and a write the store refuses as a
whole, applying nothing of it (``stats.base.Refused``: a record it cannot take), is split by
the store, its halves folded again here, until the requests it refuses are alone. Such a
request is *poisoned*: counted ``lost`` (it was answered ``recorded: true``) and in
``advantage_stats_poisoned_total``, and logged with its request id (escaped: the log line
cannot fail on what the id holds); every other request of the round is counted once.

A request whose id was counted before for another body (its digest differs: the service checks
before answering, so this is the race of two bodies sent at once under one id, or a claim made
by another replica since) is not counted: ``conflict``, logged with its id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..estimators import AdvantageResult
from ..estimators.state import WriteOptions
from ..stats import StatsStore, StatsUpdate
from ..stats.base import (
    CONFLICT,
    COUNTED,
    DUPLICATE,
    LOST,
    POISONED,
    FoldAgain,
    RecordKey,
    RequestWrite,
    unstorable,
)
from ..stats.redis_common import Backoff
from .term_state import PendingWrites, StateSession, fold_records, fold_writes

log = logging.getLogger("advantage_service.stats_writer")

# Niceness of the statistics worker (and the torch threads it starts, which inherit it).
STATS_NICENESS = 10

# Outcomes of a request's statistics (advantage_stats_requests_total{outcome}): the store's
# COUNTED, DUPLICATE and LOST (accepted, answered recorded: true, then the store or a part of
# it failed, or the service stopped first), and
REFUSED = "refused"  # not accepted (recorded: false): the store is unreachable, or shutting down
# (POISONED requests are counted LOST there, and in on_poisoned; CONFLICT is an outcome too.)
Records = dict[RecordKey, bytes]
# How much of a request id a log line repeats, and how many ids a line about many requests names.
LOGGED_ID_CHARS = 64
LOGGED_IDS = 5
# Writes that did not reach the store are tried again, after RETRY_FIRST seconds, then twice as
# long each time up to RETRY_MAX (the stores' own Backoff rule), for RETRY_SECONDS (the default of
# ADV_STATS_RETRY_SECONDS) after their first try.
RETRY_SECONDS = 30.0
RETRY_FIRST = 0.25
RETRY_MAX = 4.0


def logged_id(request_id: str | None) -> str:
    """A request id for a log line: ASCII (``ascii``: a lone surrogate or any other character
    is escaped, so the line can always be written), at most LOGGED_ID_CHARS characters."""
    if request_id is None:
        return "(none)"
    if len(request_id) > LOGGED_ID_CHARS:
        return f"{request_id[:LOGGED_ID_CHARS]!a}... ({len(request_id)} characters)"
    return ascii(request_id)


def logged_ids(request_ids: list[str | None]) -> str:
    """The first LOGGED_IDS of ``request_ids`` for a log line, and how many more there are."""
    shown = ", ".join(logged_id(r) for r in request_ids[:LOGGED_IDS])
    more = len(request_ids) - LOGGED_IDS
    return f"{shown} and {more} more" if more > 0 else shown


def _lower_priority() -> None:
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), STATS_NICENESS)


Entry = tuple[StateSession, AdvantageResult]


@dataclass
class Retry:
    """A request whose write did not reach ``store``: written again until ``deadline`` (the
    event loop's clock)."""

    store: StatsStore
    write: PendingWrites
    deadline: float


# What a round hands to the store per namespace: the store, the requests' writes (those written
# again first: they were answered first), the folded update, and each write's deadline (None:
# its first try).
Commit = tuple[StatsStore, list[PendingWrites], StatsUpdate, list[float | None]]


class StatsWriter:
    """Accepts computed requests' writes and writes them in rounds. Use it from the event loop.

    ``on_outcome(outcome, requests)``: requests whose statistics ended so; ``on_error(op)``: a
    failed write (``record``); ``on_backlog(requests)``: the backlog changed; ``on_round
    (requests)``: a round started with that many requests; ``on_room()``: the backlog fell
    below ``max_backlog`` (the scheduler may start computations again); ``on_poisoned
    (requests)``: requests whose writes the store could not take on their own (also counted
    ``lost`` by ``on_outcome``).
    """

    def __init__(
        self,
        options: WriteOptions,
        max_backlog: int,
        *,
        retry_seconds: float = RETRY_SECONDS,
        on_outcome: Callable[[str, int], None] | None = None,
        on_error: Callable[[str], None] | None = None,
        on_backlog: Callable[[int], None] | None = None,
        on_round: Callable[[int], None] | None = None,
        on_room: Callable[[], None] | None = None,
        on_poisoned: Callable[[int], None] | None = None,
    ) -> None:
        self.options = options
        self.on_poisoned = on_poisoned
        self.max_backlog = max(1, max_backlog)
        self.retry_seconds = max(0.0, retry_seconds)
        self._on_outcome = on_outcome
        self._on_error = on_error
        self._on_backlog = on_backlog
        self._on_round = on_round
        self.on_room = on_room
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="advantage-stats", initializer=_lower_priority
        )
        self._waiting: list[Entry] = []
        self._backlog = 0  # accepted, not yet written (waiting or in the round being written)
        self._retry: list[Retry] = []  # not written yet: to write again (not in _backlog)
        self._retrying = 0  # of those, in the round being written (and not kept again yet)
        self._pause = Backoff(RETRY_FIRST, RETRY_MAX)  # before they are written again
        self._wake: asyncio.Event | None = None  # (set when a request is accepted)
        self._task: asyncio.Task[None] | None = None
        self._accounted = 0  # requests of the round being written whose outcome is counted
        self.closing = False

    @property
    def backlog(self) -> int:
        """Requests accepted whose writes have not finished (those to write again included)."""
        return self._backlog + len(self._retry) + self._retrying

    @property
    def behind(self) -> bool:
        """True while ``max_backlog`` or more accepted requests wait for their first write: start
        no computation. (Those to write again after a failure do not count: the store is what
        they wait for, and requests that do not need it must go on.)"""
        return self._backlog >= self.max_backlog

    def accept(self, session: StateSession, result: AdvantageResult) -> bool:
        """Take the writes of ``session``'s request (``result`` its computation), to be
        written after now; the answer's ``recorded``. False (counted) when the store is known
        to be unreachable or the service is shutting down."""
        if self.closing or not session.store.writable:
            self._count(REFUSED, 1)
            return False
        self._waiting.append((session, result))
        self._set_backlog(self._backlog + 1)
        if self._wake is not None:
            self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        return True

    def _set_backlog(self, count: int) -> None:
        self._backlog = count
        if self._on_backlog is not None:
            self._on_backlog(self.backlog)

    def _count(self, outcome: str, requests: int) -> None:
        if requests and self._on_outcome is not None:
            self._on_outcome(outcome, requests)

    def _outcome(self, outcome: str, requests: int) -> None:
        """``requests`` of the round being written ended so."""
        self._accounted += requests
        self._count(outcome, requests)

    def _error(self, op: str) -> None:
        if self._on_error is not None:
            self._on_error(op)

    def _poisoned(self, request_id: str | None, why: str, *, logged: bool = True) -> None:
        """A request of the round being written whose writes could not be taken on their own:
        lost, counted and logged; the round goes on without it."""
        if logged:
            log.warning("statistics of request %s not written: %s", logged_id(request_id), why)
        self._outcome(LOST, 1)
        if self.on_poisoned is not None:
            self.on_poisoned(1)

    async def _run(self) -> None:
        """Write rounds while requests wait (to be written for the first time, or again)."""
        self._wake = wake = asyncio.Event()
        while self._waiting or self._retry:
            entries, self._waiting = self._waiting, []
            retries: list[Retry] = []
            if self._retry and not self._pause.waiting:
                retries, self._retry = self._retry, []
            if not entries and not retries:
                # (until the next try, or until a request is accepted: its first write is not
                # held back by those waiting to be written again)
                wake.clear()
                try:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(wake.wait(), self._pause.left)
                except asyncio.CancelledError:
                    self._lost_at_shutdown(0)
                    raise
                continue
            self._accounted = 0
            self._retrying = len(retries)
            if self._on_round is not None:
                self._on_round(len(entries) + len(retries))
            try:
                await self._write_round(entries, retries)
            except asyncio.CancelledError:  # (shutting down, past its timeout)
                self._lost_at_shutdown(len(entries) + len(retries) - self._accounted)
                raise
            except Exception:  # statistics must never take the service down
                total = len(entries) + len(retries)
                log.exception("a statistics write round of %d requests failed", total)
                self._error("record")
                self._count(LOST, total - self._accounted)
            self._retrying = 0
            self._set_backlog(self._backlog - len(entries))
            if not self.behind and self.on_room is not None:
                self.on_room()

    def _lost_at_shutdown(self, unaccounted: int) -> None:
        """The writer was cancelled (shutting down, past its timeout): what it still held is
        lost, counted and logged."""
        lost = unaccounted + len(self._waiting) + len(self._retry)
        self._count(LOST, lost)
        if lost:
            log.warning("shutdown: the statistics of %d requests were not written", lost)
        self._waiting, self._retry, self._retrying = [], [], 0
        self._set_backlog(0)
        if self.on_room is not None:
            self.on_room()

    async def _write_round(self, entries: list[Entry], retries: list[Retry]) -> None:
        loop = asyncio.get_running_loop()
        built = await loop.run_in_executor(self._executor, self._build, entries, retries)
        for store, writes, update, deadlines in built:
            await self._commit(store, writes, update, deadlines)
        if not self._retry:
            self._pause.answered()
        elif retries or not self._pause.waiting:  # (written again and failed again, or the first)
            self._pause.failed()

    def _build(self, entries: list[Entry], retries: list[Retry]) -> list[Commit]:
        """Each request's writes, checked on their own, then folded per namespace, those to
        write again first (on the worker thread)."""
        by_namespace: dict[tuple[StatsStore, str], list[PendingWrites]] = {}
        deadlines: dict[int, float] = {}
        for retry in retries:
            by_namespace.setdefault((retry.store, retry.write.namespace), []).append(retry.write)
            deadlines[id(retry.write)] = retry.deadline
        for session, result in entries:
            try:
                write = session.writes(result)
            except Exception:  # statistics must never take the service down
                log.exception(
                    "statistics of request %s not written: its writes could not be built",
                    logged_id(session.req.request_id),
                )
                self._error("record")
                self._poisoned(None, "", logged=False)
                continue
            why = unstorable(write.namespace, write.request_id, write.records)
            if why is not None:
                self._poisoned(write.request_id, why)
                continue
            key = (session.store, write.namespace)
            by_namespace.setdefault(key, []).append(write)
        out = []
        for (store, _), writes in by_namespace.items():
            unique = self._unique(writes)
            try:
                update = fold_writes(unique, self.options)
            except Exception:
                log.warning("folding the statistics of %d requests failed", len(unique))
                unique = self._foldable(unique)
                try:
                    update = fold_writes(unique, self.options)
                except Exception:
                    log.exception("folding the statistics of %d requests failed", len(unique))
                    self._error("record")
                    self._outcome(LOST, len(unique))
                    continue
            if unique:
                out.append((store, unique, update, [deadlines.get(id(w)) for w in unique]))
        return out

    def _foldable(self, writes: list[PendingWrites]) -> list[PendingWrites]:
        """``writes`` without those whose records do not fold alone (poisoned)."""
        out = []
        for write in writes:
            try:
                fold_writes([write], self.options)
            except Exception as exc:
                self._error("record")
                self._poisoned(write.request_id, f"its records could not be encoded: {exc!r}")
                continue
            out.append(write)
        return out

    def _unique(self, writes: list[PendingWrites]) -> list[PendingWrites]:
        """``writes`` without the repeats of a request id within the round (counted once; a
        repeat with another digest is a conflict)."""
        seen: dict[str, str | None] = {}
        out = []
        for write in writes:
            if write.request_id is not None:
                if write.request_id in seen:
                    first = seen[write.request_id]
                    if first and write.digest and first != write.digest:
                        self._conflict(write.request_id)
                    else:
                        self._outcome(DUPLICATE, 1)
                    continue
                seen[write.request_id] = write.digest
            out.append(write)
        return out

    def _conflict(self, request_id: str | None) -> None:
        log.warning(
            "statistics of request %s not counted: its request id was counted for another "
            "request (a different body under the same request_id)",
            logged_id(request_id),
        )
        self._outcome(CONFLICT, 1)

    async def _commit(
        self,
        store: StatsStore,
        writes: list[PendingWrites],
        update: StatsUpdate,
        deadlines: list[float | None],
    ) -> None:
        """Hand one namespace's folded ``update`` to the store, with each request's share of it;
        fold again the records it asks for, until it is done. Requests it could not count for
        want of the store are written again (:meth:`_again`) or, past their deadline, lost."""
        loop = asyncio.get_running_loop()
        namespace = writes[0].namespace
        requests = [
            RequestWrite(w.request_id, tuple(w.records), w.tokens, w.digest) for w in writes
        ]
        reached = True  # (False: a fault of the store, not an outage: not written again)
        try:
            recording = await store.record_requests(namespace, requests, update)
            while recording.again:
                again = list(recording.again)
                records = await loop.run_in_executor(
                    self._executor, self._fold_again, writes, again
                )
                await recording.send(records)
            outcomes = recording.outcomes
        except Exception:  # (a store fault, not an outage: counted, the service goes on)
            log.exception("statistics write of %d requests failed", len(writes))
            self._error("record")
            outcomes = [LOST] * len(writes)
            reached = False
        lost: list[str | None] = []
        for write, outcome, deadline in zip(writes, outcomes, deadlines, strict=True):
            if outcome == POISONED:
                self._poisoned(write.request_id, "the store refused its write")
            elif outcome == CONFLICT:
                self._conflict(write.request_id)
            elif outcome == LOST and not (reached and self._again(store, write, deadline)):
                lost.append(write.request_id)
        for outcome in (COUNTED, DUPLICATE):
            self._outcome(outcome, sum(1 for o in outcomes if o == outcome))
        self._outcome(LOST, len(lost))
        if lost and reached:
            log.warning(
                "statistics of %d requests not written (the stats store was not reached): %s",
                len(lost),
                logged_ids(lost),
            )
        elif lost:
            log.warning("statistics of requests %s not written", logged_ids(lost))

    def _again(self, store: StatsStore, write: PendingWrites, deadline: float | None) -> bool:
        """Keep ``write``, which did not reach the store, to write again; False (lost) when it
        cannot be: no request id (a try that reached the store after all would count it twice),
        or past its deadline. Past ``max_backlog`` kept, the oldest kept is lost instead."""
        now = asyncio.get_running_loop().time()
        again = deadline is not None  # (a write made again in this round)
        if deadline is None:
            deadline = now + self.retry_seconds
        if write.request_id is None or deadline <= now:
            return False
        if again:  # (kept again: counted in _retry from now on)
            self._retrying = max(0, self._retrying - 1)
        self._accounted += 1  # (its outcome comes in a later round)
        self._retry.append(Retry(store, write, deadline))
        if len(self._retry) > self.max_backlog:
            oldest = self._retry.pop(0)
            self._count(LOST, 1)  # (accounted when it was kept)
            log.warning(
                "statistics of request %s not written: more than %d requests wait for the "
                "stats store",
                logged_id(oldest.write.request_id),
                self.max_backlog,
            )
        return True

    def _fold_again(self, writes: list[PendingWrites], again: list[FoldAgain]) -> Records:
        """The records a write asks for again (on the worker thread)."""
        records: Records = {}
        for ask in again:
            chosen = [writes[i] for i in ask.keep]
            records.update(fold_records(chosen, self.options, ask.keys))
        return records

    async def settle(self, timeout: float | None = None) -> int:
        """Wait (up to ``timeout`` s) until every accepted request is written; the number of
        requests still not written then."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while self._task is not None and not self._task.done():
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                break
            await asyncio.wait({self._task}, timeout=left)
        return self.backlog

    async def flush(self, timeout: float | None = None) -> None:
        """Shutting down: accept nothing more, wait (up to ``timeout`` s) for what was accepted,
        then stop; what is still not written is counted lost."""
        self.closing = True
        if self.backlog:
            log.info("flushing the statistics of %d requests", self.backlog)
        left = await self.settle(timeout)
        if left and self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def close(self) -> None:
        self._executor.shutdown(wait=True)


__all__ = ["CONFLICT", "COUNTED", "DUPLICATE", "LOST", "REFUSED", "StatsWriter", "logged_id"]
