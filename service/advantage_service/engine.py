"""The data plane every transport calls: limits, admission, the estimator pipeline off the event
loop, statistics hooks and metrics. No wire types here: a transport hands in a decoded request
(or a function that decodes one) and, optionally, a function that encodes the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from . import __version__
from .api import compute_request, summarize
from .auth import Authenticator, Principal
from .batch import RolloutBatch
from .config import Settings
from .errors import LimitExceeded, RequestError
from .estimators import TERMS, AdvantageResult, TermContext, resolve_device
from .estimators.state import WriteOptions
from .logs import access
from .metrics import TOKEN_SAMPLE, Metrics
from .request import ComputeRequest, parse_request
from .stats import StatsStore, make_store
from .term_state import StateSession

log = logging.getLogger("advantage_service.engine")

T = TypeVar("T")
Decoder = Callable[[], ComputeRequest]
Encoder = Callable[[ComputeRequest, AdvantageResult, dict[str, Any]], T]

# Estimator label for requests rejected before their estimator was known.
UNKNOWN_ESTIMATOR = "unknown"
# Weight of the newest request in the moving average that sizes Retry-After.
RETRY_AFTER_SMOOTHING = 0.2


class Saturated(Exception):
    """Every admission slot is taken: the client should retry after ``retry_after`` seconds
    (HTTP 429 with Retry-After, gRPC RESOURCE_EXHAUSTED). The engine never queues."""

    code = "saturated"

    def __init__(self, limit: int, retry_after: int) -> None:
        self.limit = limit
        self.retry_after = retry_after
        self.message = (
            f"the service is computing {limit} requests (ADV_MAX_INFLIGHT); "
            f"retry after {retry_after} s"
        )
        super().__init__(self.message)

    def to_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "message": self.message,
            "group_id": None,
            "rollout_index": None,
            "field": None,
        }


def deadline_exceeded(seconds: float) -> RequestError:
    """The answer to a request whose computation outlived ``ADV_REQUEST_TIMEOUT_SECONDS``
    (HTTP 504, gRPC DEADLINE_EXCEEDED)."""
    return RequestError(
        "deadline_exceeded",
        f"the computation took longer than {seconds:g} s (ADV_REQUEST_TIMEOUT_SECONDS): "
        "split the batch or retry later",
        status=504,
    )


class Slot:
    """One admitted request. Release it once (a context manager does).

    A worker thread cannot be interrupted, so a request answered before its worker finished
    (deadline, cancellation) keeps its slot until the worker is done: :meth:`hold` ties the
    slot to a worker's future, and the release waits for every held future.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._released = False
        self._freed = False
        self._busy: set[asyncio.Future[Any]] = set()

    def hold(self, future: asyncio.Future[Any]) -> None:
        """Keep the slot taken until ``future`` (a worker's) is done."""
        self._busy.add(future)
        future.add_done_callback(self._worker_done)

    def _worker_done(self, future: asyncio.Future[Any]) -> None:
        self._busy.discard(future)
        if not future.cancelled():
            future.exception()  # retrieved: an abandoned worker's error is not "never retrieved"
        if self._released and not self._busy:
            self._free()

    def release(self) -> None:
        if not self._released:
            self._released = True
            if not self._busy:
                self._free()

    def _free(self) -> None:
        if not self._freed:
            self._freed = True
            self._engine._release()

    def __enter__(self) -> Slot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass
class Computed(Generic[T]):
    """A computed request: the decoded request, the result tensors, the summary the response
    carries, and whatever the transport's encoder made of them (None without an encoder)."""

    request: ComputeRequest
    result: AdvantageResult
    summary: dict[str, Any]
    encoded: T | None = None


