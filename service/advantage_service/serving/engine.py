"""The data plane every transport calls: admission and the queue (``scheduler``), decoding off
the event loop, limits, the estimator pipeline on the compute workers (merging compatible
requests), the reads and writes of terms that keep state (``term_state``, ``stats_writer``),
and metrics. No wire types here: a transport hands in a decoded request (or a function that
decodes one) and, optionally, a function that encodes the answer.

Threads: decoding and encoding run on a pool of ``ADV_MAX_INFLIGHT`` codec threads, so a queued
request's body is parsed while others compute (an answer's encoding before any waiting
decoding: ``codec_pool``); computations run on ``ADV_MAX_INFLIGHT`` compute workers, fed by the
scheduler; statistics writes on one worker of their own, after the answer (coalesced in rounds;
while they are behind, the scheduler starts no computation).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from ..batch import RolloutBatch
from ..config import Settings
from ..errors import RequestError, deadline_exceeded
from ..estimators import TERMS, AdvantageResult, TermContext, resolve_device
from ..estimators.pipeline import check_inputs, derivable_inputs, derive_inputs
from ..estimators.state import WriteOptions
from ..observability.metrics import TOKEN_SAMPLE, Metrics
from ..stats import StatsStore
from ..version import __version__
from ..wire.jsonio import BodyLimits
from ..wire.request import ComputeRequest, parse_request, with_server_defaults
from . import assembly, merging
from .accounting import UNKNOWN_ESTIMATOR, Call
from .auth import Authenticator, Principal
from .codec_pool import FINISH, START, CodecPool
from .compute import check_finite, compute_request, summarize
from .scheduler import LOCAL, Computation, Scheduler, Ticket
from .stats_writer import StatsWriter
from .tenancy import Budget, Limits, Tenant
from .term_state import StateSession
from .token_text import TokenText

log = logging.getLogger("advantage_service.engine")

T = TypeVar("T")
Decoder = Callable[[], ComputeRequest]
Encoder = Callable[[ComputeRequest, AdvantageResult, dict[str, Any]], T]

__all__ = ["UNKNOWN_ESTIMATOR", "Computed", "ComputedHook", "Engine", "check_finite"]

# Why the queue holds requests back while the statistics writes are behind (in the 503).
WRITES_BEHIND = (
    "the statistics writes of earlier requests are behind: no computation starts until they "
    "catch up (ADV_STATS_MAX_BACKLOG)"
)


def _compile_loops() -> None:
    """Compile (or load from the cache) the CPU loops, logging how long it took."""
    start = time.perf_counter()
    from ..estimators import gtpo_kernels, kernels

    kernels.compile_all()
    gtpo_kernels.compile_all()
    log.info("CPU loops compiled in %.1f s", time.perf_counter() - start)


@dataclass
class Computed(Generic[T]):
    """A computed request: the decoded request, the result tensors, the summary the response
    carries, and whatever the transport's encoder made of them (None without an encoder)."""

    request: ComputeRequest
    result: AdvantageResult
    summary: dict[str, Any]
    encoded: T | None = None
    # True when ``encoded`` is the JSON response's bytes (the transport said so): a hook that
    # wants the JSON answer takes these instead of writing it again.
    encoded_json: bool = False


# What the engine hands every computed request to, whatever its transport (the viewer keeps
# requests through one): awaited after the request is computed and encoded, before the
# transport answers. A hook must not raise; one that does is logged, never the request's error.
ComputedHook = Callable[[Computed[Any]], Awaitable[None]]


