"""What every test that starts real processes needs: a free loopback port, and polling."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

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
