"""One client's malformed text never costs another client its statistics: a real service with
two tenants (bearer tokens) on a real Redis and on a real 3-master Redis Cluster; team-a's
honest clients and team-b's requests whose ``request_id`` holds a lone surrogate (``\\ud800``,
which JSON accepts) share one namespace.

Before: the surrogate made the Redis key encoding fail for the whole write round, so every honest
request folded into that round was lost while answering ``recorded: true`` (1,174 of 1,352 on
one Redis, 1,065 of 1,074 on a cluster), and the poisoned request was answered 500. Now it is a
422 naming ``request_id`` before it is computed, and every honest answer is counted.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from http_support import Server
from stats.cluster_load import stats_outcomes as outcomes
from stats.redis_cluster_support import LocalCluster
from stats.redis_support import RedisServer
from test_stats_recorded import GROUPS, ROLLOUTS, Tally, request

pytestmark = pytest.mark.integration

NAMESPACE = "shared"
TOKENS = {
    "token-a": {"namespaces": [NAMESPACE], "name": "team-a"},
    "token-b": {"namespaces": [NAMESPACE], "name": "team-b"},
}
SECONDS = 3.0


@pytest.fixture(params=["redis", "cluster"])
def redis_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "redis":
        server = RedisServer(tmp_path / "redis")
        server.start()
        yield server.url
        server.stop()
    else:
        cluster = LocalCluster(tmp_path / "cluster", masters=3)
        cluster.start()
        yield cluster.url
        cluster.stop()


def honest(url: str, seed: int, stop: float, tally: Tally) -> None:
    rng = np.random.default_rng(seed)
    headers = {"authorization": "Bearer token-a"}
    with httpx.Client(base_url=url, timeout=60, headers=headers) as http:
        while time.monotonic() < stop:
            body = {**request(rng, NAMESPACE), "request_id": uuid.uuid4().hex}
            response = http.post("/v1/advantages", json=body)
            with tally.lock:
                if response.status_code == 200:
                    value = response.json()["summary"].get("recorded", "absent")
                    tally.recorded[value] = tally.recorded.get(value, 0) + 1
                elif response.status_code == 503:
                    tally.overloaded += 1
                else:
                    tally.other.append(response.text)


def poisoned(url: str, stop: float, answers: list[tuple[int, dict[str, Any]]]) -> None:
    rng = np.random.default_rng(99)
    headers = {"authorization": "Bearer token-b", "content-type": "application/json"}
    with httpx.Client(base_url=url, timeout=60, headers=headers) as http:
        n = 0
        while time.monotonic() < stop:
            text = json.dumps({**request(rng, NAMESPACE), "request_id": f"MARK-{n}"})
            body = text.replace('"MARK-', '"\\ud800-').encode()  # a lone surrogate, escaped
            response = http.post("/v1/advantages", content=body)
            answers.append((response.status_code, response.json()))
            n += 1


def counted(server: Server) -> int:
    response = server.client.get(
        "/v1/stats/tokens",
        params={"namespace": NAMESPACE, "limit": 1},
        headers={"authorization": "Bearer token-a"},
    )
    assert response.status_code == 200, response.text
    return int(response.json()["rollouts_counted"]) // (GROUPS * ROLLOUTS)


def test_a_poisoned_request_id_costs_no_honest_request_its_statistics(
    server_factory: Callable[..., Server], tmp_path: Path, redis_url: str
) -> None:
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"tokens": TOKENS}))
    server = server_factory(redis_url=redis_url, auth_tokens_file=str(tokens))
    tally, answers = Tally(), []
    stop = time.monotonic() + SECONDS
    threads = [
        threading.Thread(target=honest, args=(server.url, seed, stop, tally)) for seed in range(4)
    ]
    threads.append(threading.Thread(target=poisoned, args=(server.url, stop, answers)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert not tally.other, tally.other[:3]
    answered = tally.recorded.get(True, 0)
    assert answered >= 4 and set(tally.recorded) == {True}, tally.recorded
    deadline = time.monotonic() + 60
    while counted(server) != answered and time.monotonic() < deadline:
        time.sleep(0.2)
    assert counted(server) == answered, (counted(server), answered, outcomes(server))
    assert outcomes(server) == {"counted": float(answered)}
    assert answers and all(status == 422 for status, _ in answers), answers[:3]
    assert {(a["error"]["code"], a["error"]["field"]) for _, a in answers} == {
        ("invalid_text", "request_id")
    }
