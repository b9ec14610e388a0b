"""HTTP and gRPC on one engine in one event loop, the way ``advantage-service serve`` runs them.

    python tests/grpc/launcher.py --http-port P --grpc-port Q   (settings from ADV_* variables)

The integration tests use it while ``serve`` does not start gRPC itself. SIGTERM drains both:
readiness and gRPC health turn false, then in-flight calls get the shutdown grace period.
``ADV_STREAM_MAX_PENDING_GROUPS`` and ``ADV_STREAM_MAX_PENDING_TOKENS`` set the stream limits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Generator

import uvicorn
from advantage_service.config import Settings
from advantage_service.engine import Engine
from advantage_service.transports.grpc import StreamLimits, start_grpc_server, stop_grpc_server
from advantage_service.transports.http import create_app


class _HTTPServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def stream_limits(settings: Settings) -> StreamLimits:
    limits = StreamLimits.from_settings(settings)
    groups = os.environ.get("ADV_STREAM_MAX_PENDING_GROUPS")
    tokens = os.environ.get("ADV_STREAM_MAX_PENDING_TOKENS")
    return StreamLimits(
        max_pending_groups=int(groups) if groups else limits.max_pending_groups,
        max_pending_tokens=int(tokens) if tokens else limits.max_pending_tokens,
        max_outstanding=limits.max_outstanding,
    )


async def run(settings: Settings) -> None:
    engine = Engine(settings)
    app = create_app(settings, engine)
    http = _HTTPServer(
        uvicorn.Config(
            app,
            host=settings.host,
            port=settings.http_port,
            log_level=settings.log_level,
            lifespan="on",
        )
    )
    grpc_server = await start_grpc_server(
        engine, settings, settings.host, settings.grpc_port, limits=stream_limits(settings)
    )
    loop = asyncio.get_running_loop()

    def drain() -> None:
        engine.draining = True
        http.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, drain)
    try:
        await http.serve()
    finally:
        await stop_grpc_server(grpc_server, settings.shutdown_timeout_seconds)
        await asyncio.to_thread(engine.close)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--grpc-port", type=int, required=True)
    args = parser.parse_args()
    settings = Settings(http_port=args.http_port, grpc_port=args.grpc_port)
    logging.basicConfig(level=settings.log_level.upper())
    asyncio.run(run(settings))


if __name__ == "__main__":
    main()
