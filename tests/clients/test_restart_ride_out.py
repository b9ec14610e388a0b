"""A client rides out a restart of the service: by default it keeps retrying an unreachable
service for a minute of waits (a rolling restart replaces a pod in about that), not a fraction
of a second; ``retry_for`` sets how long, ``retries`` a count as before."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from advantage_client import AdvantageError, HttpClient, RetryPolicy
from advantage_client.retry import Retryable
from process_support import free_port, service_env


def test_the_default_policy_waits_at_least_a_minute_before_giving_up() -> None:
    slept: list[float] = []

    def down() -> None:
        raise Retryable(RuntimeError("connection refused"))

    with pytest.raises(RuntimeError, match="connection refused"):
        RetryPolicy().run(down, sleep=slept.append)
    assert 60.0 <= sum(slept) <= 60.0 + 10.0  # (the last wait is at most max_backoff)
    assert max(slept) <= 10.0

    slept.clear()
    with pytest.raises(RuntimeError):
        RetryPolicy(retry_for=5.0).run(down, sleep=slept.append)
    assert 5.0 <= sum(slept) < 15.0
    slept.clear()
    with pytest.raises(RuntimeError):
        RetryPolicy(retries=2).run(down, sleep=slept.append)
    assert len(slept) == 2


def start(port: int, grpc_port: int, log: Path) -> subprocess.Popen[bytes]:
    ports = ["--http-port", str(port), "--grpc-port", str(grpc_port)]
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "advantage_service", "serve", *ports],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=service_env({}),
        )


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_a_call_during_a_restart_waits_for_the_new_process(tmp_path: Path) -> None:
    port, grpc_port = free_port(), free_port()
    log = tmp_path / "service.log"
    first = start(port, grpc_port, log)
    url = f"http://127.0.0.1:{port}"
    client = HttpClient(url)  # the defaults
    second: list[subprocess.Popen[bytes]] = []
    timer: threading.Timer | None = None
    try:
        client.list_estimators()  # (waits out the first start too)
        first.send_signal(signal.SIGTERM)
        first.wait(30)
        with pytest.raises(AdvantageError):  # down: a client that does not wait fails
            HttpClient(url, retries=0).list_estimators()
        # the new process starts 3 s later and takes a few seconds more to listen
        timer = threading.Timer(3.0, lambda: second.append(start(port, grpc_port, log)))
        timer.start()
        began = time.monotonic()
        mask = np.ones((4, 3), dtype=bool)
        result = client.compute_padded(
            None, mask, np.array([1.0, 0.0, 1.0, 0.0]), np.array([0, 0, 1, 1])
        )
        assert time.monotonic() - began >= 3.0
        assert np.allclose(result.advantages[:, 0], [0.7071, -0.7071] * 2, atol=1e-3)
    finally:
        client.close()
        if timer is not None:
            timer.join()
        for proc in [first, *second]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
