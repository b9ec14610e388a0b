"""RetryPolicy's ``max_wait``: a call keeps retrying past ``retries`` until that much time was
spent waiting, long enough to ride out a service restart; then it gives up with the last error."""

from __future__ import annotations

import pytest
from advantage_client import RetryPolicy
from advantage_client.retry import Retryable


def failing(times: int) -> tuple[list[int], object]:
    calls = [0]

    def attempt() -> str:
        calls[0] += 1
        if calls[0] <= times:
            raise Retryable(ConnectionError("down"))
        return "ok"

    return calls, attempt


def test_max_wait_keeps_retrying_past_the_retries_until_the_budget_is_spent() -> None:
    slept: list[float] = []
    _, attempt = failing(10_000)
    policy = RetryPolicy(retries=3, backoff=0.1, max_backoff=10.0, max_wait=60.0)
    with pytest.raises(ConnectionError):
        policy.run(attempt, sleep=slept.append)  # type: ignore[arg-type]
    assert sum(slept) == pytest.approx(60.0, abs=1e-9)  # all of the budget, not more
    assert len(slept) > 3 and max(slept) <= 10.0


def test_a_service_back_within_the_budget_is_answered() -> None:
    slept: list[float] = []
    calls, attempt = failing(8)  # down for 8 tries: more than retries=3 allows alone
    policy = RetryPolicy(retries=3, backoff=0.1, max_backoff=10.0, max_wait=60.0)
    assert policy.run(attempt, sleep=slept.append) == "ok"  # type: ignore[arg-type]
    assert calls[0] == 9
    without = RetryPolicy(retries=3, backoff=0.1, max_backoff=10.0)
    calls, attempt = failing(8)
    with pytest.raises(ConnectionError):
        without.run(attempt, sleep=lambda s: None)  # type: ignore[arg-type]
