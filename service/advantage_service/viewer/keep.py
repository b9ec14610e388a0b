"""Where the viewer keeps recent requests (``ADV_VIEWER_KEEP``): in this process's memory, or in
Redis (``ADV_REDIS_URL``) so that any replica behind the Service lists and opens them.

Both stores answer the same three calls (:class:`KeepStore`): ``add`` a computed request,
list a namespace's ``recent`` ones (summaries, newest first) and ``get`` one as the JSON the
viewer's route answers.

- :class:`MemoryKeep` (no Redis): the last ``ADV_VIEWER_KEEP`` requests per namespace, at most
  ``ADV_VIEWER_KEEP_BYTES`` in all (:class:`RecentRequests`); no TTL, gone with the process.
- :class:`RedisKeep`: per namespace, the last ``ADV_VIEWER_KEEP`` requests, at most
  ``ADV_VIEWER_KEEP_BYTES`` of stored JSON together (the oldest leave first; a request larger
  than that alone is not kept), none older than ``ADV_VIEWER_KEEP_TTL_SECONDS``. Keys (``P`` the
  prefix ``adv``, ``{N}`` the namespace percent-encoded in braces, as the stats store's):
  ``P:{N}:viewer:index`` (sorted set: request id -> when kept, in microseconds, strictly
  increasing per namespace), ``P:{N}:viewer:blobs`` (hash: request id -> the JSON the route
  answers) and ``P:{N}:viewer:summaries`` (hash: request id -> its listing entry). One script
  per write adds the request and trims by TTL, count and bytes atomically, then sets the three
  keys' TTL, so an idle namespace's kept requests vanish whole; a listing or an opening is one
  pipeline and hides what is past the TTL. Best effort: a failed write is counted
  (``advantage_stats_store_errors_total{op="viewer_keep"}``, reads ``op="viewer_read"``) and
  never fails a request; after a connection failure the store skips (and counts) for a
  backoff interval (0.25 s doubling to 4 s): the stats store's connections and backoff
  (``stats.redis_nodes.Connection``, ``stats.redis_common.Reachability``). A read that cannot reach
  Redis raises :class:`KeepUnavailable` (the routes answer 503). On a Redis Cluster (found as
  the stats store finds it, or ``ADV_REDIS_CLUSTER``) the same keys, through redis-py's cluster
  client: a namespace's keys share one slot.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import quote

import numpy as np
import orjson
from redis.crc import key_slot

from ..serving.engine import Computed
from ..stats.redis_common import Backoff, Commands, Reachability, Unavailable, command
from ..stats.redis_nodes import (
    ClusterNodes,
    Connection,
    Nodes,
    OneNode,
    Part,
    replies_of,
    run_scripts,
)
from ..wire import jsonio

log = logging.getLogger("advantage_service.viewer")

DEFAULT_PREFIX = "adv"
KEEP_OP = "viewer_keep"
READ_OP = "viewer_read"
OnError = Callable[[str], None]


# ---- a kept request -----------------------------------------------------------------------------


@dataclass(frozen=True)
class KeptRequest:
    """A computed request as the viewer reopens it: its rollouts' tokens and rewards and the
    JSON response it got (as sent, or as JSON would have sent it for an Arrow answer)."""

    request_id: str
    namespace: str
    kept_at: float
    group_ids: list[str]
    group_sizes: list[int]
    tokens: np.ndarray  # int (N,)
    offsets: np.ndarray  # int64 (B + 1,)
    rewards: np.ndarray  # float32 (B,)
    response: bytes
    estimator: str

    @property
    def nbytes(self) -> int:
        ids = sum(len(g) for g in self.group_ids)
        return (
            self.tokens.nbytes
            + self.offsets.nbytes
            + self.rewards.nbytes
            + len(self.response)
            + ids
        )

    def summary(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "namespace": self.namespace,
            "kept_at": self.kept_at,
            "estimator": self.estimator,
            "groups": len(self.group_ids),
            "rollouts": int(self.rewards.size),
            "tokens": int(self.tokens.size),
        }

    def to_json(self) -> bytes:
        """``{"request": {"groups": [{"id", "rollouts": [{"tokens", "reward"}]}]}, "response":
        ...}``: the response's bytes as they were."""
        rollouts = [
            {"tokens": self.tokens[lo:hi], "reward": self.rewards[i]}
            for i, (lo, hi) in enumerate(zip(self.offsets[:-1], self.offsets[1:], strict=True))
        ]
        groups, start = [], 0
        for gid, size in zip(self.group_ids, self.group_sizes, strict=True):
            groups.append({"id": gid, "rollouts": rollouts[start : start + size]})
            start += size
        head = {**self.summary(), "request": {"groups": groups}}
        body = jsonio.dumps_bytes(head)
        return body[:-1] + b',"response":' + self.response + b"}"


