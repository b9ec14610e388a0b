"""``advantage-service serve``: HTTP (uvicorn) and gRPC around one engine, with a graceful drain.

On SIGTERM (or Ctrl-C): readiness turns false (``/readyz`` 503, gRPC health NOT_SERVING, HTTP
answers carry ``Connection: close``); after ADV_SHUTDOWN_DELAY_SECONDS the listening sockets
close; requests and streams in flight finish (up to ADV_SHUTDOWN_TIMEOUT_SECONDS); scheduled
statistics writes are flushed; then the process exits 0. A second Ctrl-C forces.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import math
import signal
import ssl
import sys
from collections.abc import Callable, Generator
from typing import Any

import uvicorn
from pydantic import ValidationError

from ..config import Settings
from ..observability import logs
from ..serving.auth import TokensFileError
from ..serving.engine import Engine
from .connections import PendingConnections, protocol_class
from .grpc import start_grpc_server, stop_grpc_server, stop_serving
from .http import create_app

log = logging.getLogger("advantage_service.server")

# On shutdown, how long new gRPC calls are refused (UNAVAILABLE) before the server stops.
GRPC_REFUSE_BEFORE_STOP_SECONDS = 0.25


# CLI flag (argparse dest) -> settings field; a flag given overrides the ADV_* variable.
def settings_from_args(args: argparse.Namespace) -> Settings:
    """Settings from ADV_* variables, with the CLI flags that were given on top (every setting
    has a flag of its name)."""
    given = {
        name: getattr(args, name)
        for name in Settings.model_fields
        if getattr(args, name, None) is not None
    }
    return Settings(**given)


class _HTTPServer(uvicorn.Server):
    """uvicorn without its own signal handling: :func:`run` owns the signals so one SIGTERM
    drains every transport, and a drained process exits 0 instead of re-raising SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def check_tls(settings: Settings) -> None:
    """Load the TLS files once before serving, so a wrong path or a key that does not match
    its certificate is a clear startup error (exit 2), not a failure on the first client."""
    if not settings.tls_cert or not settings.tls_key:
        return
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(settings.tls_cert, settings.tls_key)
        if settings.tls_client_ca:
            context.load_verify_locations(settings.tls_client_ca)
    except (OSError, ssl.SSLError) as exc:
        raise RuntimeError(f"TLS files unusable: {exc}") from None


