"""The per-request compute deadline (ADV_REQUEST_TIMEOUT_SECONDS): the client is answered on
time (HTTP 504, gRPC DEADLINE_EXCEEDED), while the worker stays busy until its thread really
finishes, so the service never computes more than ADV_MAX_INFLIGHT at once: the next request
waits in the queue for it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest
from advantage_client.grpc_client import compute_request_message
from advantage_client.http_client import arrow_request_body
from advantage_contract.grpc_gen import advantage_pb2_grpc as pb_grpc
from advantage_service.config import Settings
from advantage_service.errors import RequestError
from advantage_service.observability.metrics import Metrics
from advantage_service.serving.engine import Engine
from advantage_service.wire.request import parse_request
from holding import Hold, held_request
from process_support import poll
from support import Service

ARROW = "application/vnd.apache.arrow.stream"


def big_request(tokens: int = 2_000_000, groups: int = 16) -> dict[str, Any]:
    """A KTAE request heavy enough to outlast a few milliseconds on any CPU."""
    rng = np.random.default_rng(0)
    per_rollout = tokens // (groups * 8)
    return {
        "estimator": "ktae",
        "groups": [
            {
                "id": f"p{g}",
                "rollouts": [
                    {
                        "tokens": rng.integers(0, 50_000, per_rollout).astype(np.int32),
                        "reward": float(r % 2),
                    }
                    for r in range(8)
                ],
            }
            for g in range(groups)
        ],
    }


# ---- the engine alone ---------------------------------------------------------------------------

SMALL = {"groups": [{"id": "p", "rollouts": [{"tokens": [1], "reward": 1.0}]}]}


def test_engine_answers_at_the_deadline_and_keeps_the_worker_busy_until_it_ends() -> None:
    engine = Engine(
        Settings(device="cpu", max_inflight=1, request_timeout_seconds=0.5),
        Metrics(process=False),
    )

    async def scenario(hold: Hold) -> None:
        started = time.perf_counter()
        with pytest.raises(RequestError) as late:
            await engine.compute(parse_request(held_request()), "test")
        waited = time.perf_counter() - started
        assert late.value.status == 504 and late.value.code == "deadline_exceeded"
        assert waited < 2.0
        # The worker still runs: the next request waits in the queue instead of computing.
        queued = asyncio.ensure_future(
            engine.compute(parse_request(held_request("next", block=False)), "test")
        )
        await asyncio.sleep(0.2)
        assert not queued.done() and engine.scheduler.depth == 1
        assert hold.computed == [["held"]]
        hold.release.set()
        computed = await asyncio.wait_for(queued, 10)
        assert computed.summary["rollouts"] == 2 and hold.computed[-1] == ["next"]
        assert engine.inflight == 0
        assert engine.metrics.registry.get_sample_value("advantage_inflight_requests") == 0

    try:
        with Hold() as hold:
            asyncio.run(scenario(hold))
    finally:
        engine.close()


# ---- a real service -----------------------------------------------------------------------------


@pytest.mark.integration
def test_service_answers_504_and_deadline_exceeded_then_returns_to_idle(
    service_factory: Callable[..., Service],
) -> None:
    service = service_factory(request_timeout_seconds=0.005, body_timeout_seconds=60)
    request = big_request()

    started = time.perf_counter()
    answer = service.http.post(
        "/v1/advantages", content=arrow_request_body(request), headers={"content-type": ARROW}
    )
    assert answer.status_code == 504, answer.text[:300]
    assert answer.json()["error"]["code"] == "deadline_exceeded"

    with grpc.insecure_channel(service.target) as channel:
        stub = pb_grpc.AdvantageServiceStub(channel)
        with pytest.raises(grpc.RpcError) as late:
            stub.Compute(compute_request_message(request), timeout=60)
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "ADV_REQUEST_TIMEOUT_SECONDS" in (late.value.details() or "")
    assert time.perf_counter() - started < 30

    poll(lambda: service.gauge("advantage_inflight_requests") == 0, 60, "the workers to finish")
    metrics = service.metrics()
    assert (
        metrics[
            (
                "advantage_request_errors_total",
                (("error", "deadline_exceeded"), ("transport", "grpc")),
            )
        ]
        == 1
    )
    assert service.http.get("/readyz").status_code == 200