def kept_request(computed: Computed[Any], response: bytes, now: float) -> KeptRequest:
    req = computed.request
    batch = req.batch
    return KeptRequest(
        request_id=req.request_id,
        namespace=req.namespace,
        kept_at=now,
        group_ids=list(batch.group_ids),
        group_sizes=batch.group_sizes.cpu().tolist(),
        tokens=batch.tokens.cpu().numpy(),
        offsets=batch.offsets.cpu().numpy().astype(np.int64),
        rewards=batch.rewards.cpu().numpy().astype(np.float32),
        response=response,
        estimator=req.estimator.label,
    )


class KeepUnavailable(Exception):
    """The store holding kept requests cannot be reached now (Redis down)."""


class KeepStore(Protocol):
    """Where kept requests live. ``add`` never raises (keeping is best effort); ``recent`` and
    ``get`` raise :class:`KeepUnavailable` when the store cannot be reached."""

    kind: str  # "memory" or "redis"
    per_namespace: int
    # True: ``add`` talks to a server; the viewer runs it after the answer, not before.
    background: bool

    @property
    def enabled(self) -> bool: ...

    async def add(self, kept: KeptRequest) -> bool: ...

    async def recent(self, namespace: str) -> list[dict[str, Any]]: ...

    async def get(self, namespace: str, request_id: str) -> bytes | None: ...

    async def close(self) -> None: ...


# ---- in memory ----------------------------------------------------------------------------------


class RecentRequests:
    """The last ``per_namespace`` requests of each namespace, at most ``max_bytes`` in all (the
    oldest of any namespace leave first; a request larger than the bound is not kept). In this
    process's memory: a replica shows the requests it computed. Thread-safe."""

    def __init__(self, per_namespace: int, max_bytes: int) -> None:
        self.per_namespace = per_namespace
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._lock = threading.Lock()
        self._by_namespace: dict[str, deque[KeptRequest]] = {}
        # (namespace, request_id) -> kept, oldest first
        self._all: OrderedDict[tuple[str, str], KeptRequest] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.per_namespace > 0

    def add(self, kept: KeptRequest) -> bool:
        """Keep ``kept``; False when it is over the byte bound alone (or keeping is off)."""
        size = kept.nbytes
        if not self.enabled or size > self.max_bytes:
            return False
        key = (kept.namespace, kept.request_id)
        with self._lock:
            if key in self._all:  # the same request id again: the newer one
                self._remove(self._all[key])
            ring = self._by_namespace.setdefault(kept.namespace, deque())
            ring.append(kept)
            self._all[key] = kept
            self.nbytes += size
            if len(ring) > self.per_namespace:
                self._remove(ring[0])
            while self.nbytes > self.max_bytes:
                self._remove(next(iter(self._all.values())))
        return True

    def _remove(self, kept: KeptRequest) -> None:
        del self._all[(kept.namespace, kept.request_id)]
        ring = self._by_namespace[kept.namespace]
        ring.remove(kept)
        if not ring:
            del self._by_namespace[kept.namespace]
        self.nbytes -= kept.nbytes

    def recent(self, namespace: str) -> list[KeptRequest]:
        """The namespace's kept requests, newest first."""
        with self._lock:
            return list(reversed(self._by_namespace.get(namespace, ())))

    def get(self, namespace: str, request_id: str) -> KeptRequest | None:
        with self._lock:
            return self._all.get((namespace, request_id))


