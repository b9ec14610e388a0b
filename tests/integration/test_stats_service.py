"""The stats store behind real service processes and a real redis-server: KTAE history across
visits and replicas, vocabulary statistics, idempotency, and a Redis outage and recovery.

History with ``history_decay = 1`` makes the second visit's merged counts exactly twice the
group's own, which are the counts of the same group with every rollout duplicated. So the
second visit's KTAE scores must equal the oracle's no-history scores on the duplicated group:
an exact, independent check of the history path end to end.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from http_support import Server
from oracle import reference_compute
from process_support import poll
from stats.redis_support import RedisServer

pytestmark = pytest.mark.integration


def visit(request_id: str, *, history: bool = True, decay: float = 1.0) -> dict[str, Any]:
    """Prompt "p-1" with two correct and three wrong rollouts over a small vocabulary."""
    rng = np.random.default_rng(5)
    rewards = [1.0, 1.0, 0.0, 0.0, 0.0]
    rollouts = [
        {"tokens": [int(t) for t in rng.integers(0, 9, size=int(n))], "reward": r}
        for n, r in zip(rng.integers(3, 9, size=5), rewards, strict=True)
    ]
    ktae: dict[str, Any] = {"history": "prompt", "history_decay": decay} if history else {}
    return {
        "request_id": request_id,
        "namespace": "team-a",
        "estimator": {"outcome": "grpo", "ktae": ktae},
        "return": ["ktae_score"],
        "groups": [{"id": "p-1", "rollouts": rollouts}],
    }


def expected_scores(request: dict[str, Any], copies: int) -> list[np.ndarray]:
    """The oracle's KTAE scores of the group with every rollout repeated ``copies`` times."""
    plain = copy.deepcopy(request)
    plain["estimator"] = {"outcome": "grpo", "ktae": {}}
    rollouts = plain["groups"][0]["rollouts"]
    plain["groups"][0]["rollouts"] = rollouts * copies
    ref = reference_compute(plain)
    return [r["ktae_score"] for r in ref["groups"][0]["rollouts"][: len(rollouts)]]


def scores(response: dict[str, Any]) -> list[np.ndarray]:
    return [np.asarray(r["ktae_score"]) for r in response["groups"][0]["rollouts"]]


def post(server: Server, request: dict[str, Any]) -> dict[str, Any]:
    response = server.client.post("/v1/advantages", json=request)
    assert response.status_code == 200, response.text
    return response.json()


def counted(server: Server, namespace: str = "team-a") -> int:
    response = server.client.get("/v1/stats/tokens", params={"namespace": namespace})
    return int(response.json()["rollouts_counted"]) if response.status_code == 200 else -1


def wait_counted(server: Server, n: int) -> None:
    poll(lambda: counted(server) >= n, 30, f"{n} rollouts counted")


def assert_scores(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


def test_history_on_later_visits_equals_ktae_on_the_merged_counts(
    server_factory: Callable[..., Server], redis_server: RedisServer
) -> None:
    server = server_factory(redis_url=redis_server.url)
    first = post(server, visit("v1"))
    assert first["summary"]["history"] == "empty"  # read, nothing stored yet
    assert_scores(scores(first), expected_scores(visit("v1"), 1))  # no history yet
    wait_counted(server, 5)
    second = post(server, visit("v2"))
    assert_scores(scores(second), expected_scores(visit("v2"), 2))
    assert not all(np.allclose(a, b) for a, b in zip(scores(first), scores(second), strict=True))
    wait_counted(server, 10)
    third = post(server, visit("v3"))
    assert_scores(scores(third), expected_scores(visit("v3"), 3))


def test_a_repeated_request_id_is_computed_but_not_counted_again(
    server_factory: Callable[..., Server], redis_server: RedisServer
) -> None:
    server = server_factory(redis_url=redis_server.url)
    once = post(server, visit("same-id"))
    wait_counted(server, 5)
    again = post(server, visit("same-id"))
    # Computed again: with history of the first visit (the id was counted once, history too).
    assert_scores(scores(again), expected_scores(visit("same-id"), 2))
    assert once["request_id"] == again["request_id"] == "same-id"
    post(server, visit("other-id", history=False))
    wait_counted(server, 10)
    stats = server.client.get("/v1/stats/tokens", params={"namespace": "team-a"}).json()
    assert stats["rollouts_counted"] == 10
    # And the repeated id did not feed history: the next visit sees exactly two visits' counts.
    third = post(server, visit("third"))
    assert_scores(scores(third), expected_scores(visit("third"), 2))


def test_replicas_on_one_redis_share_history_and_statistics(
    server_factory: Callable[..., Server], redis_server: RedisServer
) -> None:
    a = server_factory(redis_url=redis_server.url)
    b = server_factory(redis_url=redis_server.url)
    post(a, visit("on-a"))
    wait_counted(b, 5)  # written by A, read through B
    second = post(b, visit("on-b"))
    assert_scores(scores(second), expected_scores(visit("on-b"), 2))
    wait_counted(a, 10)
    tokens_a = a.client.get("/v1/stats/tokens", params={"namespace": "team-a"}).json()
    tokens_b = b.client.get("/v1/stats/tokens", params={"namespace": "team-a"}).json()
    assert tokens_a == tokens_b
    occurrences = sum(t["occurrences"] for t in tokens_a["tokens"])
    own = sum(len(r["tokens"]) for r in visit("x")["groups"][0]["rollouts"])
    assert occurrences == 2 * own


def test_redis_outage_degrades_history_without_failing_requests_and_recovers(
    server_factory: Callable[..., Server], redis_server: RedisServer
) -> None:
    server = server_factory(redis_url=redis_server.url)
    assert post(server, visit("before"))["summary"]["history"] == "empty"
    wait_counted(server, 5)
    redis_server.kill()

    during = post(server, visit("during"))
    assert during["summary"]["history"] == "unavailable"
    assert_scores(scores(during), expected_scores(visit("during"), 1))  # computed without it
    plain = post(server, visit("plain", history=False))
    assert plain["summary"]["history"] == "none"
    ready = server.client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["stats_store"] == "down"
    unavailable = server.client.get("/v1/stats/tokens", params={"namespace": "team-a"})
    assert unavailable.status_code == 503
    assert unavailable.json()["error"]["code"] == "stats_unavailable"
    metrics = server.metrics()
    assert metrics[("advantage_stats_store_up", ())] == 0
    errors = sum(
        v for (name, _), v in metrics.items() if name == "advantage_stats_store_errors_total"
    )
    assert errors >= 1

    redis_server.start()  # same port, empty: no restart of the service needed

    def recovered() -> bool:
        # Redis came back empty: the read succeeds and finds nothing ("empty", not "applied").
        return post(server, visit("after"))["summary"]["history"] == "empty"

    poll(recovered, 30, "history read again after Redis came back")
    assert server.client.get("/readyz").json()["stats_store"] == "up"
    assert server.metrics()[("advantage_stats_store_up", ())] == 1
