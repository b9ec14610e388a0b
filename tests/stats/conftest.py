"""Fixtures for the stats store: a real redis-server per test, a real Redis Cluster per session,
and the store over each backend.

The behavioural tests take ``store_factory``/``store`` and run once per backend (``memory``,
``redis`` and ``redis-cluster``), so the in-memory store and the cluster layout pass the same
suite as the Redis store.
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from advantage_service.stats import MemoryStatsStore, RedisStatsStore, StatsStore
from redis_cluster_support import REDIS_CLI, LocalCluster
from redis_support import REDIS_SERVER

StoreFactory = Callable[..., StatsStore]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(
    params=[
        "memory",
        pytest.param("redis", marks=pytest.mark.integration),
        pytest.param("redis-zstd", marks=pytest.mark.integration),
        pytest.param("redis-cluster", marks=pytest.mark.integration),
    ]
)
def backend(request: pytest.FixtureRequest) -> str:
    """``redis-zstd``: Redis with compressed history records (ADV_STATS_COMPRESSION=zstd);
    ``redis-cluster``: a 3-master Redis Cluster, found by the store from one node's URL."""
    return str(request.param)


@pytest.fixture(scope="session")
def session_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One 3-master Redis Cluster for the session (emptied before each test that takes
    ``redis_cluster``)."""
    if not (os.path.exists(REDIS_SERVER) and os.path.exists(REDIS_CLI)):
        pytest.skip("redis-server or redis-cli is not installed (OS package redis-server)")
    cluster = LocalCluster(tmp_path_factory.mktemp("cluster"), masters=3)
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_cluster(session_cluster: LocalCluster) -> LocalCluster:
    session_cluster.flush()
    return session_cluster


@pytest.fixture
async def store_factory(
    backend: str, request: pytest.FixtureRequest
) -> AsyncIterator[StoreFactory]:
    """Make stores of the test's backend; Redis stores share one server (replicas)."""
    made: list[StatsStore] = []
    if backend == "redis-cluster":
        url = request.getfixturevalue("redis_cluster").url
    elif backend.startswith("redis"):
        url = request.getfixturevalue("redis_server").url
    else:
        url = None

    def make(**options: Any) -> StatsStore:
        store: StatsStore
        if url is None:
            store = MemoryStatsStore(**options)
        else:
            store = RedisStatsStore(url, **options)
            # How stats_helpers.serve writes history records through this store (the engine's
            # ADV_STATS_COMPRESSION): the whole suite runs on compressed records too.
            store.test_compression = "zstd" if backend == "redis-zstd" else "none"  # type: ignore[attr-defined]
        made.append(store)
        return store

    yield make
    for store in made:
        await store.close()


@pytest.fixture
async def store(store_factory: StoreFactory) -> StatsStore:
    return store_factory()