class MemoryKeep:
    """:class:`RecentRequests` as a :class:`KeepStore`."""

    kind = "memory"
    background = False

    def __init__(self, per_namespace: int, max_bytes: int) -> None:
        self.requests = RecentRequests(per_namespace, max_bytes)
        self.per_namespace = per_namespace

    @property
    def enabled(self) -> bool:
        return self.requests.enabled

    async def add(self, kept: KeptRequest) -> bool:
        return self.requests.add(kept)

    async def recent(self, namespace: str) -> list[dict[str, Any]]:
        return [k.summary() for k in self.requests.recent(namespace)]

    async def get(self, namespace: str, request_id: str) -> bytes | None:
        found = self.requests.get(namespace, request_id)
        return None if found is None else await asyncio.to_thread(found.to_json)

    async def close(self) -> None:
        return None


# ---- in Redis -----------------------------------------------------------------------------------

# KEYS: 1 index, 2 blobs, 3 summaries. ARGV: 1 request id, 2 kept at (us), 3 blob, 4 summary,
# 5 per namespace, 6 max bytes, 7 TTL cutoff (us; older leave), 8 TTL (s). Answers the number
# of kept requests of the namespace, and 0 when the new one itself had to leave.
KEEP_SCRIPT = b"""
local function drop(ids)
  for _, id in ipairs(ids) do
    redis.call('ZREM', KEYS[1], id)
    redis.call('HDEL', KEYS[2], id)
    redis.call('HDEL', KEYS[3], id)
  end
end
drop(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[7]))
local at = tonumber(ARGV[2])
local newest = redis.call('ZREVRANGE', KEYS[1], 0, 0, 'WITHSCORES')
if newest[2] ~= nil and newest[1] ~= ARGV[1] and tonumber(newest[2]) >= at then
  at = tonumber(newest[2]) + 1
end
redis.call('ZADD', KEYS[1], at, ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[4])
local n = redis.call('ZCARD', KEYS[1])
local keep = tonumber(ARGV[5])
if n > keep then drop(redis.call('ZRANGE', KEYS[1], 0, n - keep - 1)) end
local ids = redis.call('ZRANGE', KEYS[1], 0, -1)
local total = 0
for _, id in ipairs(ids) do total = total + redis.call('HSTRLEN', KEYS[2], id) end
local i = 1
while total > tonumber(ARGV[6]) and ids[i] ~= nil do
  total = total - redis.call('HSTRLEN', KEYS[2], ids[i])
  drop({ids[i]})
  i = i + 1
end
for k = 1, 3 do redis.call('EXPIRE', KEYS[k], ARGV[8]) end
if redis.call('ZSCORE', KEYS[1], ARGV[1]) == false then return 0 end
return redis.call('ZCARD', KEYS[1])
"""
KEEP_SHA = hashlib.sha1(KEEP_SCRIPT).hexdigest().encode()