def check_finite(req: ComputeRequest, result: AdvantageResult) -> None:
    """Raise RequestError when a result value is NaN or infinite.

    Valid inputs give finite values; extreme parameters can overflow float32 (``opsd.coef`` of
    1e308) or divide zero by zero (``epsilon`` 0 on a group of equal rewards). JSON cannot carry
    such a value, and a trainer must not train on one, so the request is refused and located.
    """
    batch = req.batch
    per_token = {"advantages": result.advantages, **result.diagnostics}
    for name, values in per_token.items():
        finite = torch.isfinite(values)
        if not bool(finite.all()):
            p = int(torch.nonzero(~finite)[0])
            rollout, token = batch.token_position(p)
            raise RequestError(
                "non_finite_result",
                f"the estimator gave {name}[{token}] = {float(values[p])}; its parameters are "
                "too extreme for this data (float32)",
                **batch.locate_rollout(rollout, "estimator"),
            )
    finite = torch.isfinite(result.scalars)
    if not bool(finite.all()):
        i = int(torch.nonzero(~finite)[0])
        raise RequestError(
            "non_finite_result",
            f"the estimator gave a non-finite scalar ({float(result.scalars[i])}); its "
            "parameters are too extreme for this data",
            **batch.locate_rollout(i, "estimator"),
        )


# Niceness of the statistics worker (and the torch threads it starts, which inherit it): building
# a request's statistics costs about as much CPU as computing it, and must not slow the next
# request's compute on a busy machine.
STATS_NICENESS = 10


def _lower_priority() -> None:
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), STATS_NICENESS)


