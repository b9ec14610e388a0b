"""/metrics exports the ARCHITECTURE.md metric names, and a request moves them by exactly what
it contained (tokens, rollouts, zero-signal groups, group accuracy, errors)."""

from __future__ import annotations

from typing import Any

import pytest
from http_support import ARROW, Server, arrow_request
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.integration

ARCHITECTURE_METRICS = (
    "advantage_requests_total",
    "advantage_request_duration_seconds",
    "advantage_compute_duration_seconds",
    "advantage_tokens_total",
    "advantage_rollouts_total",
    "advantage_groups_total",
    "advantage_group_accuracy",
    "advantage_token_advantage",
    "advantage_inflight_requests",
    "advantage_stats_store_errors_total",
    "advantage_stats_store_duration_seconds",
    "advantage_stats_store_up",
    "advantage_stream_open",
    "advantage_stream_pending_groups",
)

# Group "mixed": 3 of 4 rollouts correct. Group "all-wrong": zero signal. Group "half": 1 of 2.
REQUEST: dict[str, Any] = {
    "estimator": "rloo",
    "groups": [
        {
            "id": "mixed",
            "rollouts": [
                {"tokens": [1, 2, 3], "reward": 1.0},
                {"tokens": [4], "reward": 1.0},
                {"tokens": [5, 6], "reward": 0.0},
                {"tokens": [7, 8, 9, 10], "reward": 0.5},
            ],
        },
        {
            "id": "all-wrong",
            "rollouts": [{"tokens": [1], "reward": 0.0}, {"tokens": [2, 3], "reward": 0.0}],
        },
        {"id": "half", "rollouts": [{"tokens": [], "reward": 1.0}, {"tokens": [4], "reward": 0.0}]},
    ],
}
TOKENS = 14
ROLLOUTS = 8


def delta(before: dict[Any, float], after: dict[Any, float], name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_every_architecture_metric_is_exported(server: Server) -> None:
    response = server.client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    families = {f.name for f in text_string_to_metric_families(response.text)}
    for name in ARCHITECTURE_METRICS:
        assert name.removesuffix("_total") in families, name


def test_a_json_request_moves_the_counters_by_its_contents(server: Server) -> None:
    before = server.metrics()
    response = server.client.post("/v1/advantages", json=REQUEST)
    assert response.status_code == 200, response.text
    after = server.metrics()

    def d(name: str, **labels: str) -> float:
        return delta(before, after, name, **labels)

    assert d("advantage_requests_total", transport="http_json", estimator="rloo", code="200") == 1
    assert d("advantage_tokens_total", estimator="rloo") == TOKENS
    assert d("advantage_rollouts_total") == ROLLOUTS
    assert d("advantage_groups_total", signal="zero") == 1
    assert d("advantage_groups_total", signal="nonzero") == 2
    # Accuracies 0.75, 0.0 and 0.5 (reward > 0 counts as correct).
    assert d("advantage_group_accuracy_count") == 3
    assert d("advantage_group_accuracy_sum") == pytest.approx(1.25)
    assert d("advantage_group_accuracy_bucket", le="0.0") == 1
    assert d("advantage_group_accuracy_bucket", le="0.5") == 2
    assert d("advantage_group_accuracy_bucket", le="0.7") == 2
    assert d("advantage_group_accuracy_bucket", le="0.8") == 3
    assert d("advantage_token_advantage_count", estimator="rloo") == TOKENS
    assert (
        d("advantage_request_duration_seconds_count", transport="http_json", estimator="rloo") == 1
    )
    assert d("advantage_compute_duration_seconds_count", estimator="rloo", device="cpu") == 1
    assert after[("advantage_inflight_requests", ())] == 0


def test_arrow_requests_and_errors_are_labelled(server: Server) -> None:
    before = server.metrics()
    ok = server.client.post(
        "/v1/advantages",
        content=arrow_request(REQUEST),
        headers={"content-type": ARROW},
    )
    assert ok.status_code == 200, ok.text
    bad = server.client.post(
        "/v1/advantages", content=b"{", headers={"content-type": "application/json"}
    )
    assert bad.status_code == 422
    after = server.metrics()

    def d(name: str, **labels: str) -> float:
        return delta(before, after, name, **labels)

    assert d("advantage_requests_total", transport="http_arrow", estimator="rloo", code="200") == 1
    assert d("advantage_tokens_total", estimator="rloo") == TOKENS
    assert (
        d("advantage_requests_total", transport="http_json", estimator="unknown", code="422") == 1
    )
    assert d("advantage_request_errors_total", transport="http_json", error="invalid_json") == 1