class RedisKeep:
    """Kept requests in Redis, shared by every replica (see the module's docstring)."""

    kind = "redis"
    background = True

    def __init__(
        self,
        url: str,
        per_namespace: int,
        max_bytes: int,
        ttl_seconds: int,
        *,
        prefix: str = DEFAULT_PREFIX,
        socket_timeout: float = 2.0,
        write_timeout: float = 10.0,
        connect_timeout: float = 0.5,
        backoff_initial: float = 0.25,
        backoff_max: float = 4.0,
        cluster: bool | None = None,
        on_error: OnError | None = None,
    ) -> None:
        self.per_namespace = per_namespace
        self.max_bytes = max_bytes
        self.ttl_seconds = int(ttl_seconds)
        self.prefix = prefix
        # (up until a call fails: the first failure is logged)
        self.reachability = Reachability(
            name="viewer",
            backoff_initial=backoff_initial,
            backoff_max=backoff_max,
            on_error=on_error,
            up=True,
        )
        connection = Connection(url, socket_timeout, write_timeout, connect_timeout)
        self._one = OneNode(connection)
        self._nodes: Nodes = self._one

        def cluster_nodes() -> None:
            # A namespace's three keys share a hash slot: the script and the read pipelines go
            # to that slot's master.
            self._nodes = ClusterNodes(connection, Backoff(backoff_initial, backoff_max))

        self._cluster_nodes = cluster_nodes
        # (unset: asked of the node, as the stats store does, at the first call that reaches it)
        self._mode_known = cluster is not None
        if cluster:
            cluster_nodes()

    @property
    def enabled(self) -> bool:
        return self.per_namespace > 0

    def keys(self, namespace: str) -> list[str]:
        """index, blobs, summaries of ``namespace``."""
        ns = f"{self.prefix}:{{{quote(namespace, safe='')}}}:viewer"
        return [f"{ns}:index", f"{ns}:blobs", f"{ns}:summaries"]

    def _cutoff_us(self) -> int:
        return int((time.time() - self.ttl_seconds) * 1e6)

    async def add(self, kept: KeptRequest) -> bool:
        """Keep ``kept``; False when it was not (too large, Redis unreachable: counted)."""
        if not self.enabled or self.reachability.skipping(KEEP_OP):
            return False
        blob = await asyncio.to_thread(kept.to_json)
        if len(blob) > self.max_bytes:
            return False
        summary = orjson.dumps(kept.summary())
        args = [
            kept.request_id.encode(),
            b"%d" % int(kept.kept_at * 1e6),
            blob,
            summary,
            b"%d" % self.per_namespace,
            b"%d" % self.max_bytes,
            b"%d" % self._cutoff_us(),
            b"%d" % self.ttl_seconds,
        ]
        keys = [k.encode() for k in self.keys(kept.namespace)]
        tail = [b"3", *keys, *args]
        part = Part(key_slot(keys[0]), [command(b"EVALSHA", KEEP_SHA, *tail)])
        part.fallback = command(b"EVAL", KEEP_SCRIPT, *tail)

        async def run() -> list[Any]:
            await self._mode()
            await run_scripts(self._nodes, [part])
            return replies_of(part)

        try:
            (kept_now,) = await self.reachability.call(KEEP_OP, run)
        except Unavailable:
            return False
        return bool(kept_now)

    async def recent(self, namespace: str) -> list[dict[str, Any]]:
        index, _, summaries = (k.encode() for k in self.keys(namespace))
        cutoff, count = b"%d" % self._cutoff_us(), b"%d" % self.per_namespace
        ids, flat = await self._read(
            index,
            [
                command(b"ZREVRANGEBYSCORE", index, b"+inf", cutoff, b"LIMIT", b"0", count),
                command(b"HGETALL", summaries),
            ],
        )
        # (a map as RESP3 and some parsers give it, else a flat list of field, value)
        entries = flat if isinstance(flat, dict) else dict(zip(flat[::2], flat[1::2], strict=True))
        out = []
        for rid in ids:
            entry = entries.get(rid)
            if entry is not None:
                out.append(orjson.loads(entry))
        return out

    async def get(self, namespace: str, request_id: str) -> bytes | None:
        index, blobs, _ = (k.encode() for k in self.keys(namespace))
        rid = request_id.encode()
        score, blob = await self._read(
            index, [command(b"ZSCORE", index, rid), command(b"HGET", blobs, rid)]
        )
        if score is None or blob is None or float(score) < self._cutoff_us():
            return None
        return bytes(blob)

    async def _read(self, index: bytes, commands: Commands) -> list[Any]:
        """One pipeline of reads, or :class:`KeepUnavailable` (counted)."""

        async def run() -> list[Any]:
            await self._mode()
            part = Part(key_slot(index), commands)
            await self._nodes.run([part], read=True)
            return replies_of(part)

        try:
            return await self.reachability.call(READ_OP, run)
        except Unavailable as exc:
            why = exc.__cause__ or "in backoff after a failure"
            raise KeepUnavailable(str(why)) from exc

    async def _mode(self) -> None:
        """Ask the node once whether it runs in cluster mode (raises when it does not answer)."""
        if self._mode_known:
            return
        if await self._one.runs_cluster():
            await self.close()
            self._cluster_nodes()
        self._mode_known = True

    async def close(self) -> None:
        await self._nodes.close()


def make_keep_store(
    url: str | None,
    per_namespace: int,
    max_bytes: int,
    ttl_seconds: int,
    on_error: OnError | None = None,
    cluster: bool | None = None,
) -> KeepStore:
    """Redis when ``url`` is set (and keeping is on), else memory. ``cluster``: as the stats
    store's (``ADV_REDIS_CLUSTER``)."""
    if url and per_namespace > 0:
        return RedisKeep(
            url, per_namespace, max_bytes, ttl_seconds, cluster=cluster, on_error=on_error
        )
    return MemoryKeep(per_namespace, max_bytes)


__all__ = [
    "KeepStore",
    "KeepUnavailable",
    "KeptRequest",
    "MemoryKeep",
    "RecentRequests",
    "RedisKeep",
    "kept_request",
    "make_keep_store",
]
