"""Kept requests in Redis (``ADV_REDIS_URL`` with ``ADV_VIEWER_KEEP``): a request computed by one
replica is listed and opened by another; the bounds (count, bytes) and the TTL hold; while
Redis is down requests are still computed, keeping is skipped and counted, and the viewer's
routes answer 503. In-process apps on a real redis-server (the ``redis_server`` fixture)."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from advantage_service.config import Settings
from advantage_service.observability.metrics import Metrics
from advantage_service.serving.engine import Engine
from advantage_service.transports.http import create_app
from advantage_service.viewer.keep import RedisKeep
from redis.crc import key_slot
from stats.redis_cluster_support import LocalCluster
from stats.redis_support import RedisServer
from viewer.viewer_support import kept, ktae_request

pytestmark = pytest.mark.anyio
NS = {"namespace": "team-a"}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@asynccontextmanager
async def replica(url: str, **settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    """One service (engine and app) on ``url``, as a client; ``client.app`` is its app."""
    config = Settings(device="cpu", redis_url=url, **{"viewer_keep": 4, **settings})
    engine = Engine(config, Metrics(process=False))
    app = create_app(config, engine)
    await engine.start()
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://replica") as client:
            client.app = app  # type: ignore[attr-defined]
            yield client
    finally:
        await app.state.viewer.close()
        await engine.flush(timeout=5)
        engine.close()


async def compute(client: httpx.AsyncClient, request: dict[str, Any]) -> dict[str, Any]:
    answer = await client.post("/v1/advantages", json=request)
    assert answer.status_code == 200, answer.text
    await client.app.state.viewer.settle()  # type: ignore[attr-defined]
    return answer.json()


async def listed(client: httpx.AsyncClient) -> list[str]:
    answer = await client.get("/viewer/api/recent", params=NS)
    assert answer.status_code == 200, answer.text
    return [r["request_id"] for r in answer.json()["requests"]]


def errors(client: httpx.AsyncClient, op: str) -> float:
    metrics = client.app.state.engine.metrics  # type: ignore[attr-defined]
    return float(metrics.stats_store_errors_total.labels(op)._value.get())


@pytest.mark.integration
async def test_a_request_kept_by_one_replica_opens_on_another(redis_server: RedisServer) -> None:
    async with replica(redis_server.url) as one, replica(redis_server.url) as other:
        assert (await other.get("/viewer/api/config")).json()["keep_store"] == "redis"
        request = ktae_request("shared-1", seed=3)
        answer = await compute(one, request)
        assert await listed(other) == ["shared-1"]
        kept = (await other.get("/viewer/api/requests/shared-1", params=NS)).json()
        assert kept["response"] == answer  # the same token values, as the first one answered
        rollouts = [r for g in kept["request"]["groups"] for r in g["rollouts"]]
        assert [r["tokens"] for r in rollouts] == [
            r["tokens"] for g in request["groups"] for r in g["rollouts"]
        ]
        # The other replica's requests join the same list, newest first, the last 4 only.
        for i in range(5):
            await compute(other if i % 2 else one, ktae_request(f"shared-many-{i}", seed=i))
        ids = [f"shared-many-{i}" for i in range(4, 0, -1)]
        assert await listed(one) == ids and await listed(other) == ids
        gone = await one.get("/viewer/api/requests/shared-1", params=NS)
        assert gone.status_code == 404 and "not among the last 4" in gone.json()["error"]["message"]


@pytest.mark.integration
async def test_kept_requests_on_a_redis_cluster_open_on_another_replica(
    tmp_path: Path,
) -> None:
    """On a Redis Cluster (found from one node's URL) a namespace's kept requests live in one
    slot of it, through the cluster client; every replica lists and opens them."""
    cluster = LocalCluster(tmp_path / "cluster", masters=3)
    cluster.start()
    try:
        index, _, _ = RedisKeep(cluster.url, 1, 1, 1).keys("team-a")
        holder = cluster.master_of(key_slot(index.encode()))
        # (the URL of a node that does not hold the namespace's slot)
        url = next(node.url for port, node in cluster.nodes.items() if port != holder)
        async with replica(url) as one, replica(url) as other:
            answer = await compute(one, ktae_request("on-cluster", seed=5))
            assert await listed(other) == ["on-cluster"]
            kept = (await other.get("/viewer/api/requests/on-cluster", params=NS)).json()
            assert kept["response"] == answer
            assert errors(one, "viewer_keep") == errors(other, "viewer_read") == 0
        with cluster.client(holder) as client:
            assert client.zcard(index) == 1
    finally:
        cluster.stop()


@pytest.mark.integration
async def test_redis_keeping_is_bounded_in_count_bytes_and_time(
    redis_server: RedisServer,
) -> None:
    now = time.time()
    large = [replace(kept("bounds", f"r{i}", 1000), kept_at=now + i) for i in range(4)]
    size = max(len(k.to_json()) for k in large)
    store = RedisKeep(redis_server.url, per_namespace=3, max_bytes=2 * size + 10, ttl_seconds=1)
    try:
        for k in large:
            assert await store.add(k)
        # Bytes: two fit (the count bound alone would keep three), the oldest left first.
        assert [s["request_id"] for s in await store.recent("bounds")] == ["r3", "r2"]
        assert await store.get("bounds", "r1") is None
        assert await store.get("bounds", "r3") == large[3].to_json()
        assert not await store.add(kept("bounds", "huge", 3000))  # larger than the bound alone
        small = [replace(kept("bounds", f"s{i}", 1), kept_at=time.time()) for i in range(5)]
        for k in small:
            assert await store.add(k)
        assert [s["request_id"] for s in await store.recent("bounds")] == ["s4", "s3", "s2"]
        client = redis.Redis.from_url(redis_server.url)
        index, blobs, summaries = store.keys("bounds")
        assert client.hlen(blobs) == client.hlen(summaries) == client.zcard(index) == 3
        assert all(0 < client.ttl(key) <= 1 for key in (index, blobs, summaries))
        # The TTL: past it nothing is listed or opened, and the keys are gone.
        await asyncio.sleep(1.2)
        assert await store.recent("bounds") == []
        assert await store.get("bounds", "s4") is None
        assert client.exists(index, blobs, summaries) == 0
        client.close()
    finally:
        await store.close()


@pytest.mark.integration
async def test_while_redis_is_down_requests_compute_and_the_listing_is_a_503(
    redis_server: RedisServer,
) -> None:
    async with replica(redis_server.url) as client:
        await compute(client, ktae_request("before-outage"))
        assert await listed(client) == ["before-outage"]
        redis_server.kill()
        answer = await compute(client, ktae_request("during-outage"))
        assert answer["groups"] and errors(client, "viewer_keep") >= 1
        for path in ("/viewer/api/recent", "/viewer/api/requests/before-outage"):
            down = await client.get(path, params=NS)
            assert down.status_code == 503, down.text
            error = down.json()["error"]
            assert error["code"] == "keep_unavailable" and "Redis" in error["message"]
        assert errors(client, "viewer_read") >= 2
        metrics = (await client.get("/metrics")).text
        assert re.search(r'advantage_stats_store_errors_total\{op="viewer_keep"\} [1-9]', metrics)
