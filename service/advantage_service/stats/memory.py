"""The embedded stats store: one process, in memory, the default without ``--redis-url``.

It keeps the same records as the Redis store (the terms' opaque bytes) and the statistics tables
undecoded, and goes through the same merge code, so both backends give the same numbers. The
vocabulary statistics are merged into one table per namespace at every write (there are no
replicas to append concurrently). Every entry expires ``ttl_seconds`` after its last write, as
Redis keys do.

Memory is bounded whatever the traffic: records by their total bytes (``max_record_bytes``),
remembered request ids and namespaces by count. Past a bound the entry
written longest ago is evicted first (as Redis with ``maxmemory-policy volatile-lru`` would),
so a long run forgets its oldest prompts instead of growing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from .base import (
    Outcome,
    Read,
    RecordKey,
    Refold,
    RequestWrite,
    StatsUpdate,
    StoreStatus,
    check_order,
    record_whole,
    token_stats_response,
)
from .blobs import TokenStatsUpdate, empty_token_stats, merge_token_stats, token_columns

DEFAULT_TTL_SECONDS = 7 * 24 * 3600
DEFAULT_MAX_RECORD_BYTES = 512 * 2**20
DEFAULT_MAX_REQUEST_IDS = 1_000_000
DEFAULT_MAX_NAMESPACES = 1024
# What a record costs besides its bytes (keys, dictionary entry), roughly.
RECORD_OVERHEAD = 200


class MemoryStatsStore:
    """The in-memory :class:`~advantage_service.stats.base.StatsStore`."""

    def __init__(
        self,
        ttl_seconds: float = DEFAULT_TTL_SECONDS,
        *,
        now: Callable[[], float] = time.monotonic,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
        max_request_ids: int = DEFAULT_MAX_REQUEST_IDS,
        max_namespaces: int = DEFAULT_MAX_NAMESPACES,
    ) -> None:
        self.ttl_seconds = ttl_seconds
        self._now = now
        self.max_record_bytes = max_record_bytes
        self.max_request_ids = max_request_ids
        self.max_namespaces = max_namespaces
        # Insertion-ordered: re-inserting on every write keeps the oldest write first.
        self._records: dict[tuple[str, RecordKey], tuple[float, bytes]] = {}
        self._record_bytes = 0
        self._tokens: dict[str, tuple[float, TokenStatsUpdate]] = {}
        self._requests: dict[tuple[str, str], float] = {}
        self._next_sweep = 0.0

    @property
    def record_bytes(self) -> int:
        """Bytes held by records (bounded by ``max_record_bytes``)."""
        return self._record_bytes

    @property
    def request_ids_kept(self) -> int:
        """Request ids remembered for idempotency (at most ``max_request_ids``)."""
        return len(self._requests)

    @property
    def namespaces_kept(self) -> int:
        """Namespaces whose token statistics are kept (at most ``max_namespaces``)."""
        return len(self._tokens)

    @property
    def status(self) -> StoreStatus:
        return "memory"

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        self._records.clear()
        self._record_bytes = 0
        self._tokens.clear()
        self._requests.clear()

    async def read_records(
        self, namespace: str, keys: Sequence[RecordKey]
    ) -> list[bytes | None] | None:
        now = self._now()
        entries = [self._records.get((namespace, key)) for key in keys]
        return [e[1] if e is not None and e[0] > now else None for e in entries]

    async def read_partly(self, namespace: str, keys: Sequence[RecordKey]) -> Read | None:
        records = await self.read_records(namespace, keys)
        return None if records is None else Read(records)

    @property
    def writable(self) -> bool:
        return True

    async def record(self, namespace: str, request_id: str | None, update: StatsUpdate) -> bool:
        ids = [] if request_id is None else [request_id]
        return await self.record_many(namespace, ids, update) == []

    async def record_many(
        self, namespace: str, request_ids: Sequence[str], update: StatsUpdate
    ) -> list[str] | None:
        now = self._now()
        self._sweep(now)
        ids = list(dict.fromkeys(request_ids))
        claimed = [rid for rid in ids if self._requests.get((namespace, rid), 0.0) > now]
        if claimed:
            return claimed
        for rid in ids:
            key = (namespace, rid)
            self._requests.pop(key, None)
            self._requests[key] = now + self.ttl_seconds
        while len(self._requests) > self.max_request_ids:
            del self._requests[next(iter(self._requests))]
        expires = now + self.ttl_seconds
        for key, record in update.records.items():
            self._drop_record((namespace, key))
            self._records[(namespace, key)] = (expires, record)
            self._record_bytes += len(record) + RECORD_OVERHEAD
        while self._record_bytes > self.max_record_bytes and self._records:
            self._drop_record(next(iter(self._records)))
        entry = self._tokens.pop(namespace, None)
        table = entry[1] if entry is not None and entry[0] > now else empty_token_stats()
        self._tokens[namespace] = (expires, merge_token_stats([table, update.tokens]))
        while len(self._tokens) > self.max_namespaces:
            del self._tokens[next(iter(self._tokens))]
        return []

    async def record_requests(
        self,
        namespace: str,
        requests: Sequence[RequestWrite],
        update: StatsUpdate,
        refold: Refold,
    ) -> list[Outcome]:
        return await record_whole(self, namespace, requests, update, refold)

    def _drop_record(self, key: tuple[str, RecordKey]) -> None:
        entry = self._records.pop(key, None)
        if entry is not None:
            self._record_bytes -= len(entry[1]) + RECORD_OVERHEAD

    async def token_stats(self, namespace: str, order: str, limit: int) -> dict[str, Any] | None:
        check_order(order)
        entry = self._tokens.get(namespace)
        table = entry[1] if entry is not None and entry[0] > self._now() else empty_token_stats()
        return token_stats_response(namespace, table.rollouts, token_columns(table), order, limit)

    def _sweep(self, now: float) -> None:
        """Drop expired entries, at most every quarter TTL (a minute at most)."""
        if now < self._next_sweep:
            return
        self._next_sweep = now + min(60.0, self.ttl_seconds / 4)
        for key in [k for k, v in self._records.items() if v[0] <= now]:
            self._drop_record(key)
        self._tokens = {k: v for k, v in self._tokens.items() if v[0] > now}
        self._requests = {k: t for k, t in self._requests.items() if t > now}


__all__ = ["DEFAULT_TTL_SECONDS", "MemoryStatsStore"]
