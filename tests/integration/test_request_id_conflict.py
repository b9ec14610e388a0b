"""A ``request_id`` reused for a different request is refused, against a real service process on
the in-memory store and on a real redis-server.

The same body sent twice is a retry: answered as before (200, ``recorded: true``) and counted
once. A different body under an id already counted in the namespace is refused before it is
answered: HTTP 409 ``conflict`` naming ``request_id``, gRPC ALREADY_EXISTS, and it is not
counted. An honest request after it is counted as usual. (Before, the different body was
answered ``recorded: true`` and silently not counted.)
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from advantage_client import AdvantageError, GrpcClient
from http_support import Server
from process_support import launch_service
from request_support import alternating_groups

pytestmark = pytest.mark.integration

GROUPS, ROLLOUTS, TOKENS = 2, 4, 16


def request(seed: int, namespace: str, request_id: str) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "namespace": namespace,
        "request_id": request_id,
        "estimator": {"outcome": "grpo", "ktae": {"history": "prompt"}},
        "groups": alternating_groups(
            rng, (f"p{g}" for g in range(GROUPS)), ROLLOUTS, TOKENS, vocab=500
        ),
    }


class Service(Server):
    grpc_target: str


@pytest.fixture(params=["memory", "redis"])
def service(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Service]:
    settings: dict[str, Any] = {}
    if request.param == "redis":
        settings["redis_url"] = request.getfixturevalue("redis_server").url
    proc, http_port, grpc_port, log = launch_service(tmp_path, settings)
    server = Service(proc, http_port, log)
    server.grpc_target = f"127.0.0.1:{grpc_port}"
    server.ready_or_killed()
    yield server
    server.stop()


def counted(server: Server, namespace: str) -> int:
    """The requests counted in ``namespace``, once every accepted write is done."""
    deadline = time.monotonic() + 30
    while server.gauge("advantage_stats_write_backlog"):
        assert time.monotonic() < deadline, "the writes never settled"
        time.sleep(0.05)
    response = server.client.get("/v1/stats/tokens", params={"namespace": namespace, "limit": 1})
    assert response.status_code == 200, response.text
    return int(response.json()["rollouts_counted"]) // (GROUPS * ROLLOUTS)


def outcomes(server: Server) -> dict[str, float]:
    return {
        dict(labels)["outcome"]: value
        for (name, labels), value in server.metrics().items()
        if name == "advantage_stats_requests_total" and value
    }


def post(server: Server, body: dict[str, Any]) -> httpx.Response:
    return server.client.post("/v1/advantages", json=body)


def test_a_request_id_reused_for_another_body_is_refused_and_not_counted(
    service: Service,
) -> None:
    ns = "conflicts"
    first = request(1, ns, "step-1")
    answer = post(service, first)
    assert answer.status_code == 200 and answer.json()["summary"]["recorded"] is True
    assert counted(service, ns) == 1

    # The same request again (a retry whose answer was lost): answered as before, not counted.
    again = post(service, first)
    assert again.status_code == 200, again.text
    assert again.json()["summary"]["recorded"] is True
    assert counted(service, ns) == 1

    # Another request under the same id: refused, over HTTP and over gRPC; not counted.
    other = request(2, ns, "step-1")
    refused = post(service, other)
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert (error["code"], error["field"]) == ("conflict", "request_id")
    assert "step-1" in error["message"]
    with pytest.raises(AdvantageError) as info:
        GrpcClient(service.grpc_target).compute(other)
    assert info.value.grpc_code == "ALREADY_EXISTS"
    assert (info.value.code, info.value.field) == ("conflict", "request_id")
    # The same id in another namespace is another request.
    assert post(service, request(2, "elsewhere", "step-1")).status_code == 200
    assert counted(service, ns) == 1

    # An honest request after it is counted.
    honest = post(service, request(3, ns, "step-2"))
    assert honest.status_code == 200 and honest.json()["summary"]["recorded"] is True
    assert counted(service, ns) == 2
    assert outcomes(service) == {"counted": 3.0, "duplicate": 1.0}
