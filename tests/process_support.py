"""What every test that starts real processes needs: a free loopback port, polling, and a
service process (``advantage-service serve``) on free ports."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

POLL_SECONDS = 0.05


def free_port() -> int:
    """A port nothing listens on right now (the OS picks it for a socket bound to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def poll(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    """Call ``condition`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(POLL_SECONDS)


# ---- a service process ----------------------------------------------------------------------

STARTUP_SECONDS = 120.0


def service_env(settings: Mapping[str, Any]) -> dict[str, str]:
    """This environment without ADV_* variables, on the CPU and loopback, quiet, then
    ``ADV_<NAME>`` for each of ``settings``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADV_")}
    env.update(ADV_DEVICE="cpu", ADV_HOST="127.0.0.1", ADV_LOG_LEVEL="warning")
    env.update({f"ADV_{k.upper()}": str(v) for k, v in settings.items()})
    return env


def launch_service(
    directory: Path, settings: Mapping[str, Any]
) -> tuple[subprocess.Popen[bytes], int, int, Path]:
    """Start ``advantage-service serve`` on free ports without waiting for it:
    (process, HTTP port, gRPC port, log file)."""
    http_port, grpc_port = free_port(), free_port()
    ports = ["--http-port", str(http_port), "--grpc-port", str(grpc_port)]
    log = directory / f"service-{http_port}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "advantage_service", "serve", *ports],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=service_env(settings),
        )
    return proc, http_port, grpc_port, log


class ServiceProcess:
    """One running service process: its HTTP client, log, metrics, readiness and SIGTERM.

    Subclasses add what their tests need (a gRPC target, TLS, access lines) and may require
    more than ``/readyz`` before the service counts as ready (:meth:`also_ready`).
    """

    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Path, http: httpx.Client):
        self.proc = proc
        self.url = url
        self.log = log
        self.http = http

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def also_ready(self) -> bool:
        return True

    def wait_ready(self) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"service exited with {self.proc.returncode} before ready:\n{self.output()}"
                )
            try:
                if self.http.get("/readyz", timeout=2.0).status_code != 200:
                    return False
            except httpx.TransportError:
                return False
            return self.also_ready()

        poll(ready, STARTUP_SECONDS, "the service to be ready")

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of /metrics: (name, sorted labels) -> value."""
        text = self.http.get("/metrics").text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def gauge(self, name: str) -> float:
        return self.metrics()[(name, ())]

    def stop(self, timeout: float = 30.0) -> int:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return int(self.proc.returncode)

    def ready_or_killed(self) -> None:
        """:meth:`wait_ready`, killing the process if it never gets there."""
        try:
            self.wait_ready()
        except BaseException:
            self.proc.kill()
            self.proc.wait(10)
            raise
