"""A real service process that a test stops and starts again on the same ports (a rolling
restart as a client sees it: connections refused for a while, then answered)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

from process_support import free_port, service_env


class RestartingService:
    """``advantage-service serve`` on fixed free ports: :meth:`stop` it, then
    :meth:`start_after` a delay on a timer, while a client's call is waiting."""

    def __init__(self, directory: Path) -> None:
        self.http_port, self.grpc_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.target = f"127.0.0.1:{self.grpc_port}"
        self.log = directory / "service.log"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.timers: list[threading.Timer] = []

    def start(self) -> None:
        ports = ["--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port)]
        with self.log.open("ab") as out:
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "advantage_service", "serve", *ports],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=service_env({}),
                )
            )

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)

    def start_after(self, delay: float) -> None:
        timer = threading.Timer(delay, self.start)
        self.timers.append(timer)
        timer.start()

    def close(self) -> None:
        for timer in self.timers:
            timer.join()
        self.stop()