def tls_options(settings: Settings) -> dict[str, Any]:
    """uvicorn's TLS settings: HTTPS with the certificate, mutual TLS with a client CA."""
    if not settings.tls_cert:
        return {}
    options: dict[str, Any] = {"ssl_certfile": settings.tls_cert, "ssl_keyfile": settings.tls_key}
    if settings.tls_client_ca:
        options.update(ssl_ca_certs=settings.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return options


async def run(settings: Settings) -> int:
    """Serve until SIGTERM/SIGINT, then drain. Returns the process exit code."""
    check_tls(settings)
    log.info("event loop: %s", type(asyncio.get_running_loop()).__module__.split(".")[0])
    engine = Engine(settings)
    app = create_app(settings, engine, on_ready=freeze_startup_objects)
    pending = PendingConnections(
        timeout=settings.header_timeout_seconds,
        limit=settings.max_pending_connections,
        on_pending=engine.metrics.http_pending_connections.set,
        on_closed=lambda reason: engine.metrics.http_connections_closed_total.labels(reason).inc(),
    )
    http = _HTTPServer(
        uvicorn.Config(
            app,
            host=settings.host,
            port=settings.http_port,
            log_level=settings.log_level,
            # Our own logging setup (logs.configure) and access lines (the engine's).
            log_config=None,
            access_log=False,
            # Connections still sending headers: a deadline and a budget of their own; the
            # requests at once (ADV_MAX_CONNECTIONS) are counted by create_app's RequestLimit.
            http=protocol_class(pending),
            h11_max_incomplete_event_size=settings.max_header_bytes,
            timeout_graceful_shutdown=math.ceil(settings.shutdown_timeout_seconds),
            lifespan="on",
            **tls_options(settings),
        )
    )
    # gRPC beside HTTP, on the same engine and event loop (grpc.aio).
    grpc_server = await start_grpc_server(engine, settings, settings.host, settings.grpc_port)
    grpc_stopping: asyncio.Future[None] | None = None

    async def close_listeners() -> None:
        # Readiness is false already; give load balancers time to stop sending first.
        await stop_serving(grpc_server)
        if settings.shutdown_delay_seconds:
            await asyncio.sleep(settings.shutdown_delay_seconds)
        http.should_exit = True
        # gRPC calls the server has received but not yet handed to a handler would be
        # cancelled by the stop: refuse new calls cleanly (UNAVAILABLE) for a moment first.
        engine.closing = True
        await asyncio.sleep(GRPC_REFUSE_BEFORE_STOP_SECONDS)
        await stop_grpc_server(grpc_server, settings.shutdown_timeout_seconds)

    def drain(sig: signal.Signals) -> None:
        nonlocal grpc_stopping
        if engine.draining:
            if sig == signal.SIGINT:
                http.should_exit = True
                http.force_exit = True
            return
        log.info(
            "%s: draining (readiness is now false; listeners close in %g s)",
            sig.name,
            settings.shutdown_delay_seconds,
        )
        engine.draining = True
        grpc_stopping = asyncio.ensure_future(close_listeners())
        # Requests still queued just before the shutdown deadline would be cut off with their
        # connections: refuse them (503 / UNAVAILABLE, retry elsewhere) while they can be told.
        loop.call_later(
            max(0.0, settings.shutdown_delay_seconds + settings.shutdown_timeout_seconds - 1.0),
            refuse_queued,
        )

    def refuse_queued() -> None:
        refused = engine.scheduler.refuse_waiting("the service is shutting down")
        if refused:
            log.warning("shutdown deadline near: refused %d queued requests", refused)

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, drain, sig)
    try:
        await http.serve()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await (grpc_stopping or stop_grpc_server(grpc_server, settings.shutdown_timeout_seconds))
        await engine.flush(timeout=settings.shutdown_timeout_seconds)
        await asyncio.to_thread(engine.close)
        log.info("drained: exiting")
    return 0 if http.started else 1


def freeze_startup_objects() -> None:
    """Put every object alive once the service is warm (modules, torch, numba and the compiled
    loops: some 330,000 objects the collector tracks) out of the cyclic collector's reach.
    Python's full collection walks every tracked object with the GIL held: under load it ran
    every 6-7 s and took 160-170 ms, a pause of every request and of the event loop. What is
    made later is collected as before; what is frozen lives as long as the process anyway."""
    gc.collect()
    gc.freeze()
    log.info("%d objects of the start-up kept out of the collector", gc.get_freeze_count())


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop ``ADV_EVENT_LOOP`` names (None: asyncio's own). On uvloop a training
    batch's 4.4 MB body arrived in about 6 ms where asyncio's selector loop, reading 256 KiB per
    wake-up through uvicorn's 64 KiB flow control, took 8-11; its Arrow round trip took 4-12 ms
    less, two servers alternating (docs/http.md, "Benchmark"). ``auto`` takes uvloop where it is
    installed, as uvicorn's own ``--loop auto`` does; ``uvloop`` without it is a RuntimeError."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise RuntimeError(
                "ADV_EVENT_LOOP=uvloop, but uvloop is not installed (pip install uvloop)"
            ) from None
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def serve(args: argparse.Namespace) -> int:
    """Entry point of ``advantage-service serve``."""
    try:
        settings = settings_from_args(args)
    except ValidationError as exc:  # a bad flag or ADV_* value: one line each, no traceback
        for error in exc.errors():
            name = ".".join(str(part) for part in error["loc"]) or "settings"
            message = str(error["msg"]).removeprefix("Value error, ")
            print(
                f"advantage-service: invalid setting ADV_{name.upper()} (--"
                f"{name.replace('_', '-')}): {message}",
                file=sys.stderr,
            )
        return 2
    logs.configure(settings.log_level, settings.log_format)
    try:
        with asyncio.Runner(loop_factory=loop_factory(settings.event_loop)) as runner:
            return runner.run(run(settings))
    except (RuntimeError, TokensFileError) as exc:  # --device cuda without CUDA, a bad file
        log.critical("cannot start: %s", exc)
        print(f"advantage-service: {exc}", file=sys.stderr)
        return 2
