"""The gRPC transport (grpc.aio): ``advantage.v1.AdvantageService`` over the one engine.

Wire messages in, :class:`ComputeRequest` to the engine, results back out; no math, no policy.
Flat arrays travel as raw little-endian bytes with an explicit dtype and become the flat batch
through ``np.frombuffer`` and :meth:`RolloutBatch.from_flat`, as the Arrow codec's buffers do.

``StreamCompute`` reads rollouts that arrive one by one (:mod:`.grpc_stream`); the stream's
group assembly (:mod:`..serving.stream_groups`) hands back each group as soon as its last
rollout is in, computed as one engine request (so its numbers are those of the group computed
alone). Per stream the incomplete groups and the tokens they hold are bounded, and so are the
responses outstanding (computing or not yet written): when that many are out the stream stops
reading, so gRPC flow control holds the client back instead of the server buffering without end.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import grpc
from advantage_contract.grpc_gen import advantage_pb2 as pb
from advantage_contract.grpc_gen import advantage_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from ..config import Settings
from ..errors import Overloaded, RequestError
from ..serving.accounting import Call
from ..serving.auth import Principal
from ..serving.engine import Engine
from ..serving.scheduler import Ticket
from ..serving.stream_groups import StreamLimits
from ..serving.tenancy import Refusal
from .grpc_codec import (
    INTERNAL_MESSAGE,
    SERVICE_NAME,
    SHUTTING_DOWN,
    TRANSPORT,
    Malformed,
    abort,
    decode_compute_message,
    encode_compute_response,
    estimators_message,
    lenient,
)
from .grpc_stream import StreamEnd, StreamSession

log = logging.getLogger("advantage_service.grpc")

# The retry hint of a stream refused for ADV_STREAM_MAX_OPEN (streams last long: a second).
STREAM_RETRY_MS = 1000


def peer_host(context: grpc.aio.ServicerContext) -> str | None:
    """The client's host from gRPC's peer string (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``,
    ``unix:...``): what tells clients apart on an open service (tenancy.py)."""
    peer = context.peer() or ""
    kind, _, rest = peer.partition(":")
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]") or None
    if kind == "ipv4":
        return rest.rpartition(":")[0] or None
    return peer or None


def add_servicer(servicer: AdvantageServicer, server: grpc.aio.Server) -> None:
    """Register the servicer as the generated ``add_AdvantageServiceServicer_to_server`` does,
    with deserializers that let a corrupt message be answered INVALID_ARGUMENT. ``Compute``
    takes the message's bytes: it checks them against the limits before protobuf parses them
    (grpc_wire), on a codec thread."""
    # The unary methods are taken as a stream of requests (the bytes on the wire are the same):
    # gRPC runs a unary handler only once its message is whole, so a call that never sends it
    # would hold a place among ADV_MAX_CONNECTIONS for good, outside every limit and share;
    # the handler runs at once and waits for the message within the body's deadline instead.
    handlers = {
        "Compute": grpc.stream_unary_rpc_method_handler(
            servicer.Compute,
            request_deserializer=None,
            response_serializer=pb.ComputeResponse.SerializeToString,
        ),
        "StreamCompute": grpc.stream_stream_rpc_method_handler(
            servicer.StreamCompute,
            request_deserializer=lenient(pb.StreamRequest),
            response_serializer=pb.StreamResponse.SerializeToString,
        ),
        "ListEstimators": grpc.stream_unary_rpc_method_handler(
            servicer.ListEstimators,
            request_deserializer=lenient(pb.ListEstimatorsRequest),
            response_serializer=pb.ListEstimatorsResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class AdvantageServicer(pb_grpc.AdvantageServiceServicer):
    """``advantage.v1.AdvantageService`` on an :class:`Engine`."""

    def __init__(
        self, engine: Engine, settings: Settings, limits: StreamLimits | None = None
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.limits = limits if limits is not None else StreamLimits.from_settings(settings)
        self._estimators = estimators_message()
        self.open_streams = 0
        self.message_limits = settings.request_limits

    async def _authenticate(self, context: grpc.aio.ServicerContext, call: Call) -> Principal:
        """The caller's principal from the ``authorization: Bearer ...`` metadata (kept on
        ``call``); raises UNAUTHENTICATED otherwise, and for more than one such entry (the
        HTTP routes make the same call). Ends the call with UNAVAILABLE once the service is
        closing for shutdown: the client retries elsewhere."""
        if self.engine.closing:
            await abort(context, SHUTTING_DOWN)
        values = [
            value.decode() if isinstance(value, bytes) else value
            for key, value in context.invocation_metadata() or ()
            if key == "authorization"
        ]
        call.principal = self.engine.auth.authenticate(values)
        return call.principal

    async def _message(self, requests: AsyncIterator[Any]) -> Any:
        """A unary call's one message, within the body's deadline (ADV_BODY_TIMEOUT_SECONDS,
        else the request deadline): a 408 past it, a 422 for a call that ends without one."""
        timeout = self.settings.body_timeout
        try:
            async with asyncio.timeout(timeout):
                message = await anext(aiter(requests), None)
        except TimeoutError:
            raise RequestError(
                "body_timeout",
                f"the request message did not arrive within {timeout:g} s "
                "(ADV_REQUEST_TIMEOUT_SECONDS or ADV_BODY_TIMEOUT_SECONDS)",
                field="body",
                status=408,
            ) from None
        if message is None:
            raise RequestError("invalid_protobuf", "the call sent no request message")
        return message

    async def Compute(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> pb.ComputeResponse:
        try:
            with self.engine.call(TRANSPORT) as call:
                principal = await self._authenticate(context, call)
                # A place among the messages being received, for the caller's tenant, before
                # the message is awaited (as an HTTP body's): one tenant's calls that never
                # send theirs hold at most its share, each until the deadline.
                tenant = self.engine.tenant(principal, peer_host(context))

                async def read(ticket: Ticket) -> bytes:
                    request: bytes = await self._message(requests)
                    ticket.hold(len(request))
                    return request

                ticket, request = await self.engine.receive(tenant, read)
                with ticket:
                    computed = await self.engine.compute(
                        partial(decode_compute_message, request, self.message_limits),
                        TRANSPORT,
                        encode=encode_compute_response,
                        ticket=ticket,
                        principal=principal,
                        call=call,
                    )
        except RequestError as exc:
            await abort(context, exc)
            raise  # unreachable: abort raises
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception:
            log.exception("internal error in Compute")
            await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)
            raise
        assert computed.encoded is not None
        return computed.encoded

    async def StreamCompute(
        self,
        request_iterator: AsyncIterator[pb.StreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.StreamResponse]:
        try:
            with self.engine.call(TRANSPORT) as call:
                principal = await self._authenticate(context, call)
                tenant = self.engine.tenant(principal, peer_host(context))
                # ADV_STREAM_MAX_OPEN for the replica, the tenant's share of it for each tenant:
                # one tenant's streams, idle or not, never keep another's from opening.
                try:
                    self.engine.budget.take(tenant, "streams")
                except Refusal as refusal:
                    raise Overloaded(
                        f"{refusal}: retry later",
                        retry_after_ms=STREAM_RETRY_MS,
                        field="streams",
                    ) from None
                call.skip()  # the stream's groups are accounted one by one, as computed
        except RequestError as exc:
            await abort(context, exc)
            raise  # unreachable: abort raises
        session = StreamSession(self.engine, self.settings, self.limits, principal, tenant)
        metrics = self.engine.metrics
        self.open_streams += 1
        metrics.stream_open.inc()
        session.start(request_iterator)
        try:
            while not isinstance(item := await session.out.get(), StreamEnd):
                yield item
                session.outstanding.release()
            if item.internal:
                await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)
            if item.error is not None:
                await abort(context, item.error)
        finally:
            session.release()
            self.engine.budget.give(tenant, "streams")
            self.open_streams -= 1
            metrics.stream_open.dec()

    async def ListEstimators(
        self, requests: AsyncIterator[pb.ListEstimatorsRequest], context: grpc.aio.ServicerContext
    ) -> pb.ListEstimatorsResponse:
        try:
            with self.engine.call(TRANSPORT, count=False) as call:
                principal = await self._authenticate(context, call)
                tenant = self.engine.tenant(principal, peer_host(context))
                with self.engine.admit(0, tenant, receiving=True):
                    request = await self._message(requests)
                if isinstance(request, Malformed):
                    raise request.error()
        except RequestError as exc:
            await abort(context, exc)
        return self._estimators


# ---- the server --------------------------------------------------------------------------------


@dataclass
class _Running:
    health: health_aio.HealthServicer
    port: int


_RUNNING: weakref.WeakKeyDictionary[grpc.aio.Server, _Running] = weakref.WeakKeyDictionary()


def server_credentials(settings: Settings) -> grpc.ServerCredentials | None:
    """TLS credentials from ``tls_cert``/``tls_key`` (mutual TLS with ``tls_client_ca``);
    None without TLS."""
    if not settings.tls_cert or not settings.tls_key:
        return None

    def read(path: str) -> bytes:
        with open(path, "rb") as handle:
            return handle.read()

    ca = read(settings.tls_client_ca) if settings.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(read(settings.tls_key), read(settings.tls_cert))],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )


def server_options(settings: Settings) -> list[tuple[str, Any]]:
    return [
        # The body limit of HTTP, for the same payload: over it gRPC answers RESOURCE_EXHAUSTED.
        ("grpc.max_receive_message_length", settings.max_body_bytes),
        ("grpc.max_send_message_length", -1),
        # Refuse to share a port with another process (gRPC's default on Linux allows it).
        ("grpc.so_reuseport", 0),
    ]


async def start_grpc_server(
    engine: Engine,
    settings: Settings,
    host: str,
    port: int,
    *,
    limits: StreamLimits | None = None,
) -> grpc.aio.Server:
    """Start ``AdvantageService``, the health service (SERVING once started) and server
    reflection on ``host:port`` (0: a free port; :func:`bound_port` tells which), on the
    running event loop. Stop it with :func:`stop_grpc_server`."""
    # Calls beyond max_connections are refused (RESOURCE_EXHAUSTED) before their message is
    # held: what the server holds for calls it has not admitted stays bounded.
    server = grpc.aio.server(
        options=server_options(settings), maximum_concurrent_rpcs=settings.max_connections
    )
    add_servicer(AdvantageServicer(engine, settings, limits), server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (
            SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    credentials = server_credentials(settings)
    try:
        bound = (
            server.add_secure_port(address, credentials)
            if credentials is not None
            else server.add_insecure_port(address)
        )
    except RuntimeError as exc:
        raise RuntimeError(f"cannot listen for gRPC on {address}: {exc}") from exc
    await server.start()
    for service in ("", SERVICE_NAME):
        await health.set(service, health_pb2.HealthCheckResponse.SERVING)
    _RUNNING[server] = _Running(health, bound)
    log.info("gRPC on %s:%d%s", host, bound, " (TLS)" if credentials is not None else "")
    return server


def bound_port(server: grpc.aio.Server) -> int:
    """The port a server from :func:`start_grpc_server` listens on."""
    return _RUNNING[server].port


async def stop_serving(server: grpc.aio.Server) -> None:
    """Report NOT_SERVING on the health service (calls are still served)."""
    running = _RUNNING.get(server)
    if running is not None:
        await running.health.enter_graceful_shutdown()


async def stop_grpc_server(server: grpc.aio.Server, grace: float | None) -> None:
    """Report NOT_SERVING, refuse new calls, and give calls in flight ``grace`` seconds."""
    await stop_serving(server)
    _RUNNING.pop(server, None)
    await server.stop(grace)
