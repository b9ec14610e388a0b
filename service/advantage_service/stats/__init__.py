"""Stats store: the records of terms that keep state, vocabulary statistics per namespace,
idempotency.

Two backends behind one interface (:class:`StatsStore`): in-memory (the embedded default) and
Redis (shared by replicas). The semantics are in :mod:`.base`. The store knows no estimator.
"""

from __future__ import annotations

from typing import Any

from .base import ORDERS, RecordKey, StatsStore, StatsUpdate, StoreStatus
from .blobs import TokenStatsUpdate
from .memory import DEFAULT_TTL_SECONDS, MemoryStatsStore
from .redis_store import RedisStatsStore


def make_store(
    redis_url: str | None, *, ttl_seconds: int = DEFAULT_TTL_SECONDS, **redis_options: Any
) -> StatsStore:
    """The Redis store when ``redis_url`` is given, else the in-memory one.

    ``redis_options``: keyword arguments of :class:`RedisStatsStore` (prefix, timeouts, backoff,
    the ``on_error``/``on_duration``/``on_up`` callbacks).
    """
    if redis_url:
        return RedisStatsStore(redis_url, ttl_seconds=ttl_seconds, **redis_options)
    return MemoryStatsStore(ttl_seconds)


__all__ = [
    "DEFAULT_TTL_SECONDS",
    "ORDERS",
    "MemoryStatsStore",
    "RecordKey",
    "RedisStatsStore",
    "StatsStore",
    "StatsUpdate",
    "StoreStatus",
    "TokenStatsUpdate",
    "make_store",
]
