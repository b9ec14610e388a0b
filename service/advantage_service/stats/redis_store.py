"""The Redis stats store: shared by every replica, survives restarts of the service. On one
Redis (this layout, unchanged since the stateful-term protocol) or on a Redis Cluster (the
cluster layout, below): the store asks the node of its URL which at its first contact.

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
writer coalesces the writes of many requests of a namespace into one (:meth:`record_many`): one
write round trip for all of them. The write pipeline stages the new records and the statistics
delta, then one script checks the claims of every request id of the write and, only if none was
claimed before, claims them all (``SET EX``) and moves the staged records into place, so a
duplicate request counts nothing (a write with one answers which ids were claimed, and applies
nothing), a request whose writes never reached Redis is not marked as counted, and a pipeline
resent after a broken connection (same claim) applies nothing twice. Redis work per write is
the transfer of the records plus O(prompts + request ids) key operations.

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
  the records into place. A part where some ids were counted before applies nothing; the store
  folds its records again without those requests (``refold``: the term's fold of the other
  visits) and sends it again (same write id). Parts of other slots apply meanwhile. So a
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
import logging
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import quote

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from .base import (
    LOST,
    Claims,
    OnDuration,
    OnError,
    OnUp,
    Outcome,
    Read,
    RecordKey,
    Refold,
    Refused,
    RequestWrite,
    StatsUpdate,
    StoreStatus,
    check_order,
    record_whole,
    token_stats_response,
)
from .blobs import empty_token_stats, encode_token_stats, token_columns
from .memory import DEFAULT_TTL_SECONDS
from .redis_cluster import DEFAULT_BUCKETS, ClusterLayout
from .redis_common import (
    ANONYMOUS_CLAIM_TTL,
    DEFAULT_COMPACT_AFTER,
    DEFAULT_LOCK_MS,
    LUA_CLAIMS,
    DeltaKeys,
    RedisBase,
    Staged,
    Unavailable,
    claim_digest,
    command,
    is_refusal,
    merge_records,
    merge_tables,
    stored_digest,
)

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "adv"

# KEYS: 1 tokdelta, 2 tokstats, 3 toklock, 4 staged delta, 5 the write's own claim (used when it
# claims no request id), then ARGV[7] request id claims, then pairs (staged record, record).
# ARGV: 1 claim, 2 claim TTL, 3 TTL, 4 compact after, 5 lock value, 6 lock ms, 7 request ids,
# 8 TTL of the write's own claim, then one digest per request id ('' for none). Answers
# {counted, pending deltas, 1 when this caller now holds the compaction lock}, then, when not
# counted, the (1-based) positions of the request ids already claimed, negative where the claim
# keeps another digest (a conflict): nothing is claimed or applied then. Everything that can
# fail is checked before the first write, so that no error leaves half a write: a staged record
# or delta missing (its SET refused, or evicted) answers the error ADVREFUSED (nothing applied:
# the caller writes the requests again in smaller groups), a deltas list of another type
# WRONGTYPE. A claim is the write's claim, then '|' and the request's digest when it has one.
COMMIT_WRITE = (
    LUA_CLAIMS
    + b"""
local ids = tonumber(ARGV[7])
local first = 6 + ids
local function discard()
  for i = first, #KEYS, 2 do redis.call('DEL', KEYS[i]) end
  redis.call('DEL', KEYS[4])
