"""Fixtures for the stats store: a real redis-server per test, and the store over each backend.

The behavioural tests take ``store_factory``/``store`` and run once per backend (``memory`` and
``redis``), so the in-memory store passes the same suite as the Redis store.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from advantage_service.stats import MemoryStatsStore, RedisStatsStore, StatsStore

StoreFactory = Callable[..., StatsStore]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(
    params=[
        "memory",
        pytest.param("redis", marks=pytest.mark.integration),
        pytest.param("redis-zstd", marks=pytest.mark.integration),
    ]
)
def backend(request: pytest.FixtureRequest) -> str:
    """``redis-zstd``: Redis with compressed history records (ADV_STATS_COMPRESSION=zstd)."""
    return str(request.param)


@pytest.fixture
async def store_factory(
    backend: str, request: pytest.FixtureRequest
) -> AsyncIterator[StoreFactory]:
    """Make stores of the test's backend; Redis stores share one server (replicas)."""
    made: list[StatsStore] = []
    server = request.getfixturevalue("redis_server") if backend.startswith("redis") else None

    def make(**options: Any) -> StatsStore:
        store: StatsStore
        if server is None:
            store = MemoryStatsStore(**options)
        else:
            store = RedisStatsStore(server.url, **options)
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
