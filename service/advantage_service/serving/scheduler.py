"""The queue in front of the compute workers: admission, fairness and dynamic batching.

It works the way Triton's dynamic batcher and Knative's queue proxy do:

- **Admission** (:meth:`Scheduler.admit`): a request takes a place (a :class:`Ticket`) before
  its body is read, so memory stays bounded: among the bodies being received
  (``ADV_MAX_RECEIVING``) while it arrives, then among the requests admitted (``ADV_MAX_QUEUE``:
  decoded, waiting or computing), so that a slow sender never holds a place a ready request
  needs; the bytes of their bodies stay within ``ADV_MAX_QUEUE_BYTES``. Each tenant holds at
  most its share of each (``tenancy``). Past a limit the answer is :class:`~.errors.Overloaded`
  (503 / UNAVAILABLE) with a retry hint sized from the rate the queue drains at.
- **Waiting** (:meth:`Scheduler.run`): a decoded, validated request waits in its namespace's
  first-come-first-served queue, at most ``ADV_QUEUE_TIMEOUT_SECONDS`` after its admission (then
  it is refused as overloaded); a request whose caller went away is dropped without computing.
- **Fairness**: a free worker takes the next request round-robin across namespaces, so one
  job's many ranks cannot starve another team's trainer on the same replica.
- **Pushback from the statistics writes**: while the writer is behind (``paused``), no
  computation starts: requests wait, then the limits above answer 503, rather than the service
  answering requests whose statistics it cannot write.
- **Dynamic batching**: with the request it takes, a worker takes every other waiting request
  that may share its computation (``merging.merge_key``; namespaces may differ), up to
  ``ADV_MAX_BATCH_TOKENS`` tokens (0: never merge), and computes them as one batch.
  ``ADV_MAX_BATCH_DELAY_MS`` (default 0, as Triton's) lets a mergeable request wait that long for
  company when it would otherwise run alone.

``ADV_MAX_INFLIGHT`` workers compute at once; a worker that outlives its requests (deadline,
cancellation) stays busy until it really finishes, so the workers are never overcommitted.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from ..errors import Overloaded
from ..estimators import AdvantageResult, TermContext
from ..wire.request import ComputeRequest
from .tenancy import Budget, Limits, Refusal, Tenant

log = logging.getLogger("advantage_service.scheduler")

# The tenant of a request no transport names one for (in-process calls, tests).
LOCAL = Tenant("local", "local", whole=True)

# Weight of the newest completion in the moving average of the time between completions.
DRAIN_SMOOTHING = 0.1
# Bounds of the retry hint.
RETRY_AFTER_MIN_MS = 10
RETRY_AFTER_MAX_MS = 60_000
# At most one log line per this many seconds about refused requests (with their count).
REFUSAL_LOG_SECONDS = 10.0


@dataclass
class Computation:
    """What computing a request gave: its result (or the error that failed it alone), the
    seconds the computation took, and how many requests shared it."""

    result: AdvantageResult | None
    error: BaseException | None
    seconds: float
    shared: int


# (requests, their contexts) -> one Computation per request, in order. Runs on a worker thread.
ComputeFn = Callable[[Sequence[ComputeRequest], Sequence[TermContext | None]], list[Computation]]


class Ticket:
    """A request's place, from before its body is read until it is answered: first among the
    bodies being received (``receiving``), then, once its body is whole (:meth:`received`),
    among the requests admitted. Release it once (a context manager does)."""

    def __init__(
        self, scheduler: Scheduler, tenant: Tenant, nbytes: int, *, receiving: bool
    ) -> None:
        self._scheduler = scheduler
        self.tenant = tenant
        self.nbytes = nbytes
        self.receiving = receiving
        self.admitted = time.monotonic()
        self.released = False
        self._freed = False
        self._busy: set[asyncio.Future[Any]] = set()

    def keep(self, future: asyncio.Future[Any]) -> None:
        """Keep the place taken until ``future`` (a worker's, decoding or encoding this request)
        is done: a worker cannot be interrupted, so a request answered before its worker ends
        (deadline, cancellation) still holds what the worker holds."""
        self._busy.add(future)
        future.add_done_callback(self._worker_done)

    def _worker_done(self, future: asyncio.Future[Any]) -> None:
        self._busy.discard(future)
        if not future.cancelled():
            future.exception()  # retrieved: an abandoned worker's error is not "never retrieved"
        if self.released and not self._busy:
            self._free()

    def _free(self) -> None:
        if not self._freed:
            self._freed = True
            self._scheduler._release(self)

    def hold(self, nbytes: int) -> None:
        """Hold ``nbytes`` in the byte budget (the body so far: it only grows); raises
        :class:`Overloaded` when that passes the replica's or the tenant's budget."""
        if nbytes > self.nbytes:
            self._scheduler._grow(self, nbytes)

    def received(self) -> None:
        """The body is whole: from now on the request counts among the requests admitted
        (``ADV_MAX_QUEUE``, the tenant's share) instead of the bodies being received; raises
        :class:`Overloaded` when there is no room (the ticket is then still to be released)."""
        if self.receiving:
            self._scheduler._received(self)

    def release(self) -> None:
        if not self.released:
            self.released = True
            if not self._busy:
                self._free()

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass(eq=False)
class _Job:
    req: ComputeRequest
    context: TermContext | None
    key: Hashable | None
    ticket: Ticket
    future: asyncio.Future[Computation]
    enqueued: float = field(default_factory=time.monotonic)
    state: str = "waiting"  # waiting | running | dropped

    @property
    def tokens(self) -> int:
        return self.req.batch.num_tokens


class Scheduler:
    """Admission, the per-namespace queues and the workers. Use it from the event loop."""

    def __init__(
        self,
        *,
        workers: int,
        executor: Executor,
        compute: ComputeFn,
        merge_key: Callable[[ComputeRequest], Hashable | None],
        max_queue: int,
        max_queue_bytes: int,
        queue_timeout: float,
        max_batch_tokens: int,
        max_batch_delay: float,
        on_depth: Callable[[int], None] | None = None,
        on_held: Callable[[int], None] | None = None,
        on_wait: Callable[[float], None] | None = None,
        on_batch: Callable[[int], None] | None = None,
        paused: Callable[[], str | None] | None = None,
        budget: Budget | None = None,
    ) -> None:
        self.workers = workers
        self.max_queue = max_queue
        self.max_queue_bytes = max_queue_bytes
        self.queue_timeout = queue_timeout
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_delay = max_batch_delay
        self._executor = executor
        self._compute = compute
        self._merge_key = merge_key
        self._on_depth = on_depth
        self._on_held = on_held
        self._on_wait = on_wait
        self._on_batch = on_batch
        # Why no computation may start now (the statistics writes are behind), or None: requests
        # wait in the queue, up to its limits; call wake() when it turns None.
        self._paused = paused
        # What every tenant holds; the streams' share of it is the gRPC transport's.
        # (Without one: a single tenant may take everything.)
        self.budget = (
            budget
            if budget is not None
            else Budget(
                Limits(bodies=max_queue, requests=max_queue, bytes=max_queue_bytes, streams=1),
                share=1.0,
            )
        )
        self._free = workers
        self._queues: dict[str, deque[_Job]] = {}
        self._turns: deque[str] = deque()  # namespaces with waiting requests, whose turn is next
        self._waiting = 0
        self._interval = 0.05  # seconds between completions (moving average; a first guess)
        self._last_done: float | None = None
        self._delay_handle: asyncio.TimerHandle | None = None
        self._refused = 0
        self._refusal_logged = 0.0
        self._refusing: str | None = None  # set by refuse_waiting: no request waits any more

    # ---- admission -----------------------------------------------------------------------------

    @property
    def held(self) -> int:
        """Requests admitted and not yet answered (their bodies whole)."""
        return self.budget.used.requests

    @property
    def receiving(self) -> int:
        """Bodies being received."""
        return self.budget.used.bodies

    @property
    def held_bytes(self) -> int:
        return self.budget.used.bytes

    @property
    def depth(self) -> int:
        """Requests waiting for a worker."""
        return self._waiting

    def admit(self, nbytes: int = 0, tenant: Tenant = LOCAL, *, receiving: bool = False) -> Ticket:
        """A place for a request of (at least) ``nbytes`` bytes of ``tenant``'s, or
        :class:`Overloaded`. ``receiving``: its body is still to be read, so it takes a place
        among the bodies being received, not among the requests admitted (it moves there by
        :meth:`Ticket.received`); it is refused now all the same when those are full, so that
        a full replica answers without reading what it refuses."""
        budget = self.budget
        try:
            if receiving:
                budget.check(tenant, "requests")
                budget.take(tenant, "bodies")
            else:
                budget.take(tenant, "requests")
            try:
                budget.take(tenant, "bytes", nbytes)
            except Refusal:
                budget.give(tenant, "bodies" if receiving else "requests")
                raise
        except Refusal as refusal:
            raise self.overloaded(str(refusal)) from None
        self._changed()
        return Ticket(self, tenant, nbytes, receiving=receiving)

    def _received(self, ticket: Ticket) -> None:
        try:
            self.budget.take(ticket.tenant, "requests")
        except Refusal as refusal:
            raise self.overloaded(str(refusal)) from None
        self.budget.give(ticket.tenant, "bodies")
        ticket.receiving = False
        self._changed()

    def _grow(self, ticket: Ticket, nbytes: int) -> None:
        try:
            self.budget.take(ticket.tenant, "bytes", nbytes - ticket.nbytes, own=ticket.nbytes)
        except Refusal as refusal:
            raise self.overloaded(str(refusal)) from None
        ticket.nbytes = nbytes

    def _release(self, ticket: Ticket) -> None:
        self.budget.give(ticket.tenant, "bodies" if ticket.receiving else "requests")
        self.budget.give(ticket.tenant, "bytes", ticket.nbytes)
        self._changed()

    def _changed(self) -> None:
        if self._on_held is not None:  # (advantage_inflight_requests: received or receiving)
            self._on_held(self.held + self.receiving)

    def retry_after_ms(self) -> int:
        """How long a refused client should wait: the time the queue ahead of it takes to
        drain at the rate requests have been completing."""
        ahead = max(1, self.held - self.workers + 1)
        wait = 1000.0 * ahead * self._interval
        return int(min(RETRY_AFTER_MAX_MS, max(RETRY_AFTER_MIN_MS, math.ceil(wait))))

    def overloaded(self, why: str) -> Overloaded:
        """The refusal of a request, counted for the rate-limited refusal log."""
        retry = self.retry_after_ms()
        self._refused += 1
        now = time.monotonic()
        if now - self._refusal_logged >= REFUSAL_LOG_SECONDS:
            log.warning(
                "overloaded: refused %d requests since the last such line (%s; retry after %d ms)",
                self._refused,
                why,
                retry,
            )
            self._refused, self._refusal_logged = 0, now
        return Overloaded(f"{why}: retry after {retry} ms", retry_after_ms=retry)

    # ---- waiting and computing ---------------------------------------------------------------

    async def run(
        self, req: ComputeRequest, context: TermContext | None, ticket: Ticket
    ) -> Computation:
        """Queue ``req`` and wait for its computation. Raises :class:`Overloaded` when it is
        still waiting ``queue_timeout`` seconds after its admission; a cancelled caller's
        request is dropped if it has not started."""
        if self._refusing is not None and self._free == 0:
            raise self.overloaded(self._refusing)
        loop = asyncio.get_running_loop()
        key = self._merge_key(req) if self.max_batch_tokens > 0 and context is None else None
        job = _Job(req, context, key, ticket, loop.create_future())
        self._queues.setdefault(req.namespace, deque()).append(job)
        if req.namespace not in self._turns:
            self._turns.append(req.namespace)
        self._set_waiting(self._waiting + 1)
        self._dispatch()
        if self._refusing is not None and job.state == "waiting":
            # (past the refusal point nothing waits: a free worker that held it back, for a
            # statistics writer behind, would leave it to be cut off at the deadline)
            self._drop(job)
            raise self.overloaded(self._refusing)
        remaining = ticket.admitted + self.queue_timeout - time.monotonic()
        try:
            return await asyncio.wait_for(asyncio.shield(job.future), max(0.0, remaining))
        except TimeoutError:
            if job.state != "waiting":  # it started in the meantime: its answer is coming
                return await asyncio.shield(job.future)
            self._drop(job)
            waited = time.monotonic() - ticket.admitted
            paused = self._paused() if self._paused is not None else None
            raise self.overloaded(
                f"the request waited {waited:.1f} s in the queue, its limit "
                "(ADV_QUEUE_TIMEOUT_SECONDS)" + (f", while {paused}" if paused else "")
            ) from None
        except asyncio.CancelledError:
            self._drop(job)
            raise

    @property
    def refusing(self) -> str | None:
        """Why every request that would wait is refused (:meth:`refuse_waiting`), or None."""
        return self._refusing

    def refuse_waiting(self, why: str) -> int:
        """Answer every request still waiting with :class:`Overloaded`, and from now on every
        request that would have to wait (a draining replica whose shutdown deadline is near:
        the client retries elsewhere instead of losing its request with the connection). The
        number refused."""
        self._refusing = why
        refused = 0
        for queue in self._queues.values():
            for job in queue:
                if job.state == "waiting" and not job.future.done():
                    job.state = "dropped"
                    job.future.set_exception(self.overloaded(why))
                    refused += 1
        self._queues.clear()
        self._turns.clear()
        self._set_waiting(0)
        return refused

    def _drop(self, job: _Job) -> None:
        if job.state == "waiting":
            job.state = "dropped"
            self._set_waiting(self._waiting - 1)

    def _set_waiting(self, count: int) -> None:
        self._waiting = count
        if self._on_depth is not None:
            self._on_depth(count)

    def _next(self) -> _Job | None:
        """The next waiting request, round-robin over namespaces (dropped ones skipped)."""
        while self._turns:
            namespace = self._turns[0]
            queue = self._queues[namespace]
            while queue and queue[0].state != "waiting":
                queue.popleft()
            if not queue:
                self._turns.popleft()
                del self._queues[namespace]
                continue
            job = queue.popleft()
            self._turns.rotate(-1)  # the next namespace's turn
            if not queue:
                self._turns.remove(namespace)
                del self._queues[namespace]
            return job
        return None

    def _companions(self, head: _Job) -> list[_Job]:
        """Waiting requests that may share ``head``'s computation, taken in turn order (each
        namespace's oldest first) while the batch stays within ``max_batch_tokens``."""
        batch, tokens = [head], head.tokens
        if head.key is None:
            return batch
        queues = [self._queues[ns] for ns in self._turns]
        positions = [0] * len(queues)
        progress = True
        while progress and tokens < self.max_batch_tokens:
            progress = False
            for i, queue in enumerate(queues):
                while positions[i] < len(queue):
                    job = queue[positions[i]]
                    positions[i] += 1
                    if job.state != "waiting" or job.key != head.key:
                        continue
                    if tokens + job.tokens > self.max_batch_tokens:
                        continue
                    job.state = "running"
                    batch.append(job)
                    tokens += job.tokens
                    progress = True
                    break
        return batch

    def wake(self) -> None:
        """Start what may start now (``paused`` turned None)."""
        self._dispatch()

    def _dispatch(self) -> None:
        """Start computations while workers are free, requests wait and nothing pauses."""
        while self._free > 0 and self._waiting > 0:
            if self._paused is not None and self._paused() is not None:
                return
            head = self._next()
            if head is None:
                return
            head.state = "running"
            jobs = self._companions(head)
            if len(jobs) == 1 and self._should_wait(head):
                head.state = "waiting"
                self._queues.setdefault(head.req.namespace, deque()).appendleft(head)
                if head.req.namespace not in self._turns:
                    self._turns.appendleft(head.req.namespace)
                return
            self._set_waiting(self._waiting - len(jobs))
            self._free -= 1
            now = time.monotonic()
            if self._on_wait is not None:
                for job in jobs:
                    self._on_wait(now - job.ticket.admitted)
            asyncio.get_running_loop().create_task(self._compute_jobs(jobs))

    def _should_wait(self, head: _Job) -> bool:
        """True when a mergeable request alone should wait a little for company (and a wake-up
        is scheduled for the end of that wait)."""
        if self.max_batch_delay <= 0 or head.key is None or self._refusing is not None:
            return False  # (draining: company may never come before the deadline)
        left = head.enqueued + self.max_batch_delay - time.monotonic()
        if left <= 0:
            return False
        if self._delay_handle is None or self._delay_handle.cancelled():
            loop = asyncio.get_running_loop()
            self._delay_handle = loop.call_later(left, self._woken)
        return True

    def _woken(self) -> None:
        self._delay_handle = None
        self._dispatch()

    async def _compute_jobs(self, jobs: list[_Job]) -> None:
        loop = asyncio.get_running_loop()
        reqs = [job.req for job in jobs]
        contexts = [job.context for job in jobs]
        if self._on_batch is not None:
            self._on_batch(len(jobs))
        try:
            outcomes = await loop.run_in_executor(self._executor, self._compute, reqs, contexts)
        except BaseException as exc:  # (the computation itself failed: every request with it)
            for job in jobs:
                if not job.future.done():
                    job.future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
        else:
            for job, outcome in zip(jobs, outcomes, strict=True):
                if not job.future.done():
                    job.future.set_result(outcome)
        finally:
            self._free += 1
            self._completed(len(jobs))
            self._dispatch()

    def _completed(self, count: int) -> None:
        now = time.monotonic()
        if self._last_done is not None and count:
            interval = (now - self._last_done) / count
            self._interval += DRAIN_SMOOTHING * (interval - self._interval)
        self._last_done = now


__all__ = ["Computation", "ComputeFn", "Scheduler", "Ticket"]