class Engine:
    """The data plane. ``await engine.compute(request, transport)`` from any transport."""

    def __init__(self, settings: Settings, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics if metrics is not None else Metrics()
        self.device = resolve_device(settings.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device {settings.device!r} was asked for but CUDA is unavailable")
        # One worker per admission slot: the admitted requests are exactly those computing.
        self._executor = ThreadPoolExecutor(
            max_workers=settings.max_inflight, thread_name_prefix="advantage-compute"
        )
        self._lock = threading.Lock()
        self._inflight = 0
        self._mean_seconds = 1.0
        self.warm = False
        self.draining = False
        # Set when the listeners close on shutdown: transports refuse new calls (UNAVAILABLE).
        self.closing = False
        self.metrics.max_inflight.set(settings.max_inflight)
        # Raises TokensFileError for a bad tokens file: the service must not start open by
        # mistake.
        self.auth = Authenticator(
            settings.auth_tokens_file,
            reload_seconds=settings.auth_reload_seconds,
            on_reload=lambda outcome: self.metrics.auth_reloads_total.labels(outcome).inc(),
            on_tokens=self.metrics.auth_tokens.set,
        )
        self.metrics.build_info.labels(__version__, self.device.type).set(1)
        self.store: StatsStore = make_store(
            settings.redis_url,
            ttl_seconds=settings.stats_ttl_seconds,
            **(
                {
                    "on_error": lambda op: self.metrics.stats_store_errors_total.labels(op).inc(),
                    "on_duration": lambda op, sec: self.metrics.stats_store_duration_seconds.labels(
                        op
                    ).observe(sec),
                    "on_up": lambda up: self.metrics.stats_store_up.set(1 if up else 0),
                }
                if settings.redis_url
                else {}
            ),
        )
        if not settings.redis_url:
            self.metrics.stats_store_up.set(1)
        # Statistics are written after the answer, by one worker of their own so that they never
        # take a compute worker from an admitted request; at most this many wait at once.
        self._stats_executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="advantage-stats", initializer=_lower_priority
        )
        self._pending_writes: set[asyncio.Task[None]] = set()
        self.max_pending_writes = 4 * settings.max_inflight
        self.write_options = WriteOptions(compression=settings.stats_compression)

    # ---- lifecycle ------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Serving: warmed up and not draining for shutdown."""
        return self.warm and not self.draining

    @property
    def inflight(self) -> int:
        return self._inflight

    def warm_up(self) -> None:
        """Compute one tiny request so the first client does not pay for lazy initialisation:
        with every term that needs no inputs besides the tokens."""
        terms: dict[str, dict[str, Any]] = {
            name: {}
            for name, term in TERMS.items()
            if not term.requires({p.name: p.default for p in term.params})
        }
        req = parse_request(
            {
                "estimator": {"outcome": "grpo", **terms},
                "groups": [
                    {
                        "id": "warm-up",
                        "rollouts": [
                            {"tokens": [1, 2], "reward": 1.0},
                            {"tokens": [2], "reward": 0.0},
                        ],
                    }
                ],
            }
        )
        self._compute_sync(req, None, observe=False)
        self.warm = True

    def close(self) -> None:
        """Wait for running computations, then stop the workers."""
        self._executor.shutdown(wait=True)
        self._stats_executor.shutdown(wait=True)

    async def start(self) -> None:
        """Connect the stats store (a store that is down is retried with backoff later) and
        start watching the tokens file."""
        up = await self.store.ping()
        log.info("stats store: %s", self.store.status if up else "down (will retry)")
        if self.auth.enabled:
            log.info("authentication: %s", self.auth.describe())
        else:
            log.warning("AUTHENTICATION IS OFF: %s", self.auth.describe())
        self.auth.start()

    async def settle_writes(self, timeout: float | None = None) -> set[asyncio.Task[None]]:
        """Wait (up to ``timeout`` s) for the statistics writes scheduled so far; the ones still
        running then."""
        pending = list(self._pending_writes)
        if not pending:
            return set()
        _, late = await asyncio.wait(pending, timeout=timeout)
        return late

    async def flush(self, timeout: float | None = None) -> None:
        """Wait (up to ``timeout`` s) for scheduled statistics writes, then close the store."""
        await self.auth.stop()
        if self._pending_writes:
            log.info("flushing %d statistics writes", len(self._pending_writes))
        for task in await self.settle_writes(timeout):
            task.cancel()
        await self.store.close()

    def stats_store_status(self) -> str:
        """``memory`` (embedded store), ``up`` or ``down`` (Redis)."""
        return self.store.status

    async def refresh_stats_store(self) -> str:
        """Ping the store (reconnecting after an outage, within its backoff); its status."""
        await self.store.ping()
        return self.store.status

    async def token_stats(
        self, namespace: str, order: str, limit: int, principal: Principal | None = None
    ) -> dict[str, Any] | None:
        """The namespace's vocabulary statistics (None while the store is down); raises a 403
        :class:`~advantage_service.auth.AuthError` when ``principal`` may not read it."""
        if principal is not None:
            principal.authorize(namespace)
        return await self.store.token_stats(namespace, order, limit)

    # ---- admission ------------------------------------------------------------------------------

    def admit(self, transport: str) -> Slot:
        """Take an admission slot or raise :class:`Saturated` (counted as a 429)."""
        with self._lock:
            if self._inflight >= self.settings.max_inflight:
                saturated = Saturated(self.settings.max_inflight, self.retry_after)
            else:
                self._inflight += 1
                saturated = None
        if saturated is not None:
            self.record_rejection(transport, 429, saturated.code)
            raise saturated
        self.metrics.inflight_requests.inc()
        return Slot(self)

    def _release(self) -> None:
        with self._lock:
            self._inflight -= 1
        self.metrics.inflight_requests.dec()

    @property
    def retry_after(self) -> int:
        """Whole seconds a rejected client should wait: about one typical request."""
        return max(1, math.ceil(self._mean_seconds))

    # ---- limits ---------------------------------------------------------------------------------

    def check_limits(self, req: ComputeRequest) -> None:
        """Raise :class:`LimitExceeded` (413) for a request over the configured sizes."""
        batch = req.batch
        limit = self.settings.max_request_tokens
        if batch.num_tokens > limit:
            raise LimitExceeded(
                f"the request has {batch.num_tokens} tokens; the limit is {limit} "
                "(ADV_MAX_REQUEST_TOKENS): split the batch",
                field="tokens",
            )
        if batch.num_groups:
            sizes = batch.group_sizes
            largest = int(sizes.max())
            if largest > self.settings.max_group_size:
                gid = batch.group_ids[int(torch.argmax(sizes))]
                raise LimitExceeded(
                    f"group {gid!r} has {largest} rollouts; the limit is "
                    f"{self.settings.max_group_size} (ADV_MAX_GROUP_SIZE)",
                    group_id=gid,
                    field="rollouts",
                )

    # ---- the request path -----------------------------------------------------------------------

    async def compute(
        self,
        request: ComputeRequest | Decoder,
        transport: str,
        *,
        encode: Encoder[T] | None = None,
        slot: Slot | None = None,
        started: float | None = None,
        principal: Principal | None = None,
    ) -> Computed[T]:
        """Decode (when given a decoder), authorise, check limits, compute, record, encode.

        Every step that costs more than microseconds runs in a worker thread, so the event loop
        keeps answering health checks and metrics. Takes an admission slot unless the transport
        already holds one (``slot``, from :meth:`admit`, taken before reading a large body).
        ``principal`` (from :attr:`auth`) must allow the request's namespace (403 otherwise).
        Raises :class:`RequestError` (422/413, 403, 504 past ``ADV_REQUEST_TIMEOUT_SECONDS``)
        and :class:`Saturated`. The answer comes on time at the deadline; the slot stays taken
        until the worker really finishes, so admission never overcommits.
        """
        started = time.perf_counter() if started is None else started
        own = slot is None
        if slot is None:
            slot = self.admit(transport)
        label = UNKNOWN_ESTIMATOR
        req: ComputeRequest | None = None
        summary: dict[str, Any] | None = None
        limit = self.settings.request_timeout_seconds
        deadline = asyncio.timeout(limit)
        try:
            try:
                async with deadline:
                    req = (
                        request
                        if isinstance(request, ComputeRequest)
                        else await self._run(slot, request)
                    )
                    label = req.estimator.label
                    if principal is not None:
                        principal.authorize(req.namespace)
                    self.check_limits(req)
                    session = StateSession(self.store, req, self.device, self.write_options)
                    try:
                        result, seconds = await self._run(
                            slot, self._compute_sync, req, session.context
                        )
                        history = await session.settle()
                    finally:
                        session.cancel()
                    summary = summarize(req, self.device, seconds * 1000.0, history)
                    self.metrics.compute_duration_seconds.labels(label, self.device.type).observe(
                        seconds
                    )
                    self._write_stats(session, result)
                    encoded = (
                        None
                        if encode is None
                        else await self._run(slot, encode, req, result, summary)
                    )
            except TimeoutError:
                if not deadline.expired():
                    raise
                raise deadline_exceeded(limit) from None
        except RequestError as exc:
            self.record_rejection(
                transport, exc.status, exc.code, label, req, started=started, principal=principal
            )
            raise
        except asyncio.CancelledError:
            # The client went away (gRPC cancels the handler) or shutdown ran out of time.
            self._access(transport, 499, "cancelled", label, req, None, started, principal)
            raise
        except Exception:
            self.record_rejection(
                transport, 500, "internal", label, req, started=started, principal=principal
            )
            raise
        finally:
            if own:
                slot.release()
        elapsed = time.perf_counter() - started
        self.metrics.requests_total.labels(transport, label, "200").inc()
        self.metrics.request_duration_seconds.labels(transport, label).observe(elapsed)
        self._mean_seconds += RETRY_AFTER_SMOOTHING * (elapsed - self._mean_seconds)
        self._access(transport, 200, None, label, req, summary, started, principal)
        return Computed(req, result, summary, encoded)

    def record_rejection(
        self,
        transport: str,
        status: int,
        error: str,
        estimator: str = UNKNOWN_ESTIMATOR,
        request: ComputeRequest | None = None,
        *,
        started: float | None = None,
        principal: Principal | None = None,
        namespace: str | None = None,
    ) -> None:
        """Count and log a request answered with an error (transports call this for errors they
        raise before the engine sees the request: unauthenticated, unsupported media type, body
        too large)."""
        self.metrics.requests_total.labels(transport, estimator, str(status)).inc()
        self.metrics.request_errors_total.labels(transport, error).inc()
        self._access(
            transport, status, error, estimator, request, None, started, principal, namespace
        )

    def log_access(
        self,
        transport: str,
        status: int,
        error: str | None = None,
        started: float | None = None,
        principal: Principal | None = None,
        namespace: str | None = None,
    ) -> None:
        """An access line for a request that is not a computation (statistics, listings)."""
        self._access(
            transport, status, error, UNKNOWN_ESTIMATOR, None, None, started, principal, namespace
        )

    def _access(
        self,
        transport: str,
        status: int,
        error: str | None,
        estimator: str,
        req: ComputeRequest | None,
        summary: dict[str, Any] | None,
        started: float | None,
        principal: Principal | None,
        namespace: str | None = None,
    ) -> None:
        batch = req.batch if req is not None else None
        access(
            request_id=req.request_id if req is not None else None,
            namespace=req.namespace if req is not None else namespace,
            principal=principal.name if principal is not None else None,
            transport=transport,
            estimator=estimator,
            groups=batch.num_groups if batch is not None else None,
            rollouts=batch.num_rollouts if batch is not None else None,
            tokens=batch.num_tokens if batch is not None else None,
            history=summary["history"] if summary is not None else None,
            compute_ms=round(summary["compute_ms"], 3) if summary is not None else None,
            total_ms=(
                round(1000.0 * (time.perf_counter() - started), 3) if started is not None else None
            ),
            status=status,
            error=error,
        )

    async def _run(self, slot: Slot | None, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on a compute worker. If the caller stops waiting (deadline, client
        gone, shutdown timeout), ``slot`` stays taken until the worker really finishes."""
        future = asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        if slot is not None:
            slot.hold(future)
        return await asyncio.shield(future)

    def _compute_sync(
        self, req: ComputeRequest, context: TermContext | None, observe: bool = True
    ) -> tuple[AdvantageResult, float]:
        start = time.perf_counter()
        result = compute_request(req, self.device, context)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        check_finite(req, result)
        if observe:
            self._observe(req.batch, result, req.estimator.label)
        return result, seconds

    def _observe(self, batch: RolloutBatch, result: AdvantageResult, label: str) -> None:
        """Batch-level training-health metrics (runs on the worker, a few ms at most)."""
        m = self.metrics
        m.tokens_total.labels(label).inc(batch.num_tokens)
        m.rollouts_total.inc(batch.num_rollouts)
        if batch.num_groups:
            zero = int(batch.zero_signal.sum())
            m.groups_total.labels("zero").inc(zero)
            m.groups_total.labels("nonzero").inc(batch.num_groups - zero)
            correct = torch.zeros(batch.num_groups, dtype=torch.float64).index_add_(
                0, batch.group_index, (batch.rewards > 0).double()
            )
            m.group_accuracy.observe_many((correct / batch.group_sizes).numpy())
        n = result.advantages.numel()
        if n:
            stride = max(1, n // TOKEN_SAMPLE)
            sample = result.advantages[::stride][:TOKEN_SAMPLE].cpu().numpy()
            m.token_advantage.observe_many(sample.astype(np.float64), label)

    # ---- statistics store ---------------------------------------------------------------------

    def _write_stats(self, session: StateSession, result: AdvantageResult) -> None:
        """Schedule the request's statistics and records writes; they run after the answer."""
        if len(self._pending_writes) >= self.max_pending_writes:
            # The store is slower than the traffic: drop this request's statistics rather than
            # let pending writes (and their tensors) grow without bound.
            self.metrics.stats_store_errors_total.labels("record_dropped").inc()
            return
        task = asyncio.get_running_loop().create_task(self._record(session, result))
        self._pending_writes.add(task)
        task.add_done_callback(self._pending_writes.discard)

    async def _record(self, session: StateSession, result: AdvantageResult) -> None:
        loop = asyncio.get_running_loop()
        try:
            update = await loop.run_in_executor(self._stats_executor, session.update, result)
            await session.record(update)
        except asyncio.CancelledError:
            raise
        except Exception:  # statistics must never take the service down
            log.exception("statistics write for request %s failed", session.req.request_id)
            self.metrics.stats_store_errors_total.labels("record").inc()
