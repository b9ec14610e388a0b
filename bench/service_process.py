"""``advantage-service serve`` started for a benchmark: HTTP and gRPC on free ports, the process's
``ADV_`` environment only what the benchmark sets (a developer's own settings would skew the
figures), ready once it answers ``/readyz``."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

READY_SECONDS = 120


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServiceProcess:
    """The service on free ports. ``settings``: more of its settings by name (``redis_url``,
    ``log_format``, ...: ``ADV_<NAME>``); ``log``: the file its output goes to (None: this
    process's own stdout and stderr)."""

    def __init__(
        self,
        *,
        device: str = "cpu",
        settings: Mapping[str, Any] | None = None,
        log: Path | None = None,
        log_level: str = "warning",
    ) -> None:
        self.http_port, self.grpc_port = free_port(), free_port()
        self.log = log
        env = {k: v for k, v in os.environ.items() if not k.startswith("ADV_")}
        env.update(ADV_DEVICE=device, ADV_HOST="127.0.0.1", ADV_LOG_LEVEL=log_level)
        env.update({f"ADV_{k.upper()}": str(v) for k, v in (settings or {}).items()})
        ports = ["--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port)]
        command = [sys.executable, "-m", "advantage_service", "serve", *ports]
        if log is None:
            self.proc = subprocess.Popen(command, env=env)
        else:
            with log.open("wb") as sink:
                self.proc = subprocess.Popen(
                    command, stdout=sink, stderr=subprocess.STDOUT, env=env
                )
        self._wait_ready()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_SECONDS
        while True:
            if self.proc.poll() is not None:
                said = f": {self.log.read_text()}" if self.log is not None else " (output above)"
                raise RuntimeError(f"the service exited with {self.proc.returncode}{said}")
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.proc.kill()
                self.proc.wait()
                raise RuntimeError(f"the service did not become ready in {READY_SECONDS} s")
            time.sleep(0.1)

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM (the service drains), then a kill past ``timeout``; its exit code."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
