"""Retries are loud: a call that fails and is retried logs a warning at its first failed attempt
and then every few seconds (what fails, how long so far, how long it will keep trying), and a
line when it recovers; each client counts its retries (what the trainers report as a metric).
On a scripted clock, and against a real service process restarted while a call waits."""

from __future__ import annotations

import itertools
import logging
import re
import time
from pathlib import Path

import numpy as np
import pytest
from advantage_client import GrpcClient, HttpClient, RetryPolicy
from advantage_client.retry import LOG_EVERY, Retryable, RetryStats
from restart_support import RestartingService

FAILED = re.compile(
    r"(?P<what>.+) failed \((?P<error>.*)\): (?P<tries>\d+) failed tries in "
    r"(?P<so_far>[\d.]+) s so far; retrying in [\d.]+ s, will keep trying for (?P<left>.+)"
)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "advantage_client.retry" and r.levelno >= logging.WARNING
    ]


def test_the_first_failure_is_logged_at_once_then_every_few_seconds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    failures = 12

    def sleep(seconds: float) -> None:
        now[0] += seconds

    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) <= failures:
            raise Retryable(ConnectionError("connection refused"))
        return "ok"

    stats = RetryStats()
    policy = RetryPolicy(backoff=1.0, max_backoff=2.0, retry_for=60.0)
    with caplog.at_level(logging.WARNING, logger="advantage_client.retry"):
        result = policy.run(
            flaky, sleep, what="POST http://svc/v1/advantages", stats=stats, clock=lambda: now[0]
        )
    assert result == "ok" and stats.retries == failures
    lines = warnings_of(caplog)
    failed = [m for line in lines if (m := FAILED.fullmatch(line))]
    # one at the first failure (0 s so far), then one per LOG_EVERY seconds of failing
    assert failed[0]["what"] == "POST http://svc/v1/advantages"
    assert failed[0]["error"] == "connection refused" and failed[0]["tries"] == "1"
    assert float(failed[0]["so_far"]) == 0.0 and failed[0]["left"] == "60 s more of waits"
    times = [float(m["so_far"]) for m in failed]
    assert all(later - earlier >= LOG_EVERY for earlier, later in itertools.pairwise(times))
    assert len(failed) == 1 + int(times[-1] // LOG_EVERY) >= 3
    assert lines[-1].endswith(f"succeeded after {failures} retries in {now[0]:.1f} s")

    # a policy with a count of retries says how many are left, and when it gives up
    def down() -> str:
        raise Retryable(ConnectionError("down"))

    caplog.clear()
    with (
        caplog.at_level(logging.WARNING, logger="advantage_client.retry"),
        pytest.raises(ConnectionError),
    ):
        RetryPolicy(retries=3, backoff=0.0).run(down, sleep)
    first = FAILED.fullmatch(warnings_of(caplog)[0])
    assert first is not None and first["left"] == "3 more retries"
    assert any("giving up after 3 retries" in r.getMessage() for r in caplog.records)


@pytest.mark.integration
@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_a_restart_mid_call_is_logged_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, transport: str
) -> None:
    service = RestartingService(tmp_path)
    service.start()
    client: HttpClient | GrpcClient = (
        HttpClient(service.url) if transport == "http" else GrpcClient(service.target)
    )
    try:
        client.list_estimators()  # (waits out the first start)
        before = client.retry_stats.retries
        service.stop()
        service.start_after(LOG_EVERY + 2.0)  # down long enough for a second warning
        mask = np.ones((4, 3), dtype=bool)
        caplog.clear()
        began = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="advantage_client.retry"):
            result = client.compute_padded(
                None, mask, np.array([1.0, 0.0, 1.0, 0.0]), np.array([0, 0, 1, 1])
            )
        took = time.monotonic() - began
        assert np.allclose(result.advantages[:, 0], [0.7071, -0.7071] * 2, atol=1e-3)
    finally:
        client.close()
        service.close()
    retries = client.retry_stats.retries - before
    lines = warnings_of(caplog)
    failed = [m for line in lines if (m := FAILED.fullmatch(line))]
    name = "POST " + service.url if transport == "http" else "gRPC Compute to " + service.target
    assert failed and all(m["what"].startswith(name) for m in failed)
    assert failed[0]["tries"] == "1" and float(failed[0]["so_far"]) < 1.0
    assert failed[0]["left"] == "60 s more of waits"
    # (one more line per LOG_EVERY seconds of failing is the scripted test's to pin: here an
    # attempt in flight, e.g. a gRPC channel reconnecting, may span the moment a line is due)
    assert 1 <= len(failed) <= 1 + took / LOG_EVERY
    assert retries >= int(failed[-1]["tries"]) >= len(failed)
    assert lines[-1].startswith(f"{failed[0]['what']} succeeded after {retries} retries")
