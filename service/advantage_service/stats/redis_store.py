"""The Redis stats store: shared by every replica, survives restarts of the service. On one
Redis (:mod:`.redis_single`, unchanged since the stateful-term protocol) or on a Redis Cluster
(:mod:`.redis_cluster`, below): the store asks the node of its URL which at its first contact
(:mod:`.redis_layout`, the one interface of both), and hands every operation to that layout.

One Redis
---------

Layout (``P`` = prefix, ``{N}`` = the namespace percent-encoded, in braces: one namespace's keys
share a hash slot). The statistics format is in :mod:`.blobs`; records are the terms' opaque
bytes.

- ``P:{N}:<space>:<key>``: string, one record of a term (key space ``history``: a prompt's
  key-token history, keyed by prompt id).
- ``P:{N}:tokdelta``: list, one ``ADVT`` record per counted request (its statistics increments),
  appended at the right, oldest at the left.
- ``P:{N}:tokstats``: string, the ``ADVT`` record of every delta compacted so far.
- ``P:{N}:toklock``: string, held (``SET NX PX``) by the one replica compacting.
- ``P:{N}:claim:<request id>``: string, the claim of a counted request: the claim of the write
  that counted it, then ``|`` and the request's digest (32 hex characters; claims of earlier
  releases have none). ``P:{N}:write:<claim>``: the same for a request without an id, kept five
  minutes (it only guards against resends).
- ``P:{N}:stage:<claim>:<i>``: what a write pipeline or a compaction stages before its commit
  script moves it into place (O(1) ``RENAME``/``LMOVE``: megabytes never pass through Lua);
  expires after a minute if the commit never comes.

No name is one of the earlier layout's (``hist:`` and ``req:`` hashes, ``tok:`` hashes,
``meta``): those are never read, so they cannot answer WRONGTYPE, and expire with their TTL.

Every write sets the key's TTL; a write also refreshes ``tokstats``, so a namespace's statistics
expire ``ttl_seconds`` after its last write.

Round trips: a request that reads records makes exactly two, one pipeline of ``GET`` (one per
key) to read and one to write; a request without reads one (the write). Under load the service's
writer coalesces the writes of many requests of a namespace into one (:meth:`record_requests`):
one write round trip for all of them (one more, with the records folded again by the writer,
when it finds a request counted before). The write pipeline stages the new records and the
statistics delta, then one script checks the claims of every request id of the write and, only
if none was claimed before, claims them all (``SET EX``) and moves the staged records into
place, so a duplicate request counts nothing (a write with one answers which ids were claimed,
and applies nothing), a request whose writes never reached Redis is not marked as counted, and a
pipeline resent after a broken connection (same claim) applies nothing twice. Redis work per
write is the transfer of the records plus O(prompts + request ids) key operations.

Compaction: the write script answers the number of pending deltas, and when there are
``compact_after`` or more it also tries the namespace's lock, so exactly one replica compacts
at a time, at no extra round trip for the others. The holder reads the compacted record and the
pending deltas (one round trip; at most ``2 * compact_after`` of them), merges them in numpy,
stages the result and commits (one round trip) with a script that, only while it still holds
the lock, renames the staged record over ``tokstats`` and ``LTRIM``s exactly the deltas it
merged; while ``compact_after`` or more are still pending (writes raced ahead) it keeps the lock
for another round, up to ``COMPACT_ROUNDS`` per write. The commit is atomic, so there is no
moment where a delta is both in ``tokstats`` and still pending, and a compactor that crashed or
lost its lock (expired after ``lock_ms``) changes nothing: its deltas stay pending for the next.
``token_stats`` reads the compacted record and the pending deltas in one round trip and merges
them. Replicas append concurrently without losing counts (``LMOVE`` is atomic, only the lock
holder trims, and only what it read).

Outage: reads and pings use a short socket timeout, writes (which run after the response) a
longer one; a broken pooled connection is retried once at once (a restarted Redis), nothing else
is retried. After a failure the store answers "unreachable" at once (reads None, writes False)
for a backoff interval that doubles from ``backoff_initial`` up to ``backoff_max``, then tries
again; the connection pools reconnect by themselves, so no restart is needed. An error
*reply* (Redis is up but refuses the command, e.g. a write once ``maxmemory`` is reached and
nothing more can be evicted) fails that operation only (counted, no backoff): reads go on, and
a refused write pipeline commits nothing (the commit script is refused as a whole; staged
records expire).

A Redis Cluster
---------------

One namespace in one slot would put a training run's whole history on one master; the cluster
layout (:mod:`.redis_cluster`, with its key names) spreads it instead, and keeps every guarantee
above without a script that spans slots:

- **Records** are hashed by (namespace, key space, key): a run's prompts spread over all 16384
  slots, so over every master (within 3% of their mean for 10k prompts on 3 masters).
- **Statistics** go to ``buckets`` tables per namespace (``ADV_REDIS_CLUSTER_BUCKETS``, 16),
  each in a slot of its own with its own deltas, compacted record and lock (compaction is the
  one above, per bucket). A request's statistics go to the bucket of its request id (a request
  without an id: the bucket of its write), so no key is written by every request;
  ``token_stats`` reads every bucket (one pipeline per master) and merges them.
- **Counted, per slot.** A write (the writer's round: several requests, :meth:`record_requests`)
  is cut into parts, one per slot. Each part is a pipeline to that slot's master: stage its
  records, then one script that, atomically on that slot, finds the part's own write key (a
  resent part: applied before, nothing to do), else checks the claims *in this slot* of every
  request id that wrote into the part and, only if none was claimed, claims them all and moves
  the records into place. A part where some ids were counted before applies nothing; the write
  asks the service for its records folded again without those requests (the store keeps bytes:
  the service's writer folds the other visits, :class:`~.base.FoldAgain`) and sends it again
  (same write id): one more round trip, on this path only. Parts of other slots apply
  meanwhile. So a
  request id is counted once in each slot it touches, whoever writes it: a resend (to any
  replica, at any time within the TTL) applies only the parts an earlier write left missing
  (a master that was down) and repeats none, and two replicas writing the same request at once
  each apply the parts they claimed first, the other's parts without it.
- **Complete before counted.** The records go first (every part at once, one pipeline per
  master); only the requests whose every part is now written (by this write or an earlier one)
  go on to the second step, their statistics, one part per bucket, claimed the same way. So the
  statistics (``rollouts_counted``) count a request only once its history is all written, and
  exactly once: the request is ``counted`` by the write that claimed its statistics,
  ``duplicate`` for the others, ``lost`` (with ``advantage_stats_requests_total{outcome=
  "lost"}``) while a part is missing; a resend completes it then.
- **Round trips.** From the service's side a request still makes one read and one write; the
  read is one pipeline per master its keys live on (3 for 32 prompts on 3 masters, sent at
  once), the write one per master for the records and then one per master holding the buckets
  written (coalesced writes of many requests share them).
- **A master down.** Its slots' parts fail, the others go on: a read answers the records it got
  and names the keys it could not read (the groups go without history and their records are not
  written: ``summary.history`` ``partial``, each group's ``history``), a write leaves the
  requests with a part there ``lost``; the node is skipped for a backoff interval and the view of
  the slots refreshed until its replica takes over (``/readyz``: ``degraded``). Only when no
  master answers is the store ``down``.
- **What a failover can lose.** Redis replicates asynchronously: a master acknowledges a write
  before its replicas have it. A master that dies in that moment (typically under a millisecond
  of writes) takes them along and its replica is promoted without them. The service cannot see
  it (Redis said yes): those prompts' history misses its last visits (their next visit reads the
  older record: history is a decayed estimate, it goes on), those statistics are not counted,
  and those claims are gone (a resend of such a request within the TTL would be counted
  again). Nothing acknowledged is lost while the cluster is healthy, nor by a failover once the
  replica has caught up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from .base import (
    LOST,
    OnDuration,
    OnError,
    OnUp,
    Read,
    Recording,
    RecordKey,
    StatsStore,
    StoreStatus,
    Write,
    check_order,
    ranked_token_stats,
)
from .memory import DEFAULT_TTL_SECONDS
from .redis_cluster import DEFAULT_BUCKETS, ClusterLayout
from .redis_common import (
    DEFAULT_COMPACT_AFTER,
    DEFAULT_LOCK_MS,
    PartlyUnavailable,
    RedisContext,
    Staged,
    Unavailable,
    merge_records,
    merge_tables,
)
from .redis_layout import FirstContact, Layout
from .redis_nodes import Connection
from .redis_single import SingleLayout, namespace_keys
from .write_groups import Finished

DEFAULT_PREFIX = "adv"


class RedisStatsStore(StatsStore):
    """The Redis :class:`~advantage_service.stats.base.StatsStore` (redis-py asyncio, hiredis),
    on one Redis or on a Redis Cluster.

    ``cluster``: None (the default) asks the node of ``url`` whether it runs in cluster mode
    (``INFO cluster``) at the first operation that reaches it, and uses the cluster layout
    (:mod:`.redis_cluster`, redis-py's ``RedisCluster``) when it does; True uses it from the
    start (the node may be down then); False never asks. ``buckets``: on a cluster, how many
    keys a namespace's statistics are spread over.

    ``on_error(op)``: an operation failed or was skipped during backoff; ``on_duration(op, s)``:
    an attempted operation's wall time; ``on_up(bool)``: reachability changed;
    ``on_round_trip()``: a pipeline was sent to a Redis node. ``op`` is one of
    ``read_history`` (a read of records: the terms' history), ``record``, ``compact`` (a
    compaction a write triggered), ``token_stats``, ``ping``. Status is ``down`` until the first
    successful operation (call :meth:`ping` at startup). ``socket_timeout`` bounds every socket
    operation of reads and pings (a hung Redis costs a request at most that, up to 4x it while
    this process itself runs late: :func:`.redis_nodes.loop_timeout`); ``write_timeout`` those
    of writes and compactions, which run after the response and may carry megabytes.
    ``compact_after``: pending statistics deltas that trigger a compaction; ``lock_ms``: how
    long a compactor may hold the lock. ``merge``, ``new_id`` and ``staged`` are seams for
    tests (:class:`~.redis_common.RedisContext`). Extra keyword arguments go to
    ``redis.asyncio.Redis.from_url`` (and ``RedisCluster.from_url``).
    """

    def __init__(
        self,
        url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        ttl_seconds: int = DEFAULT_TTL_SECONDS,
        socket_timeout: float = 0.5,
        write_timeout: float = 10.0,
        connect_timeout: float = 0.5,
        backoff_initial: float = 0.25,
        backoff_max: float = 4.0,
        compact_after: int = DEFAULT_COMPACT_AFTER,
        lock_ms: int = DEFAULT_LOCK_MS,
        cluster: bool | None = None,
        buckets: int = DEFAULT_BUCKETS,
        on_error: OnError | None = None,
        on_duration: OnDuration | None = None,
        on_up: OnUp | None = None,
        on_round_trip: Callable[[], None] | None = None,
        merge: Callable[[list[bytes | None]], bytes] | None = None,
        new_id: Callable[[], str] | None = None,
        staged: Staged | None = None,
        **redis_kwargs: Any,
    ) -> None:
        self.context = RedisContext(
            prefix=prefix,
            ttl_seconds=ttl_seconds,
            backoff_initial=backoff_initial,
            backoff_max=backoff_max,
            compact_after=compact_after,
            lock_ms=lock_ms,
            on_error=on_error,
            on_duration=on_duration,
            on_up=on_up,
            on_round_trip=on_round_trip,
            merge=merge,
            new_id=new_id,
            staged=staged,
        )

        connection = Connection(url, socket_timeout, write_timeout, connect_timeout, redis_kwargs)

        def on_cluster() -> ClusterLayout:
            return ClusterLayout(self.context, connection, buckets)

        # The one place the layout is chosen: every operation goes to it.
        self._layout: Layout
        # (one Redis's layout also asks the node which layout: none when told it is a cluster)
        self._one = None if cluster else SingleLayout(self.context, connection)
        if self._one is None:
            self._layout = on_cluster()
        elif cluster is None:
            self._layout = FirstContact(self.context, self._one, on_cluster)
        else:
            self._layout = self._one

    # ---- keys (one Redis) --------------------------------------------------------------------

    def record_key(self, namespace: str, key: RecordKey) -> str:
        return namespace_keys(self.context.prefix, namespace).record(key).decode()

    def lock_key(self, namespace: str) -> str:
        return namespace_keys(self.context.prefix, namespace).deltas().lock.decode()

    async def compact(self, namespace: str, lock: str) -> None:
        """One Redis: merge the pending deltas into the compacted record, holding the lock
        ``lock`` (a seam for the tests of racing compactors)."""
        if self._one is None:
            raise RuntimeError("compact(namespace, lock) is one Redis's: this store is a cluster's")
        await self._one.compact(namespace, lock)

    # ---- which layout ------------------------------------------------------------------------

    @property
    def cluster(self) -> ClusterLayout | None:
        """The cluster layout when the store uses it (told, or found at the first contact)."""
        layout = self._layout
        chosen = layout.chosen if isinstance(layout, FirstContact) else layout
        return chosen if isinstance(chosen, ClusterLayout) else None

    @property
    def round_trips(self) -> int:
        """Pipelines sent to Redis nodes (one per node an operation touches)."""
        return self.context.round_trips

    @property
    def writable(self) -> bool:
        return self.context.writable

    @property
    def status(self) -> StoreStatus:
        if not self.context.up:
            return "down"
        return "degraded" if self._layout.degraded else "up"

    async def ping(self) -> bool:
        try:
            return await self.context.call("ping", self._layout.ping)
        except Unavailable:
            return False

    async def close(self) -> None:
        await self._layout.close()

    # ---- records -----------------------------------------------------------------------------

    async def read_records(
        self, namespace: str, keys: Sequence[RecordKey]
    ) -> list[bytes | None] | None:
        if self.context.skipping("read_history"):
            return None

        async def run() -> list[bytes | None]:
            read = await self._layout.read(namespace, keys, None)
            if read.unread:
                # (every record or none: a part of the cluster that did not answer fails it)
                raise PartlyUnavailable(f"{len(read.unread)} of {len(keys)} records not read")
            return read.records

        try:
            return await self.context.call("read_history", run)
        except Unavailable:
            return None

    async def read_partly(
        self, namespace: str, keys: Sequence[RecordKey], request_id: str | None = None
    ) -> Read | None:
        if self.context.skipping("read_history"):
            return None
        try:
            read = await self.context.call(
                "read_history", lambda: self._layout.read(namespace, keys, request_id)
            )
        except Unavailable:
            return None
        if read.unread:
            # (counted: part of the cluster did not answer; the store is up, degraded)
            self.context.count_error("read_history")
            if len(read.unread) == len(keys):
                return None
        return read

    # ---- writes ------------------------------------------------------------------------------

    async def record_write(self, write: Write) -> Recording:
        if self.context.skipping("record"):
            return Finished([LOST] * len(write.requests))
        return await self._layout.record_write(write)

    # ---- reading the statistics -------------------------------------------------------------

    async def token_stats(self, namespace: str, order: str, limit: int) -> dict[str, Any] | None:
        check_order(order)
        try:
            records = await self.context.call(
                "token_stats", lambda: self._layout.statistics_records(namespace)
            )
        except Unavailable:
            return None
        table = await asyncio.to_thread(merge_tables, records)
        return await ranked_token_stats(namespace, table, order, limit)


__all__ = ["DEFAULT_PREFIX", "RedisStatsStore", "merge_records"]
