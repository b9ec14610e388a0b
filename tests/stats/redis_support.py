"""A real ``redis-server`` for tests: a free port, a temporary directory, no persistence.

It can be stopped, killed and restarted on the same port, for outage tests. Never the shared
Redis on 6379.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from process_support import free_port

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One redis-server process on a fixed port, restartable."""

    def __init__(
        self, directory: Path, port: int | None = None, extra_args: Sequence[str] = ()
    ) -> None:
        self.directory = directory
        self.port = port or free_port()
        self.extra_args = list(extra_args)
        self.process: subprocess.Popen[bytes] | None = None
        self.log = directory / f"redis-{self.port}.log"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        assert self.process is None, "already running"
        self.directory.mkdir(parents=True, exist_ok=True)
        # fmt: off
        args = [
            REDIS_SERVER,
            "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", str(self.directory),
            "--daemonize", "no", "--logfile", str(self.log),
            *self.extra_args,
        ]
        # fmt: on
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while not _answers_ping(self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server did not start on {self.port}; see {self.log}")
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL: the abrupt outage (no shutdown, connections reset)."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
            self.process = None

    def restart(self) -> None:
        """Start again on the same port (the data is gone: no persistence)."""
        self.kill()
        self.start()
