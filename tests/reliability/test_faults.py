"""Faults under load, short versions of ``bench/bench_load.py``'s scenarios (a few seconds each,
four clients: HTTP Arrow, gRPC unary and gRPC streaming):

- Redis killed and restarted mid-load: no request fails; history is ``unavailable`` meanwhile
  and ``applied`` again after;
- SIGTERM mid-load: every request sent before the signal is answered 200, later ones are
  served or refused cleanly, and the process exits 0.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from process_support import poll
from stats.redis_support import RedisServer
from support import Service

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from loadgen import Load, LoadConfig, Shape, summarize

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SHAPE = Shape(groups=4, rollouts=8, tokens=128)
# Room for every client at once (a stream computes its groups side by side): a 429 would be a
# failure here, since the point is faults, not saturation.
MAX_INFLIGHT = 8
HISTORY = {"outcome": "grpo", "ktae": {"history": "prompt"}}


def load_on(service: Service, **config: object) -> Load:
    return Load(
        LoadConfig(
            http_url=service.url,
            grpc_target=service.target,
            clients=4,
            shape=SHAPE,
            distinct_requests=4,
            timeout=60,
            **config,  # type: ignore[arg-type]
        )
    )


def answered(load: Load, n: int) -> Callable[[], bool]:
    return lambda: sum(r.outcome == "ok" for r in load.results) >= n


def test_redis_killed_and_restarted_under_load_fails_no_request(
    service_factory: Callable[..., Service], redis_server: RedisServer
) -> None:
    service = service_factory(redis_url=redis_server.url, max_inflight=MAX_INFLIGHT)
    load = load_on(service, estimator=HISTORY)
    start = time.monotonic()
    load.start()
    try:
        poll(answered(load, 8), 60, "load before the outage")
        redis_server.kill()
        killed = len(load.results)
        poll(
            lambda: any("unavailable" in r.history for r in load.results[killed:]),
            60,
            "history marked unavailable",
        )
        assert service.http.get("/readyz").status_code == 200
        time.sleep(1.0)
        redis_server.start()
        restarted = len(load.results)
        poll(
            lambda: any(
                r.history and all(h == "applied" for h in r.history)
                for r in load.results[restarted:]
            ),
            60,
            "history applied again",
        )
    finally:
        load.stop()
    summary = summarize(load.results, start, time.monotonic())
    assert summary["outcomes"] == {"ok": len(load.results)}, summary
    assert {"applied", "unavailable"} <= set(summary["history"])
    for kind in ("http", "grpc", "grpc_stream"):
        assert summary[kind]["answered"] > 0, summary
    assert service.gauge("advantage_inflight_requests") == 0


def test_sigterm_under_load_answers_every_request_sent_before_it_and_exits_zero(
    service_factory: Callable[..., Service],
) -> None:
    service = service_factory(
        max_inflight=MAX_INFLIGHT,
        shutdown_delay_seconds=0.5,
        shutdown_timeout_seconds=30,
        log_level="info",
    )
    load = load_on(service, estimator="ktae")
    start = time.monotonic()
    load.start()
    try:
        poll(answered(load, 12), 60, "load before the signal")
        load.mark_shutdown()
        service.proc.send_signal(signal.SIGTERM)
        assert service.proc.wait(60) == 0
        time.sleep(0.5)  # clients keep trying against the closed ports
    finally:
        load.stop()
    summary = summarize(load.results, start, time.monotonic(), load.shutdown_at)
    assert summary["before_shutdown_not_ok"] == 0, summary
    assert "failed" not in summary["outcomes"], summary
    assert summary["outcomes"].get("refused", 0) > 0, summary
    output = service.output()
    assert output.index("SIGTERM: draining") < output.index("drained: exiting")
