"""The stats store's layout on a Redis Cluster (redis-py's ``RedisCluster``: its view of the
slots and nodes, its connections to each node), used by :class:`.RedisStatsStore` when the
node of ``ADV_REDIS_URL`` runs in cluster mode. The design is in :mod:`.redis_store`.

Every slot ``s`` has a *tag* ``T(s)``: a short string whose hash slot is ``s`` (a table made
once). Keys (``P`` = prefix, ``N`` = the namespace percent-encoded):

- ``P:{T(s)}:N:<space>:<key>``: a record, where ``s`` = ``CRC16("N:<space>:<key>") mod 16384``:
  one namespace's records spread over every slot, so over every master;
- ``P:{T(s)}:N:claim:<request id>``: the request's part in slot ``s`` was counted (its value as
  on one Redis: the write's id, then ``|`` and the request's digest);
  ``P:{T(s)}:N:write:<write>``: the write's part in slot ``s`` was applied (five minutes: it
  makes a resent part apply nothing); ``P:{T(s)}:N:stage:<write>:<i>``: staged records;
- ``P:{N:b<b>}:tokdelta``, ``:tokstats``, ``:toklock``, ``:claim:<request id>``,
  ``:write:<write>``, ``:stage:...``: statistics bucket ``b`` (``0 <= b < buckets``), its own
  slot; a request's statistics go to bucket ``CRC32(request id) mod buckets`` (a request without
  an id: the bucket of its write), so no key is written by every request.

Each node of a slot receives one pipeline per operation (all the parts of its slots), sent
concurrently to every node: one round trip from the service's side, one per node it touches
(at most the number of masters). A node that does not answer fails only its own slots' parts
and is skipped for a backoff interval (doubling, as the store's); the view of the cluster is
refreshed (``CLUSTER SLOTS``) while a node is failing and on a ``MOVED`` reply, so the store
follows a failover without a restart.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

from redis.asyncio.cluster import RedisCluster
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from .base import LOST, Read, Recording, RecordKey, Write
from .redis_cluster_write import ClusterWrite
from .redis_commit import SlotKeys, script_reply
from .redis_common import (
    Backoff,
    Commands,
    DeltaKeys,
    Execute,
    PartlyUnavailable,
    RedisContext,
    command,
    stored_digest,
)
from .redis_nodes import ClusterNodes, Connection, Part, failed, replies_of
from .write_groups import Finished

DEFAULT_BUCKETS = 16


@functools.cache
def slot_tags() -> tuple[str, ...]:
    """For every hash slot, the shortest string (base 36) whose slot it is."""
    tags: list[str | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
    left = REDIS_CLUSTER_HASH_SLOTS
    i = 0
    while left:
        tag = _base36(i)
        slot = key_slot(tag.encode())
        if tags[slot] is None:
            tags[slot] = tag
            left -= 1
        i += 1
    return tuple(t for t in tags if t is not None)


def _base36(i: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = digits[i % 36]
    while i >= 36:
        i //= 36
        out = digits[i % 36] + out
    return out


# (the names the tests use)
_script_reply = script_reply
# A node's backoff (the name the tests of a blocked node use).
_NodeState = Backoff


class ClusterLayout:
    """The stats store's layout on a Redis Cluster (reachability and settings are ``context``'s,
    shared with the store)."""

    def __init__(self, context: RedisContext, connection: Connection, buckets: int) -> None:
        self.context = context
        self.buckets = max(1, int(buckets))
        self.nodes = ClusterNodes(connection, context.backoff, context.count_round_trip)

    # ---- keys --------------------------------------------------------------------------------

    def _ns(self, namespace: str) -> str:
        # (UTF-8: a namespace that is not valid Unicode text raises UnicodeEncodeError, which a
        # write answers as refused)
        return quote(namespace, safe="")

    def record_slot(self, namespace: str, key: RecordKey) -> int:
        # (surrogatepass: the same bytes for valid text; a key that is not valid text still has
        # a slot, so that its part, not the whole write, is refused when its key is encoded)
        space, name = key
        ns = quote(namespace, safe="", errors="surrogatepass")
        return key_slot(f"{ns}:{space}:{name}".encode("utf-8", "surrogatepass"))

    def slot_keys(self, slot: int, namespace: str) -> SlotKeys:
        return SlotKeys(f"{self.context.prefix}:{{{slot_tags()[slot]}}}:{self._ns(namespace)}")

    def record_key(self, namespace: str, key: RecordKey) -> bytes:
        return self.slot_keys(self.record_slot(namespace, key), namespace).record(key)

    def bucket_of(self, name: str) -> int:
        """The statistics bucket of a request id (or a write's id, for a request without one)."""
        # (surrogatepass: see record_slot)
        return zlib.crc32(name.encode("utf-8", "surrogatepass")) % self.buckets

    def _bucket(self, namespace: str, bucket: int) -> str:
        return f"{self.context.prefix}:{{{self._ns(namespace)}:b{bucket}}}"

    def bucket_slot(self, namespace: str, bucket: int) -> int:
        return key_slot(self._bucket(namespace, bucket).encode())

    def bucket_keys(self, namespace: str, bucket: int) -> SlotKeys:
        return SlotKeys(self._bucket(namespace, bucket))

    def delta_keys(self, namespace: str, bucket: int) -> DeltaKeys:
        return self.bucket_keys(namespace, bucket).deltas()

    # ---- sending ----------------------------------------------------------------------------

    @property
    def client(self) -> RedisCluster:
        return self.nodes.client

    @property
    def _nodes(self) -> dict[str, Backoff]:
        return self.nodes.nodes

    @property
    def degraded(self) -> bool:
        return self.nodes.degraded

    async def ping(self) -> bool:
        return await self.nodes.ping()

    async def close(self) -> None:
        await self.nodes.close()

    async def run_one(self, slot: int, commands: Commands) -> Any:
        """``commands`` on the master of ``slot``: their replies; raises the part's failure
        (an error reply among them included)."""
        part = Part(slot, commands)
        await self.nodes.run([part])
        if isinstance(part.result, BaseException):
            raise PartlyUnavailable(str(part.result)) from part.result
        return replies_of(part)

    # ---- records -----------------------------------------------------------------------------

    async def read(self, namespace: str, keys: Sequence[RecordKey], request_id: str | None) -> Read:
        """The records of ``keys``, those on nodes that did not answer left unread; with
        ``request_id``, the digest its statistics claim keeps (read in the same round trip to
        its bucket's node; None when that node did not answer)."""
        parts = [
            Part(
                self.record_slot(namespace, key), [command(b"GET", self.record_key(namespace, key))]
            )
            for key in keys
        ]
        claim = self._claim_part(namespace, request_id)
        await self.nodes.run([*parts, *([claim] if claim is not None else [])], read=True)
        records: list[bytes | None] = []
        unread = set()
        for i, part in enumerate(parts):
            if failed(part):
                unread.add(i)
                records.append(None)
            else:
                assert isinstance(part.result, list)
                records.append(part.result[0])
        digest = None
        if claim is not None and not failed(claim):
            assert isinstance(claim.result, list)
            digest = stored_digest(claim.result[0])
        return Read(records, frozenset(unread), digest)

    def _claim_part(self, namespace: str, request_id: str | None) -> Part | None:
        """A GET of the statistics claim of ``request_id`` (the claim that counts it); None
        without an id, or for one that is not valid Unicode text (no claim of it can exist)."""
        if request_id is None:
            return None
        bucket = self.bucket_of(request_id)
        try:
            key = self.bucket_keys(namespace, bucket).claim(request_id)
        except UnicodeEncodeError:
            return None
        return Part(self.bucket_slot(namespace, bucket), [command(b"GET", key)])

    # ---- writes ------------------------------------------------------------------------------

    async def record_write(self, write: Write) -> Recording:
        """Write the records part by part (one per slot), then the statistics of the requests
        whose every part is written (one part per bucket): see :mod:`.redis_store` and
        :class:`.redis_cluster_write.ClusterWrite`. Requests that go together or not at all
        (``write.together``): one request at most."""
        if write.together and len(write.requests) > 1:
            raise ValueError(
                "on a Redis Cluster a write counts each request in parts: record_many "
                "takes one request id at most, write several with record_requests"
            )
        if self.context.skipping("record"):
            return Finished([LOST] * len(write.requests))
        parts = ClusterWrite(self, write)
        await parts.send()
        return parts

    def execute_in(self, slot: int) -> Execute:
        """Send commands to the master of ``slot`` (:meth:`run_one`)."""
        return functools.partial(self.run_one, slot)

    # ---- reading the statistics -------------------------------------------------------------

    async def statistics_records(self, namespace: str) -> list[bytes | None]:
        """Every bucket's compacted record and pending deltas; raises PartlyUnavailable when a
        node did not answer (the statistics would be short)."""
        parts = []
        for bucket in range(self.buckets):
            keys = self.delta_keys(namespace, bucket)
            commands = [
                command(b"GET", keys.compacted),
                command(b"LRANGE", keys.delta, b"0", b"-1"),
            ]
            parts.append(Part(self.bucket_slot(namespace, bucket), commands))
        await self.nodes.run(parts, read=True)
        out: list[bytes | None] = []
        for part in parts:
            result = part.result
            if isinstance(result, BaseException) or result is None:
                raise PartlyUnavailable(f"slot {part.slot}: {result}")
            current, deltas = result
            if isinstance(current, BaseException) or isinstance(deltas, BaseException):
                raise PartlyUnavailable(f"slot {part.slot}: {current} {deltas}")
            out += [current, *deltas]
        return out


__all__ = ["DEFAULT_BUCKETS", "ClusterLayout", "slot_tags"]