class Engine:
    """The data plane. ``await engine.compute(request, transport)`` from any transport."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics | None = None,
        *,
        store: StatsStore | None = None,
        auth: Authenticator | None = None,
        compute: Callable[..., AdvantageResult] = compute_request,
    ) -> None:
        # ``compute`` computes one (possibly merged) request on the device: compute_request,
        # or, in tests, a wrapper that holds or fails it.
        self.compute_fn = compute
        self.settings = settings
        self.metrics = metrics if metrics is not None else Metrics()
        self.device = resolve_device(settings.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device {settings.device!r} was asked for but CUDA is unavailable")
        self.auth = auth if auth is not None else assembly.authenticator(settings, self.metrics)
        self.store = store if store is not None else assembly.stats_store(settings, self.metrics)
        # The local tokenizer (ADV_TOKENIZER): token text for the viewer, and the decoded
        # vocabulary for terms that find an input in it (HICRA's strategic phrases).
        self.token_text = TokenText(settings.tokenizer) if settings.tokenizer else None
        self.metrics.build_info.labels(__version__, self.device.type).set(1)
        self.metrics.max_inflight.set(settings.max_inflight)
        self.metrics.max_queue.set(settings.max_queue)
        self._workers = ThreadPoolExecutor(
            max_workers=settings.max_inflight, thread_name_prefix="advantage-compute"
        )
        self._codecs = CodecPool(settings.max_inflight, "advantage-codec")
        # What every tenant holds of the replica's budgets (tenancy.py): bodies being received,
        # requests admitted, bytes, open streams.
        self.budget = Budget(
            Limits(
                bodies=settings.max_receiving,
                requests=settings.max_queue,
                bytes=settings.max_queue_bytes,
                streams=settings.stream_max_open,
            ),
            settings.tenant_share,
            on_held=lambda label, resource, n: self.metrics.tenant_held.labels(label, resource).inc(
                n
            ),
            on_refused=lambda label, resource: self.metrics.tenant_refusals_total.labels(
                label, resource
            ).inc(),
        )
        self.scheduler = Scheduler(
            workers=settings.max_inflight,
            executor=self._workers,
            compute=self._compute_requests,
            merge_key=merging.merge_key,
            max_queue=settings.max_queue,
            max_queue_bytes=settings.max_queue_bytes,
            queue_timeout=settings.queue_timeout_seconds,
            max_batch_tokens=settings.max_batch_tokens,
            max_batch_delay=settings.max_batch_delay_ms / 1000.0,
            on_depth=self.metrics.queue_depth.set,
            on_held=self.metrics.inflight_requests.set,
            on_wait=self.metrics.queue_wait_seconds.observe,
            on_batch=self.metrics.batch_requests.observe,
            paused=lambda: WRITES_BEHIND if self.writer.behind else None,
            budget=self.budget,
        )
        self.write_options = WriteOptions(compression=settings.stats_compression)
        self.writer = StatsWriter(
            self.write_options,
            settings.stats_max_backlog,
            retry_seconds=settings.stats_retry_seconds,
            on_outcome=lambda outcome, n: self.metrics.stats_requests_total.labels(outcome).inc(n),
            on_error=lambda op: self.metrics.stats_store_errors_total.labels(op).inc(),
            on_backlog=self.metrics.stats_write_backlog.set,
            on_round=self.metrics.stats_write_round_requests.observe,
            on_room=self.scheduler.wake,
        )
        self.warm = False
        self.draining = False
        # Set when the listeners close on shutdown: transports refuse new calls (UNAVAILABLE).
        self.closing = False
        self.writer.on_poisoned = self.metrics.stats_poisoned_total.inc
        self._computed_hooks: list[ComputedHook] = []

    # ---- lifecycle ------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Serving: warmed up and not draining for shutdown."""
        return self.warm and not self.draining

    @property
    def inflight(self) -> int:
        """Requests admitted and not yet answered (being received, waiting or computing)."""
        return self.scheduler.held + self.scheduler.receiving

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
        compute_request(req, self.device)
        # The CPU loops some methods use (estimators/kernels.py): compiled, or loaded from
        # numba's disk cache (0.5 s), before the service is ready, so that neither the first
        # request that needs one nor the process's memory changes after it reports ready.
        _compile_loops()
        self.warm = True

    def close(self) -> None:
        """Wait for running computations, then stop the workers."""
        self._workers.shutdown(wait=True)
        self._codecs.shutdown(wait=True)
        self.writer.close()

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

    async def settle_writes(self, timeout: float | None = None) -> int:
        """Wait (up to ``timeout`` s) for the statistics writes accepted so far; the number of
        requests whose writes are still not done then."""
        return await self.writer.settle(timeout)

    async def flush(self, timeout: float | None = None) -> None:
        """Accept no more statistics, wait (up to ``timeout`` s) for the accepted writes, then
        close the store."""
        await self.auth.stop()
        await self.writer.flush(timeout)
        await self.store.close()

    def stats_store_status(self) -> str:
        """``memory`` (embedded store), ``up``, ``degraded`` (part of a Redis Cluster does not
        answer) or ``down`` (Redis)."""
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

    # ---- hooks --------------------------------------------------------------------------------

    def add_computed_hook(self, hook: ComputedHook) -> None:
        """Hand every request computed from now on to ``hook`` (see :data:`ComputedHook`)."""
        self._computed_hooks.append(hook)

    def remove_computed_hook(self, hook: ComputedHook) -> None:
        """Stop handing computed requests to ``hook`` (a hook not added: nothing to do)."""
        with contextlib.suppress(ValueError):
            self._computed_hooks.remove(hook)

    async def _run_computed_hooks(self, computed: Computed[Any]) -> None:
        for hook in list(self._computed_hooks):
            try:
                await hook(computed)
            except Exception:  # (a hook's failure is never the request's)
                log.exception("a hook on computed request %r failed", computed.request.request_id)

    # ---- calls and admission --------------------------------------------------------------------

    def call(
        self,
        transport: str,
        *,
        principal: Principal | None = None,
        started: float | None = None,
        count: bool = True,
    ) -> Call:
        """The accounting of one call: ``with engine.call(...) as call:`` around everything the
        transport does for it, so that it is timed, counted and logged once, however it ends."""
        call = Call(self.metrics, transport, principal=principal, count=count)
        if started is not None:
            call.started = started
        return call

    @property
    def body_limits(self) -> BodyLimits:
        """What a request body may hold, for decoders that count before parsing."""
        return BodyLimits(
            max_tokens=self.settings.max_request_tokens,
            max_rollouts=self.settings.max_request_rollouts,
        )

    def tenant(self, principal: Principal | None, address: str | None = None) -> Tenant:
        """Who a call's resources are counted against (tenancy.py): its principal with
        authentication on; on an open service, the client's ``address`` (its host), shown in
        metrics as the principal's name (``anonymous``)."""
        if self.auth.enabled and principal is not None:
            return Tenant(principal.name, principal.name, principal.limits)
        if address is None:  # in-process, or a transport that cannot tell: the replica's
            return LOCAL
        return Tenant(f"address:{address}", principal.name if principal else "anonymous")

    def admit(self, nbytes: int = 0, tenant: Tenant = LOCAL, *, receiving: bool = False) -> Ticket:
        """A place for a request whose body has (at least) ``nbytes`` bytes, taken before the
        body is read (``receiving``: among the bodies being received, until
        :meth:`Ticket.received`); raises :class:`~.errors.Overloaded` (503) when the replica or
        the tenant is at its limit."""
        return self.scheduler.admit(nbytes, tenant, receiving=receiving)

    async def receive(
        self, tenant: Tenant, read: Callable[[Ticket], Awaitable[T]], declared: int = 0
    ) -> tuple[Ticket, T]:
        """The admission of every request whose body still has to arrive (an HTTP body, a
        gRPC call's message): a place among the bodies being received for ``tenant``
        (``declared`` bytes, when the transport knows them), the body from ``read(ticket)``
        (which tells ``ticket.hold`` what has arrived), then a place among the requests
        admitted. The place is released when any step fails; else the caller releases it
        (``with ticket:``) once it has answered."""
        ticket = self.admit(declared, tenant, receiving=True)
        try:
            body = await read(ticket)
            ticket.received()
        except BaseException:
            ticket.release()
            raise
        return ticket, body

    # ---- limits ---------------------------------------------------------------------------------

    def check_limits(self, req: ComputeRequest) -> None:
        """Raise :class:`LimitExceeded` (413) for a request over the configured sizes."""
        batch, limits = req.batch, self.settings.request_limits
        limits.check_tokens(batch.num_tokens)
        limits.check_rollouts(batch.num_rollouts)
        if batch.num_groups:
            sizes = batch.group_sizes
            g = int(torch.argmax(sizes))
            limits.check_group_size(batch.group_ids[g], int(sizes[g]))

    # ---- the request path -----------------------------------------------------------------------

    async def compute(
        self,
        request: ComputeRequest | Decoder,
        transport: str,
        *,
        encode: Encoder[T] | None = None,
        ticket: Ticket | None = None,
        started: float | None = None,
        principal: Principal | None = None,
        call: Call | None = None,
        tenant: Tenant | None = None,
        nbytes: int = 0,
        encodes_json: bool = False,
    ) -> Computed[T]:
        """Decode (when given a decoder), authorise, check limits, queue, compute, record,
        encode, then hand the computed request to the hooks (:meth:`add_computed_hook`).

        Takes a place in the queue for ``tenant`` (by default the principal's) and ``nbytes``
        (a message already received) unless the transport already holds one (``ticket``, from
        :meth:`admit`, taken before reading a large body). ``principal`` (from :attr:`auth`)
        must allow the request's namespace (403 otherwise). Accounts for the call (metrics, the
        access line) unless the transport does (``call``, from :meth:`call`). Raises
        :class:`RequestError`: 422/413 for the request, 403, 503 :class:`~.errors.Overloaded`
        (queue full, or waited past ``ADV_QUEUE_TIMEOUT_SECONDS``), 504 past
        ``ADV_REQUEST_TIMEOUT_SECONDS``. The answer comes on time at the deadline; the place
        stays taken until the decoding or encoding worker really finishes. ``encodes_json``:
        ``encode`` writes the JSON response's bytes (:attr:`Computed.encoded_json`).
        """
        own_call = call is None
        if call is None:
            call = self.call(transport, principal=principal, started=started)
        with call if own_call else contextlib.nullcontext(call):
            own_ticket = ticket is None
            if ticket is None:
                ticket = self.admit(
                    nbytes, tenant if tenant is not None else self.tenant(principal)
                )
            try:
                computed = await self._compute(request, encode, ticket, principal, call)
            finally:
                if own_ticket:
                    ticket.release()
        computed.encoded_json = encode is not None and encodes_json
        # (After the call's accounting and the place in the queue, when the engine holds them:
        # what a hook does is no part of the request's time.)
        if self._computed_hooks:
            await self._run_computed_hooks(computed)
        return computed

    async def _compute(
        self,
        request: ComputeRequest | Decoder,
        encode: Encoder[T] | None,
        ticket: Ticket,
        principal: Principal | None,
        call: Call,
    ) -> Computed[T]:
        limit = self.settings.request_timeout_seconds
        deadline = asyncio.timeout(limit)
        try:
            async with deadline:
                req = (
                    request
                    if isinstance(request, ComputeRequest)
                    else await self._decode(ticket, request)
                )
                req = with_server_defaults(req, self.settings.ignore_token_ids)
                call.request, call.estimator = req, req.estimator.label
                if principal is not None:
                    principal.authorize(req.namespace)
                self.check_limits(req)
                if self.token_text is not None and derivable_inputs(req.batch, req.estimator):
                    req = await self._on_codec(ticket, START, self._derive_inputs, req)
                # Request errors before the queue: a merged computation never fails for one.
                check_inputs(req.batch, req.estimator, req.returns)
                session = StateSession(self.store, req, self.device, self.write_options)
                context = session.context if session.context.reads else None
                try:
                    done = await self.scheduler.run(req, context, ticket)
                    if done.error is not None:
                        raise done.error
                    history = await session.settle()
                    # (409 for a request id counted before for another body: not accepted)
                    session.check_request_id()
                finally:
                    session.cancel()
                assert done.result is not None
                recorded = self.writer.accept(session, done.result)
                summary = summarize(
                    req,
                    self.device,
                    done.seconds * 1000.0,
                    history,
                    done.shared,
                    recorded,
                    session.group_history(history),
                )
                call.summary = summary
                encoded = (
                    None
                    if encode is None
                    else await self._on_codec(ticket, FINISH, encode, req, done.result, summary)
                )
        except TimeoutError:
            if not deadline.expired():
                raise
            raise deadline_exceeded(limit) from None
        return Computed(req, done.result, summary, encoded)

    def _derive_inputs(self, req: ComputeRequest) -> ComputeRequest:
        """``req`` with the inputs its terms make from the decoded tokens (a codec thread's
        work: the vocabulary is decoded once, then text is matched per request)."""
        assert self.token_text is not None
        batch = derive_inputs(req.batch, req.estimator, self.token_text.vocabulary())
        return replace(req, batch=batch)

    async def _on_codec(
        self, ticket: Ticket, priority: int, fn: Callable[..., Any], *args: Any
    ) -> Any:
        """``fn(*args)`` on a codec thread (``FINISH`` work before ``START`` work); the
        request's place stays taken until it ends."""
        future = asyncio.wrap_future(self._codecs.submit(priority, fn, *args))
        ticket.keep(future)
        return await asyncio.shield(future)

    async def _decode(self, ticket: Ticket, decode: Decoder) -> ComputeRequest:
        """The request ``decode`` reads, on a codec thread; a 503 (retry elsewhere) without
        decoding it when, by the time a thread is free, the scheduler refuses every request
        that would wait (a shutdown deadline is near: it could not be answered in time)."""
        req = await self._on_codec(ticket, START, self._unless_refusing, decode)
        if req is None:
            why = self.scheduler.refusing
            assert why is not None  # (it is never unset)
            raise self.scheduler.overloaded(why)
        return req

    def _unless_refusing(self, decode: Decoder) -> ComputeRequest | None:
        # (On the codec thread: reads one attribute the event loop sets.)
        return None if self.scheduler.refusing is not None else decode()

    # ---- on the compute workers ---------------------------------------------------------------

    def _compute_requests(
        self, reqs: Sequence[ComputeRequest], contexts: Sequence[TermContext | None]
    ) -> list[Computation]:
        """One computation for ``reqs`` (merged when there are several), an outcome each. A
        merged computation that fails is redone one request at a time, so that an error is its
        own request's alone."""
        if len(reqs) == 1:
            return [self._compute_alone(reqs[0], contexts[0])]
        try:
            batch = merging.merge(reqs)
            merged, seconds = self._timed(replace(reqs[0], batch=batch), None)
            parts = merging.split(merged, batch)
        except Exception:
            log.exception("a merged computation of %d requests failed; computing each", len(reqs))
            return [self._compute_alone(r, c) for r, c in zip(reqs, contexts, strict=True)]
        self.metrics.compute_duration_seconds.labels(
            reqs[0].estimator.label, self.device.type
        ).observe(seconds)
        shared = len(reqs)
        return [
            self._finish(req, part, seconds, shared) for req, part in zip(reqs, parts, strict=True)
        ]

    def _compute_alone(self, req: ComputeRequest, context: TermContext | None) -> Computation:
        try:
            result, seconds = self._timed(req, context)
        except Exception as exc:  # its own request's error (or fault) alone
            return Computation(None, exc, 0.0, 1)
        self.metrics.compute_duration_seconds.labels(req.estimator.label, self.device.type).observe(
            seconds
        )
        return self._finish(req, result, seconds, 1)

    def _timed(
        self, req: ComputeRequest, context: TermContext | None
    ) -> tuple[AdvantageResult, float]:
        start = time.perf_counter()
        result = self.compute_fn(req, self.device, context)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return result, time.perf_counter() - start

    def _finish(
        self, req: ComputeRequest, result: AdvantageResult, seconds: float, shared: int
    ) -> Computation:
        try:
            check_finite(req, result)
        except RequestError as exc:
            return Computation(None, exc, seconds, shared)
        self._observe(req.batch, result, req.estimator.label)
        return Computation(result, None, seconds, shared)

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
                0, batch.group_index.cpu(), (batch.rewards.cpu() > 0).double()
            )
            m.group_accuracy.observe_many((correct / batch.group_sizes.cpu()).numpy())
        n = result.advantages.numel()
        if n:
            stride = max(1, n // TOKEN_SAMPLE)
            sample = result.advantages[::stride][:TOKEN_SAMPLE].cpu().numpy()
            m.token_advantage.observe_many(sample.astype(np.float64), label)