end
-- A resent pipeline that was applied already finds its own claim in place.
local own = KEYS[5]
if ids > 0 then own = KEYS[6] end
local mine = redis.pcall('GET', own)
if type(mine) == 'string'
    and (mine == ARGV[1] or string.sub(mine, 1, #ARGV[1] + 1) == ARGV[1] .. '|') then
  discard()
  return {1, 0, 0}
end
local claimed = claims(6, first - 1, 3, 5)
if #claimed > 3 then
  discard()
  return claimed
end
local missing = {}
for i = first, #KEYS, 2 do
  if redis.call('EXISTS', KEYS[i]) == 0 then missing[#missing + 1] = (i - first) / 2 + 1 end
end
if redis.call('EXISTS', KEYS[4]) == 0 then missing[#missing + 1] = 0 end
if #missing > 0 then
  discard()
  return redis.error_reply('ADVREFUSED staged records missing: ' .. table.concat(missing, ' '))
end
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind ~= 'list' and kind ~= 'none' then
  discard()
  return redis.error_reply('WRONGTYPE ' .. KEYS[1] .. ' holds a ' .. kind)
end
if ids == 0 then
  redis.call('SET', KEYS[5], ARGV[1], 'EX', ARGV[8])
end
for i = 6, first - 1 do
  local value = ARGV[1]
  if ARGV[3 + i] ~= '' then value = value .. '|' .. ARGV[3 + i] end
  redis.call('SET', KEYS[i], value, 'EX', ARGV[2])
end
for i = first, #KEYS, 2 do
  redis.call('RENAME', KEYS[i], KEYS[i + 1])
  redis.call('EXPIRE', KEYS[i + 1], ARGV[3])
end
redis.call('LMOVE', KEYS[4], KEYS[1], 'LEFT', 'RIGHT')
redis.call('DEL', KEYS[4])
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[3])
local pending = redis.call('LLEN', KEYS[1])
if pending >= tonumber(ARGV[4]) and redis.call('SET', KEYS[3], ARGV[5], 'NX', 'PX', ARGV[6]) then
  return {1, pending, 1}
end
return {1, pending, 0}
"""
)


class RedisStatsStore(RedisBase):
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
    operation of reads and pings (a hung Redis costs a request at most that); ``write_timeout``
    those of writes and compactions, which run after the response and may carry megabytes.
    ``compact_after``: pending statistics deltas that trigger a compaction; ``lock_ms``: how
    long a compactor may hold the lock. ``merge``, ``new_id`` and ``staged`` are seams for
    tests (:class:`~.redis_common.RedisBase`). Extra keyword arguments go to
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
        super().__init__(
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
        options = {
            "socket_connect_timeout": connect_timeout,
            # One immediate retry on a broken connection (a pooled socket that died with a
            # restarted Redis); none on timeouts. Safe for writes too: the pipeline is idempotent.
            "retry": Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            "decode_responses": False,
            # Replies carry megabytes of records: read them in large pieces.
            "socket_read_size": 1 << 20,
            **redis_kwargs,
        }
        self._client = redis.Redis.from_url(url, socket_timeout=socket_timeout, **options)
        self._writer = redis.Redis.from_url(url, socket_timeout=write_timeout, **options)

        def layout() -> ClusterLayout:
            return ClusterLayout(
                self,
                url,
                socket_timeout=socket_timeout,
                write_timeout=write_timeout,
                connect_timeout=connect_timeout,
                buckets=buckets,
                **redis_kwargs,
            )

        self._make_cluster = layout
        self.cluster: ClusterLayout | None = layout() if cluster else None
        # Known once the node answered INFO cluster (or told by ``cluster``).
        self._mode_known = cluster is not None

    # ---- keys (one Redis) --------------------------------------------------------------------

    def _ns(self, namespace: str) -> str:
        # (quote encodes as UTF-8: a namespace that is not valid Unicode text raises
        # UnicodeEncodeError, which a write answers as Refused)
        return f"{self.prefix}:{{{quote(namespace, safe='')}}}"

    def record_key(self, namespace: str, key: RecordKey) -> str:
        space, name = key
        return f"{self._ns(namespace)}:{space}:{name}"

    def delta_key(self, namespace: str) -> str:
        return f"{self._ns(namespace)}:tokdelta"

    def compacted_key(self, namespace: str) -> str:
        return f"{self._ns(namespace)}:tokstats"

    def lock_key(self, namespace: str) -> str:
        return f"{self._ns(namespace)}:toklock"

    def stage_key(self, namespace: str, claim: str, i: int | str) -> str:
        return f"{self._ns(namespace)}:stage:{claim}:{i}"

    def request_key(self, namespace: str, request_id: str) -> str:
        return f"{self._ns(namespace)}:claim:{request_id}"

    def delta_keys(self, namespace: str) -> DeltaKeys:
        return DeltaKeys(
            delta=self.delta_key(namespace).encode(),
            compacted=self.compacted_key(namespace).encode(),
            lock=self.lock_key(namespace).encode(),
            stage=f"{self._ns(namespace)}:stage",
        )

    # ---- which layout ------------------------------------------------------------------------

    async def _layout(self) -> ClusterLayout | None:
        """The cluster layout, or None for one Redis; asks the node once (raises when it does
        not answer: the caller's operation failed)."""
        if not self._mode_known:
            try:
                info = await self._client.info("cluster")
            except ResponseError:  # (INFO not allowed, as on some managed Redis: one Redis)
                info = {}
            if str(info.get("cluster_enabled", 0)) == "1":
                log.info("stats store: the Redis node runs in cluster mode: the cluster layout")
                self.cluster = self._make_cluster()
            self._mode_known = True
        return self.cluster

    async def _resolve(self, op: str) -> ClusterLayout | None:
        """:meth:`_layout` for an operation outside :meth:`_call` (raises Unavailable)."""
        if self._mode_known:
            return self.cluster
        return await self._call(op, self._layout)

    @property
    def status(self) -> StoreStatus:
        if not self._up:
            return "down"
        if self.cluster is not None and self.cluster.degraded:
            return "degraded"
        return "up"

    async def ping(self) -> bool:
        async def run() -> bool:
            layout = await self._layout()
            if layout is not None:
                return await layout.ping()
            # Both pools: reads and writes go over separate connections.
            return bool(await self._client.ping()) and bool(await self._writer.ping())

        try:
            return await self._call("ping", run)
        except Unavailable:
            return False

    async def close(self) -> None:
        await self._client.aclose()
        await self._writer.aclose()
        if self.cluster is not None:
            await self.cluster.close()

    # ---- records -----------------------------------------------------------------------------

    async def read_records(
        self, namespace: str, keys: Sequence[RecordKey]
    ) -> list[bytes | None] | None:
        read = await self._read(namespace, keys, None)
        return None if read is None else read.records

    async def _read(
        self, namespace: str, keys: Sequence[RecordKey], request_id: str | None
    ) -> Read | None:
        """One Redis: the records of ``keys`` and the digest of ``request_id``'s claim, in one
        pipeline (a cluster found at the first contact: the records alone, all or none)."""
        if self._skipping("read_history"):
            return None
        commands = [command(b"GET", self.record_key(namespace, key).encode()) for key in keys]
        claim = claim_key_bytes(self, namespace, request_id)
        if claim is not None:
            commands.append(command(b"GET", claim))

        async def run() -> Read:
            layout = await self._layout()
            if layout is not None:
                # (every record or none: a node that did not answer fails the read)
                return Read(await layout.read_records(namespace, keys))
            replies = await self._execute(self._client, commands)
            if claim is None:
                return Read(replies)
            return Read(replies[:-1], claimed_digest=stored_digest(replies[-1]))

        try:
            return await self._call("read_history", run)
        except Unavailable:
            return None

    async def read_partly(
        self, namespace: str, keys: Sequence[RecordKey], request_id: str | None = None
    ) -> Read | None:
        if self._skipping("read_history"):
            return None
        try:
            layout = await self._resolve("read_history")
        except Unavailable:
            return None
        if layout is None:
            return await self._read(namespace, keys, request_id)
        try:
            read = await self._call(
                "read_history", lambda: layout.read_partly(namespace, keys, request_id)
            )
        except Unavailable:
            return None
        if read.unread:
            # (counted: part of the cluster did not answer; the store is up, degraded)
            self.count_error("read_history")
            if len(read.unread) == len(keys):
                return None
        return read

    # ---- writes ------------------------------------------------------------------------------

    async def record(self, namespace: str, request_id: str | None, update: StatsUpdate) -> bool:
        ids = [] if request_id is None else [request_id]
        try:
            return await self.record_many(namespace, ids, update) == []
        except Refused:
            return False

    async def record_many(
        self, namespace: str, request_ids: Sequence[str], update: StatsUpdate
    ) -> list[str] | None:
        ids = list(dict.fromkeys(request_ids))
        if self._skipping("record"):
            return None
        try:
            layout = await self._resolve("record")
        except Unavailable:
            return None
        if layout is not None:
            return await layout.record_many(namespace, ids, update)
        requests = [RequestWrite(rid, (), empty_token_stats()) for rid in ids]
        claims = await self.commit(namespace, requests, update)
        if claims is None:
            return None
        return [ids[p] for p in sorted({*claims.duplicates, *claims.conflicts})]

    async def commit(
        self, namespace: str, requests: Sequence[RequestWrite], update: StatsUpdate
    ) -> Claims | None:
        """One Redis: the write pipeline (one round trip) and its commit script."""
        if self._skipping("record"):
            return None
        lock = self.new_id()
        try:
            commands = await asyncio.to_thread(self._writes, namespace, requests, update, lock)
        except UnicodeEncodeError as exc:  # (nothing was sent)
            self.count_error("record")
            raise Refused(f"a key or request id is not valid Unicode text: {exc.reason}") from exc

        async def run() -> list[Any]:
            replies = await self._execute(self._writer, commands, errors=True)
            for reply in replies[:-1]:
                if isinstance(reply, ResponseError):
                    # (a staging command refused, e.g. for memory: refused as a whole, as
                    # before; the script, which checks what was staged, applied nothing)
                    raise reply
            if isinstance(replies[-1], ResponseError) and not is_refusal(replies[-1]):
                raise replies[-1]
            return replies

        try:
            replies = await self._call("record", run)
        except Unavailable:
            return None
        reply = replies[-1]
        if isinstance(reply, ResponseError):
            log.warning(
                "stats store: Redis refused a write of %d requests: %s", len(requests), reply
            )
            self.count_error("record")
            raise Refused(str(reply))
        counted, _pending, compact, *claimed = reply
        if compact:
            await self.compact_deltas(self._execute_writes, self.delta_keys(namespace), lock)
        if counted:
            return Claims()
        positions = [int(p) for p in claimed]
        return Claims(
            tuple(p - 1 for p in positions if p > 0), tuple(-p - 1 for p in positions if p < 0)
        )

    async def record_requests(
        self,
        namespace: str,
        requests: Sequence[RequestWrite],
        update: StatsUpdate,
        refold: Refold,
    ) -> list[Outcome]:
        if self._skipping("record"):
            return [LOST] * len(requests)
        try:
            layout = await self._resolve("record")
        except Unavailable:
            return [LOST] * len(requests)
        if layout is not None:
            return await layout.record_requests(namespace, requests, update, refold)
        return await record_whole(self, namespace, requests, update, refold)

    def _writes(
        self, namespace: str, requests: Sequence[RequestWrite], update: StatsUpdate, lock: str
    ) -> list[list[bytes]]:
        """The write pipeline: stage the records and the delta, then commit (claiming every
        request id of ``requests`` with its digest, or, without any, a claim of the write's
        own). Raises UnicodeEncodeError for a key that is not valid Unicode text."""
        claim = self.new_id()
        stage_ms = self.stage_ms
        staged_delta = self.stage_key(namespace, claim, "d").encode()
        commands = [
            command(b"RPUSH", staged_delta, encode_token_stats(update.tokens)),
            command(b"PEXPIRE", staged_delta, stage_ms),
        ]
        pairs: list[bytes] = []
        for i, (key, record) in enumerate(update.records.items()):
            staged = self.stage_key(namespace, claim, i).encode()
            target = self.record_key(namespace, key).encode()
            if self.staged is None or self.staged(namespace, key):
                commands.append(command(b"SET", staged, record, b"PX", stage_ms))
            pairs += [staged, target]
        claimed = {r.request_id: r.digest for r in requests if r.request_id is not None}
        keys = [
            self.delta_key(namespace).encode(),
            self.compacted_key(namespace).encode(),
            self.lock_key(namespace).encode(),
            staged_delta,
            # (no idempotency asked for: a private claim that only guards against resends)
            f"{self._ns(namespace)}:write:{claim}".encode(),
            *(self.request_key(namespace, rid).encode() for rid in claimed),
            *pairs,
        ]
        args = [claim.encode(), b"%d" % self.ttl_seconds, b"%d" % self.ttl_seconds]
        args += [b"%d" % self.compact_after, lock.encode(), b"%d" % self.lock_ms]
        args += [b"%d" % len(claimed), b"%d" % ANONYMOUS_CLAIM_TTL]
        args += [claim_digest(digest) for digest in claimed.values()]
        commands.append(command(b"EVAL", COMMIT_WRITE, b"%d" % len(keys), *keys, *args))
        return commands

    async def compact(self, namespace: str, lock: str) -> None:
        """Merge the pending deltas into the compacted record, holding the lock ``lock``."""
        await self.compact_deltas(self._execute_writes, self.delta_keys(namespace), lock)

    async def _execute_writes(self, commands: list[list[bytes]]) -> list[Any]:
        return await self._execute(self._writer, commands)

    async def _execute(
        self, client: redis.Redis, commands: list[list[bytes]], *, errors: bool = False
    ) -> list[Any]:
        """Send RESP-encoded ``commands`` in one write and read their replies: one round trip.

        Used instead of redis-py's pipeline so that megabyte records go to the socket as they
        are, without a copy per command. A broken connection is retried once on a fresh one
        (safe: reads, and the idempotent writes). An error reply raises, or with ``errors``
        takes its command's place among the replies (every reply is read: the connection
        stays usable, and the caller sees what the last command answered).
        """
        pool = client.connection_pool
        chunks = [chunk for command in commands for chunk in command]
        for attempt in range(2):
            conn = await pool.get_connection()
            try:
                self.count_round_trip()
                await conn.send_packed_command(chunks, check_health=False)
                if not errors:
                    return [await conn.read_response() for _ in commands]
                replies: list[Any] = []
                for _ in commands:
                    try:
                        replies.append(await conn.read_response())
                    except ResponseError as exc:
                        replies.append(exc)
                return replies
            except RedisConnectionError:
                await conn.disconnect()
                if attempt:
                    raise
            except BaseException:
                # Replies may be left unread: the connection cannot be reused.
                await conn.disconnect()
                raise
            finally:
                await pool.release(conn)
        raise AssertionError("unreachable")

    # ---- reading the statistics -------------------------------------------------------------

    async def token_stats(self, namespace: str, order: str, limit: int) -> dict[str, Any] | None:
        check_order(order)
        commands = [
            command(b"GET", self.compacted_key(namespace).encode()),
            command(b"LRANGE", self.delta_key(namespace).encode(), b"0", b"-1"),
        ]

        async def run() -> list[bytes | None]:
            layout = await self._layout()
            if layout is not None:
                return await layout.statistics_records(namespace)
            current, deltas = await self._execute(self._client, commands)
            return [current, *deltas]

        try:
            records = await self._call("token_stats", run)
        except Unavailable:
            return None
        table = await asyncio.to_thread(merge_tables, records)
        return token_stats_response(namespace, table.rollouts, token_columns(table), order, limit)


def claim_key_bytes(store: RedisStatsStore, namespace: str, request_id: str | None) -> bytes | None:
    """The claim key of ``request_id`` on one Redis; None without an id, or for one that is not
    valid Unicode text (no claim of it can exist: nothing to read)."""
    if request_id is None:
        return None
    try:
        return store.request_key(namespace, request_id).encode()
    except UnicodeEncodeError:
        return None


__all__ = ["DEFAULT_PREFIX", "RedisStatsStore", "merge_records"]
