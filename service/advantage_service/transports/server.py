"""``advantage-service serve``: HTTP (uvicorn) and gRPC around one engine, with a graceful drain.

On SIGTERM (or Ctrl-C): readiness turns false, the listening sockets close, requests in flight
finish (up to ADV_SHUTDOWN_TIMEOUT_SECONDS), then the process exits 0. A second Ctrl-C forces.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import signal
import sys
from collections.abc import Generator

import uvicorn

from ..config import Settings
from ..engine import Engine
from .grpc import start_grpc_server, stop_grpc_server
from .http import create_app

log = logging.getLogger("advantage_service.server")

# CLI flag (argparse dest) -> settings field; a flag given overrides the ADV_* variable.
FLAG_SETTINGS = {
    "host": "host",
    "http_port": "http_port",
    "grpc_port": "grpc_port",
    "device": "device",
    "redis_url": "redis_url",
    "log_level": "log_level",
}


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Settings from ADV_* variables, with the CLI flags that were given on top."""
    given = {
        field: getattr(args, flag)
        for flag, field in FLAG_SETTINGS.items()
        if getattr(args, flag, None) is not None
    }
    return Settings(**given)


class _HTTPServer(uvicorn.Server):
    """uvicorn without its own signal handling: :func:`run` owns the signals so one SIGTERM
    drains every transport, and a drained process exits 0 instead of re-raising SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


async def run(settings: Settings) -> int:
    """Serve until SIGTERM/SIGINT, then drain. Returns the process exit code."""
    engine = Engine(settings)
    app = create_app(settings, engine)
    http = _HTTPServer(
        uvicorn.Config(
            app,
            host=settings.host,
            port=settings.http_port,
            log_level=settings.log_level,
            timeout_graceful_shutdown=math.ceil(settings.shutdown_timeout_seconds),
            lifespan="on",
        )
    )
    # gRPC beside HTTP, on the same engine and event loop (grpc.aio).
    grpc_server = await start_grpc_server(engine, settings, settings.host, settings.grpc_port)
    grpc_stopping: asyncio.Future[None] | None = None

    def drain(sig: signal.Signals) -> None:
        nonlocal grpc_stopping
        if http.should_exit:
            if sig == signal.SIGINT:
                http.force_exit = True
            return
        log.info("%s: draining (readiness is now false)", sig.name)
        engine.draining = True
        http.should_exit = True
        grpc_stopping = asyncio.ensure_future(
            stop_grpc_server(grpc_server, settings.shutdown_timeout_seconds)
        )

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
    return 0 if http.started else 1


def serve(args: argparse.Namespace) -> int:
    """Entry point of ``advantage-service serve``."""
    try:
        settings = settings_from_args(args)
    except ValueError as exc:  # pydantic's ValidationError: a bad flag or ADV_* value
        print(f"advantage-service: invalid settings: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return asyncio.run(run(settings))
    except RuntimeError as exc:  # e.g. --device cuda without a CUDA device
        print(f"advantage-service: {exc}", file=sys.stderr)
        return 2
