"""The embedded stats store: one process, in memory, the default without ``--redis-url``.

It keeps the same records as the Redis store (the terms' opaque bytes) and the statistics tables
undecoded, and goes through the same merge code, so both backends give the same numbers. The
vocabulary statistics are merged into one table per namespace at every write (there are no
replicas to append concurrently). Every entry expires ``ttl_seconds`` after its last write, as
Redis keys do.

Memory is bounded whatever the traffic: records by their total bytes (``max_record_bytes``,
512 MiB), remembered request ids by count (``max_request_ids``, 1 M), namespaces' statistics
tables by count (``max_namespaces``, 1024). The bounds are shared by every namespace, and
eviction is fair between them: past the records' bound, the namespace holding the most record
bytes gives up its oldest record (the one written longest ago) first, until it no longer holds
the most; past the ids' bound, the namespace holding the most ids gives up its oldest. So one
tenant flooding the store with prompts evicts its own history, and a namespace holding no more
than another never loses a record while the other holds more: every namespace keeps at least
its fair share (the bound over the namespaces writing). Within a namespace a long run forgets
its oldest prompts instead of growing. Past the namespaces' bound the table written longest ago
goes.

What this store refuses, as Redis would (:class:`~.base.Refused`, nothing applied): a key or
request id that is not valid Unicode text, and a record larger than ``max_record_bytes`` (it
could only be kept by evicting everything else).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from .base import (
    Claims,
    Read,
    Recording,
    RecordKey,
    Refused,
    RequestWrite,
    StatsStore,
    StatsUpdate,
    StoreStatus,
    Write,
    check_order,
    digests_differ,
    ranked_token_stats,
    unstorable,
)
from .blobs import TokenStatsUpdate, empty_token_stats, merge_token_stats
from .write_groups import record_whole

DEFAULT_TTL_SECONDS = 7 * 24 * 3600
DEFAULT_MAX_RECORD_BYTES = 512 * 2**20
DEFAULT_MAX_REQUEST_IDS = 1_000_000
DEFAULT_MAX_NAMESPACES = 1024
# What a record costs besides its bytes (keys, dictionary entry), roughly.
RECORD_OVERHEAD = 200

# namespace -> its entries, insertion-ordered: re-inserting on every write keeps the oldest
# write first.
Records = dict[str, dict[RecordKey, tuple[float, bytes]]]
# namespace -> request id -> (expiry, digest of the request that claimed it, or None)
Requests = dict[str, dict[str, tuple[float, str | None]]]


class MemoryStatsStore(StatsStore):
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
        self._records: Records = {}
        self._namespace_bytes: dict[str, int] = {}
        self._record_bytes = 0
        self._tokens: dict[str, tuple[float, TokenStatsUpdate]] = {}
        self._requests: Requests = {}
        self._request_count = 0
        self._next_sweep = 0.0

    @property
    def record_bytes(self) -> int:
        """Bytes held by records (bounded by ``max_record_bytes``)."""
        return self._record_bytes

    def namespace_record_bytes(self, namespace: str) -> int:
        """Bytes held by the records of ``namespace``."""
        return self._namespace_bytes.get(namespace, 0)

    @property
    def request_ids_kept(self) -> int:
        """Request ids remembered for idempotency (at most ``max_request_ids``)."""
        return self._request_count

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
        self._namespace_bytes.clear()
        self._record_bytes = 0
        self._tokens.clear()
        self._requests.clear()
        self._request_count = 0

    async def read_records(
        self, namespace: str, keys: Sequence[RecordKey]
    ) -> list[bytes | None] | None:
        now = self._now()
        mine = self._records.get(namespace, {})
        entries = [mine.get(key) for key in keys]
        return [e[1] if e is not None and e[0] > now else None for e in entries]

    async def read_partly(
        self, namespace: str, keys: Sequence[RecordKey], request_id: str | None = None
    ) -> Read | None:
        records = await self.read_records(namespace, keys)
        if records is None:
            return None
        digest = None
        if request_id is not None:
            entry = self._requests.get(namespace, {}).get(request_id)
            if entry is not None and entry[0] > self._now():
                digest = entry[1]
        return Read(records, claimed_digest=digest)

    @property
    def writable(self) -> bool:
        return True

    async def record_write(self, write: Write) -> Recording:
        return await record_whole(self, write)

    async def commit(
        self, namespace: str, requests: Sequence[RequestWrite], update: StatsUpdate
    ) -> Claims | None:
        self._check(namespace, requests, update)
        # The vocabulary table is merged on a worker thread: for a vocabulary's worth of ids
        # it takes tens of milliseconds, which on the event loop would hold back every other
        # client's request. It is merged from the table as it is now, and everything else is
        # applied at once after it (no await between the claims and the writes); should the
        # table have changed meanwhile (another commit, an expiry), it is merged again.
        while True:
            current = self._live_tokens(namespace, self._now())
            table = current[1] if current is not None else empty_token_stats()
            if table.tokens.size and update.tokens.tokens.size:
                merged = await asyncio.to_thread(merge_token_stats, [table, update.tokens])
            else:  # (one side empty: nothing to add up)
                merged = merge_token_stats([table, update.tokens])
            now = self._now()
            if self._live_tokens(namespace, now) is current:
                break
        self._sweep(now)
        claimed = self._requests.get(namespace, {})
        duplicates, conflicts = [], []
        for p, request in enumerate(requests):
            rid = request.request_id
            entry = None if rid is None else claimed.get(rid)
            if entry is not None and entry[0] > now:
                if digests_differ(entry[1], request.digest):
                    conflicts.append(p)
                else:
                    duplicates.append(p)
        if duplicates or conflicts:
            return Claims(tuple(duplicates), tuple(conflicts))
        expires = now + self.ttl_seconds
        for request in requests:
            if request.request_id is not None:
                self._claim(namespace, request.request_id, (expires, request.digest))
        self._evict_requests()
        for key, record in update.records.items():
            self._put_record(namespace, key, (expires, record))
        self._evict_records()
        # (re-inserted last: the table written longest ago is the first to go past the bound)
        self._tokens.pop(namespace, None)
        self._tokens[namespace] = (expires, merged)
        while len(self._tokens) > self.max_namespaces:
            del self._tokens[next(iter(self._tokens))]
        return Claims()

    def _live_tokens(self, namespace: str, now: float) -> tuple[float, TokenStatsUpdate] | None:
        entry = self._tokens.get(namespace)
        return entry if entry is not None and entry[0] > now else None

    def _check(self, namespace: str, requests: Sequence[RequestWrite], update: StatsUpdate) -> None:
        """Raise :class:`Refused` for a write this store cannot take (before applying any)."""
        for request in requests:
            why = unstorable(namespace, request.request_id, ())
            if why is not None:
                raise Refused(why)
        why = unstorable(namespace, None, update.records)
        if why is not None:
            raise Refused(why)
        for (space, key), record in update.records.items():
            if len(record) + RECORD_OVERHEAD > self.max_record_bytes:
                raise Refused(
                    f"the record {space}:{key[:64]!r} has {len(record)} bytes, more than the "
                    f"store holds ({self.max_record_bytes} bytes)"
                )

    # ---- entries and their fair eviction -----------------------------------------------------

    def _put_record(self, namespace: str, key: RecordKey, entry: tuple[float, bytes]) -> None:
        self._drop_record(namespace, key)
        self._records.setdefault(namespace, {})[key] = entry
        size = len(entry[1]) + RECORD_OVERHEAD
        self._namespace_bytes[namespace] = self._namespace_bytes.get(namespace, 0) + size
        self._record_bytes += size

    def _drop_record(self, namespace: str, key: RecordKey) -> None:
        mine = self._records.get(namespace)
        entry = None if mine is None else mine.pop(key, None)
        if entry is None:
            return
        size = len(entry[1]) + RECORD_OVERHEAD
        self._record_bytes -= size
        self._namespace_bytes[namespace] -= size
        if not mine:
            del self._records[namespace]
            del self._namespace_bytes[namespace]

    def _claim(self, namespace: str, request_id: str, entry: tuple[float, str | None]) -> None:
        mine = self._requests.setdefault(namespace, {})
        if mine.pop(request_id, None) is None:
            self._request_count += 1
        mine[request_id] = entry

    def _drop_claim(self, namespace: str, request_id: str) -> None:
        mine = self._requests.get(namespace)
        if mine is not None and mine.pop(request_id, None) is not None:
            self._request_count -= 1
            if not mine:
                del self._requests[namespace]

    def _evict_records(self) -> None:
        """Past ``max_record_bytes``: the namespace holding the most bytes gives up its oldest
        records until it no longer holds the most (or the records fit)."""
        while self._record_bytes > self.max_record_bytes and self._records:
            largest = max(self._namespace_bytes, key=self._namespace_bytes.__getitem__)
            runner_up = max(
                (b for ns, b in self._namespace_bytes.items() if ns != largest), default=0
            )
            while (
                self._record_bytes > self.max_record_bytes
                and self._namespace_bytes.get(largest, 0) >= runner_up
                and largest in self._records
            ):
                self._drop_record(largest, next(iter(self._records[largest])))

    def _evict_requests(self) -> None:
        """Past ``max_request_ids``: the same rule, by the number of ids each namespace holds."""
        while self._request_count > self.max_request_ids and self._requests:
            counts = {ns: len(ids) for ns, ids in self._requests.items()}
            largest = max(counts, key=counts.__getitem__)
            runner_up = max((c for ns, c in counts.items() if ns != largest), default=0)
            mine = self._requests[largest]
            while self._request_count > self.max_request_ids and mine and len(mine) >= runner_up:
                self._drop_claim(largest, next(iter(mine)))

    async def token_stats(self, namespace: str, order: str, limit: int) -> dict[str, Any] | None:
        check_order(order)
        entry = self._live_tokens(namespace, self._now())
        table = entry[1] if entry is not None else empty_token_stats()
        return await ranked_token_stats(namespace, table, order, limit)

    def _sweep(self, now: float) -> None:
        """Drop expired entries, at most every quarter TTL (a minute at most)."""
        if now < self._next_sweep:
            return
        self._next_sweep = now + min(60.0, self.ttl_seconds / 4)
        for namespace, records in list(self._records.items()):
            for key in [k for k, v in records.items() if v[0] <= now]:
                self._drop_record(namespace, key)
        self._tokens = {k: v for k, v in self._tokens.items() if v[0] > now}
        for namespace, ids in list(self._requests.items()):
            for rid in [r for r, v in ids.items() if v[0] <= now]:
                self._drop_claim(namespace, rid)


__all__ = ["DEFAULT_TTL_SECONDS", "MemoryStatsStore"]
