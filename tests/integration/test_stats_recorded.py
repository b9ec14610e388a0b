"""No silent loss of statistics: several concurrent clients against a real service process send
small KTAE requests with history; after the writes settle, every answer that said
``recorded: true`` is counted in the namespace's statistics, on the in-memory store and on a
real redis-server.

(Before the writes were coalesced and pushed back through the queue, the single writer fell
behind at this load and dropped a third to three quarters of the answered requests' statistics,
answering 200 all the same.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest
from http_support import Server
from stats.cluster_load import stats_outcomes
from stats.redis_support import RedisServer

pytestmark = pytest.mark.integration

CLIENTS = 8
SECONDS = 3.0
GROUPS, ROLLOUTS, TOKENS = 2, 4, 32


def request(rng: np.random.Generator, namespace: str) -> dict[str, Any]:
    prompts = rng.choice(32, size=GROUPS, replace=False)
    return {
        "namespace": namespace,
        "estimator": {"outcome": "grpo", "ktae": {"history": "prompt"}},
        "groups": [
            {
                "id": f"p{prompt}",
                "rollouts": [
                    {"tokens": rng.integers(0, 2000, TOKENS).tolist(), "reward": float(r % 2)}
                    for r in range(ROLLOUTS)
                ],
            }
            for prompt in prompts
        ],
    }


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.recorded: dict[Any, int] = {}
        self.overloaded = 0
        self.other: list[str] = []


def client(url: str, namespace: str, seed: int, stop: float, tally: Tally) -> None:
    rng = np.random.default_rng(seed)
    with httpx.Client(base_url=url, timeout=60) as http:
        while time.monotonic() < stop:
            response = http.post("/v1/advantages", json=request(rng, namespace))
            with tally.lock:
                if response.status_code == 200:
                    summary = response.json()["summary"]
                    assert summary["history"] in ("empty", "applied")
                    value = summary.get("recorded", "absent")
                    tally.recorded[value] = tally.recorded.get(value, 0) + 1
                    continue
                if response.status_code != 503:
                    tally.other.append(response.text)
                    continue
                tally.overloaded += 1
            time.sleep(response.json()["error"]["retry_after_ms"] / 1000)


def counted(server: Server, namespace: str) -> int:
    response = server.client.get("/v1/stats/tokens", params={"namespace": namespace, "limit": 1})
    assert response.status_code == 200, response.text
    return int(response.json()["rollouts_counted"]) // (GROUPS * ROLLOUTS)


def settled(server: Server, namespace: str) -> int:
    """The requests counted, once the count has not moved for a second."""
    deadline = time.monotonic() + 60
    last, since = counted(server, namespace), time.monotonic()
    while time.monotonic() - since < 1.0:
        assert time.monotonic() < deadline, "the writes never settled"
        time.sleep(0.1)
        now = counted(server, namespace)
        if now != last:
            last, since = now, time.monotonic()
    return last


@pytest.mark.parametrize("store", ["memory", "redis"])
def test_every_answer_recorded_true_is_counted_under_concurrent_clients(
    server_factory: Callable[..., Server], tmp_path: Any, store: str
) -> None:
    redis = RedisServer(tmp_path / "redis") if store == "redis" else None
    if redis is not None:
        redis.start()
    try:
        server = server_factory(**({"redis_url": redis.url} if redis is not None else {}))
        namespace = f"load-{store}"
        tally = Tally()
        stop = time.monotonic() + SECONDS
        threads = [
            threading.Thread(target=client, args=(server.url, namespace, seed, stop, tally))
            for seed in range(CLIENTS)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

        assert not tally.other, tally.other[:3]
        answered = sum(tally.recorded.values())
        assert answered >= CLIENTS, tally.recorded
        # Every answered request is counted once the writes settle: none dropped ...
        assert settled(server, namespace) == answered, tally.recorded
        # ... and, the store up all along, every answer said so.
        assert tally.recorded == {True: answered}, tally.recorded
        assert stats_outcomes(server) == {"counted": float(answered)}
    finally:
        if redis is not None:
            redis.stop()
