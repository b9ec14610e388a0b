"""Backoff policy and the HTTP client's retries (on a mock transport: no service)."""

from __future__ import annotations

import json

import httpx
import pytest
from advantage_client import AdvantageError, HttpClient, RetryPolicy
from advantage_client.retry import Retryable


def test_delays_grow_exponentially_within_their_cap_and_honour_retry_after() -> None:
    policy = RetryPolicy(retries=5, backoff=0.1, max_backoff=1.0)
    for attempt in range(6):
        ceiling = min(1.0, 0.1 * 2**attempt)
        assert ceiling / 2 <= policy.delay(attempt) <= ceiling
    assert policy.delay(0, retry_after=0.7) >= 0.7
    assert policy.delay(0, retry_after=30) == 1.0  # capped by max_backoff


def test_run_retries_only_retryable_errors_then_raises_the_last() -> None:
    policy = RetryPolicy(retries=2, backoff=0.01)
    calls: list[int] = []
    slept: list[float] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise Retryable(RuntimeError(f"try {len(calls)}"))
        return "ok"

    assert policy.run(flaky, sleep=slept.append) == "ok"
    assert len(calls) == 3 and len(slept) == 2

    def always() -> str:
        raise Retryable(RuntimeError("still down"))

    with pytest.raises(RuntimeError, match="still down"):
        policy.run(always, sleep=slept.append)

    def fatal() -> str:
        raise ValueError("no")

    with pytest.raises(ValueError):
        policy.run(fatal, sleep=slept.append)


def error_body(code: str, message: str) -> bytes:
    detail = {
        "code": code,
        "message": message,
        "group_id": "g",
        "rollout_index": 1,
        "field": "reward",
    }
    return json.dumps({"error": detail}).encode()


OK_BODY = {
    "request_id": "r",
    "namespace": "default",
    "estimator": {},
    "groups": [{"id": "g", "rollouts": [{"advantages": [0.5, 0.5], "scalar": 0.5}]}],
    "summary": {},
}


def test_http_client_retries_429_and_503_then_succeeds() -> None:
    statuses = iter([429, 503, 200])
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers["content-type"])
        status = next(statuses)
        if status == 200:
            return httpx.Response(200, json=OK_BODY)
        return httpx.Response(
            status, content=error_body("saturated", "busy"), headers={"retry-after": "0"}
        )

    client = HttpClient(
        "http://svc", wire="json", backoff=0.001, transport=httpx.MockTransport(handler)
    )
    out = client.compute({"groups": [{"id": "g", "rollouts": [{"tokens": [1, 2], "reward": 1}]}]})
    assert len(seen) == 3 and seen[0] == "application/json"
    assert out["groups"][0]["rollouts"][0]["advantages"].dtype.name == "float32"


def test_http_client_raises_422_at_once_with_the_location() -> None:
    calls: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return httpx.Response(422, content=error_body("invalid_value", "reward is nan"))

    client = HttpClient("http://svc", transport=httpx.MockTransport(handler))
    with pytest.raises(AdvantageError) as info:
        client.compute({"groups": [{"id": "g", "rollouts": [{"tokens": [1], "reward": 1}]}]})
    assert len(calls) == 1
    error = info.value
    assert (error.status, error.code, error.group_id, error.rollout_index, error.field) == (
        422,
        "invalid_value",
        "g",
        1,
        "reward",
    )


def test_http_client_retries_connection_failures() -> None:
    calls: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        raise httpx.ConnectError("refused", request=request)

    client = HttpClient(
        "http://svc", retries=2, backoff=0.001, transport=httpx.MockTransport(handler)
    )
    with pytest.raises(AdvantageError) as info:
        client.list_estimators()
    assert info.value.code == "unavailable" and len(calls) == 3
