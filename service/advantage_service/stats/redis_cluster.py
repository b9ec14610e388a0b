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

import asyncio
import functools
import hashlib
import itertools
import time
import zlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    NoScriptError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError

from .base import (
    CONFLICT,
    COUNTED,
    DUPLICATE,
    LOST,
    POISONED,
    Outcome,
    Read,
    RecordKey,
    Refold,
    Refused,
    RequestWrite,
    StatsUpdate,
)
from .blobs import TokenStatsUpdate, encode_token_stats, merge_token_stats
from .redis_common import (
    ANONYMOUS_CLAIM_TTL,
    LUA_CLAIMS,
    Commands,
    DeltaKeys,
    PartlyUnavailable,
    claim_digest,
    command,
    is_refusal,
    stored_digest,
)

if TYPE_CHECKING:
    from .redis_common import RedisBase

DEFAULT_BUCKETS = 16
# The view of the cluster is refreshed at most this often while a node fails.
REFRESH_SECONDS = 0.5
# Redirections (MOVED, ASK) followed per part of an operation.
REDIRECTS = 2

# One slot's part of a write. KEYS: 1 the write's own key in this slot, then ARGV[4] claims,
# then pairs (staged record, record), then, when ARGV[6] is 1, the statistics bucket's tokdelta,
# tokstats, toklock and staged delta. ARGV: 1 the write's id, 2 claim TTL, 3 TTL, 4 claims,
# 5 TTL of the write's own key, 6 has a delta, 7 compact after, 8 lock value, 9 lock ms, then one
# digest per claim ('' for none). Answers {1, pending deltas, 1 when the caller now holds the
# compaction lock} when applied (now, or before by the same write); {0, 0, 0, positions of the
# claims found} when one of the part's request ids was counted in this slot before (negative
# where the claim keeps another digest: a conflict): nothing is claimed or applied then. As on
# one Redis (redis_store.COMMIT_WRITE), everything that can fail is checked before the first
# write: a staged record or delta missing answers the error ADVREFUSED, a deltas list of another
# type WRONGTYPE, and nothing is applied.
COMMIT_PART = (
    LUA_CLAIMS
    + b"""
local n = tonumber(ARGV[4])
local delta = ARGV[6] == '1'
local last = #KEYS
if delta then last = last - 4 end
local function discard()
  for i = n + 2, last, 2 do redis.call('DEL', KEYS[i]) end
  if delta then redis.call('DEL', KEYS[last + 4]) end
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  discard()
  return {1, 0, 0}
end
local claimed = claims(2, n + 1, 8, 1)
if #claimed > 3 then
  discard()
  return claimed
end
local missing = {}
for i = n + 2, last, 2 do
  if redis.call('EXISTS', KEYS[i]) == 0 then missing[#missing + 1] = (i - n - 2) / 2 + 1 end
end
if delta and redis.call('EXISTS', KEYS[last + 4]) == 0 then missing[#missing + 1] = 0 end
if #missing > 0 then
  discard()
  return redis.error_reply('ADVREFUSED staged records missing: ' .. table.concat(missing, ' '))
end
if delta then
  local kind = redis.call('TYPE', KEYS[last + 1])['ok']
  if kind ~= 'list' and kind ~= 'none' then
    discard()
    return redis.error_reply('WRONGTYPE ' .. KEYS[last + 1] .. ' holds a ' .. kind)
  end
end
for i = 2, n + 1 do
  local value = ARGV[1]
  if ARGV[8 + i] ~= '' then value = value .. '|' .. ARGV[8 + i] end
  redis.call('SET', KEYS[i], value, 'EX', ARGV[2])
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[5])
for i = n + 2, last, 2 do
  redis.call('RENAME', KEYS[i], KEYS[i + 1])
  redis.call('EXPIRE', KEYS[i + 1], ARGV[3])
end
if not delta then return {1, 0, 0} end
local d = last + 1
redis.call('LMOVE', KEYS[d + 3], KEYS[d], 'LEFT', 'RIGHT')
redis.call('DEL', KEYS[d + 3])
redis.call('EXPIRE', KEYS[d], ARGV[3])
redis.call('EXPIRE', KEYS[d + 1], ARGV[3])
local pending = redis.call('LLEN', KEYS[d])
if pending >= tonumber(ARGV[7])
    and redis.call('SET', KEYS[d + 2], ARGV[8], 'NX', 'PX', ARGV[9]) then
  return {1, pending, 1}
end
return {1, pending, 0}
"""
)


COMMIT_PART_SHA = hashlib.sha1(COMMIT_PART).hexdigest().encode()


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


class NodeFailed(Exception):
    """A node did not answer (or is in its backoff after failing)."""


@dataclass
class Part:
    """Commands for one slot; ``result`` their replies (an error reply in place), or the
    exception that failed the whole part."""

    slot: int
    commands: Commands
    result: list[Any] | BaseException | None = None
    # The node importing the slot, after an ASK reply.
    asking: ClusterNode | None = None
    # The last command by the script's text, for a node that answers NOSCRIPT to its digest.
    fallback: list[bytes] | None = None


@dataclass
class _NodeState:
    retry_at: float = 0.0
    backoff: float = 0.0


@dataclass
class _Pending:
    """A part of a write still to be applied: its slot, its keys, the requests (positions)
    that write them."""

    slot: int
    keys: list[RecordKey]
    requests: list[int]


@dataclass
class _Written:
    """What became of the requests' records: positions whose part failed (a node did not
    answer), that a part refused alone (poisoned), or whose id a part found claimed for
    another body (conflicts)."""

    failed: set[int] = field(default_factory=set)
    poisoned: set[int] = field(default_factory=set)
    conflicts: set[int] = field(default_factory=set)


class ClusterLayout:
    """The cluster's side of :class:`.RedisStatsStore` (reachability and settings are the
    store's: ``store``)."""

    def __init__(
        self,
        store: RedisBase,
        url: str,
        *,
        socket_timeout: float,
        write_timeout: float,
        connect_timeout: float,
        buckets: int,
        **redis_kwargs: Any,
    ) -> None:
        self.store = store
        self.buckets = max(1, int(buckets))
        self.read_timeout = socket_timeout
        # Sends use the write timeout (writes carry megabytes); reads pass the read timeout.
        self.client = RedisCluster.from_url(
            url,
            socket_timeout=write_timeout,
            socket_connect_timeout=connect_timeout,
            decode_responses=False,
            socket_read_size=1 << 20,
            # The other masters go on serving while one shard has none.
            require_full_coverage=False,
            **redis_kwargs,
        )
        self._nodes: dict[str, _NodeState] = {}
        self._refresh_at = 0.0
        self._stale = False

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

    def _in_slot(self, slot: int, namespace: str) -> str:
        return f"{self.store.prefix}:{{{slot_tags()[slot]}}}:{self._ns(namespace)}"

    def record_key(self, namespace: str, key: RecordKey) -> bytes:
        space, name = key
        slot = self.record_slot(namespace, key)
        return f"{self._in_slot(slot, namespace)}:{space}:{name}".encode()

    def _bucket_of(self, name: str) -> int:
        # (surrogatepass: see record_slot)
        return zlib.crc32(name.encode("utf-8", "surrogatepass")) % self.buckets

    def _bucket(self, namespace: str, bucket: int) -> str:
        return f"{self.store.prefix}:{{{self._ns(namespace)}:b{bucket}}}"

    def bucket_slot(self, namespace: str, bucket: int) -> int:
        return key_slot(self._bucket(namespace, bucket).encode())

    def delta_keys(self, namespace: str, bucket: int) -> DeltaKeys:
        base = self._bucket(namespace, bucket)
        return DeltaKeys(
            delta=f"{base}:tokdelta".encode(),
            compacted=f"{base}:tokstats".encode(),
            lock=f"{base}:toklock".encode(),
            stage=f"{base}:stage",
        )

    # ---- reachability ------------------------------------------------------------------------

    @property
    def degraded(self) -> bool:
        """Some masters of the cluster's current view did not answer their last call."""
        primaries = {node.name for node in self.client.get_primaries()}
        return any(name in primaries for name in self._nodes)

    def _failed(self, node: ClusterNode) -> None:
        state = self._nodes.get(node.name)
        if state is None:
            state = self._nodes[node.name] = _NodeState(backoff=self.store._backoff_initial)
        state.retry_at = time.monotonic() + state.backoff
        state.backoff = min(state.backoff * 2, self.store._backoff_max)
        self._stale = True

    def _answered(self, node: ClusterNode) -> None:
        self._nodes.pop(node.name, None)

    def _skipped(self, node: ClusterNode) -> bool:
        state = self._nodes.get(node.name)
        return state is not None and time.monotonic() < state.retry_at

    async def _view(self) -> None:
        """Make sure the client knows the cluster's slots; refresh them (at most every
        REFRESH_SECONDS) after a node failed. Raises when no node answers."""
        await self.client.initialize()
        now = time.monotonic()
        if self._stale and now >= self._refresh_at:
            self._refresh_at = now + REFRESH_SECONDS
            self._stale = False
            await self.client.nodes_manager.initialize()
            known = self.client.nodes_manager.nodes_cache
            self._nodes = {name: state for name, state in self._nodes.items() if name in known}

    async def ping(self) -> bool:
        """Ping every master at once (those in their backoff count as failed): True when one
        answered at least (the store is up, maybe degraded); raises when none did."""
        await self._view()
        pings = [(node, Part(0, [command(b"PING")])) for node in self.client.get_primaries()]
        await asyncio.gather(
            *(self._run_node(node, [part], self.read_timeout) for node, part in pings)
        )
        if not pings or all(_failed_part(part) for _, part in pings):
            raise RedisConnectionError("no master of the Redis Cluster answered")
        return True

    async def close(self) -> None:
        await self.client.aclose()

    # ---- sending -----------------------------------------------------------------------------

    async def run(self, parts: Sequence[Part], timeout: float | None = None) -> None:
        """Send every part to the master of its slot: one pipeline per node, all nodes at once;
        each part gets its replies or its failure. Follows MOVED and ASK replies (the view is
        updated) up to REDIRECTS times. Raises when the cluster cannot be reached at all."""
        await self._view()
        todo = list(parts)
        for hop in range(REDIRECTS + 1):
            by_node: dict[str, tuple[ClusterNode, list[Part]]] = {}
            for part in todo:
                try:
                    node = part.asking or self.client.nodes_manager.get_node_from_slot(part.slot)
                except (RedisClusterException, RedisError) as exc:  # (a slot no node serves)
                    part.result = exc
                    self._stale = True
                    continue
                by_node.setdefault(node.name, (node, []))[1].append(part)
            await asyncio.gather(
                *(self._run_node(node, group, timeout) for node, group in by_node.values())
            )
            redirected = []
            for part in todo:
                error = _redirect(part.result)
                if error is None or hop == REDIRECTS:
                    continue
                part.asking = None
                if isinstance(error, MovedError):
                    await self.client.nodes_manager.move_slot(error)
                else:
                    part.asking = self.client.nodes_manager.get_node(
                        host=error.host, port=error.port
                    )
                    if part.asking is None:
                        continue
                redirected.append(part)
            if not redirected:
                break
            todo = redirected

    async def _run_node(self, node: ClusterNode, parts: list[Part], timeout: float | None) -> None:
        if self._skipped(node):
            for part in parts:
                part.result = NodeFailed(node.name)
            return
        commands: Commands = []
        for part in parts:
            if part.asking is not None:
                # (a slot being migrated: ASKING lets the importing node answer the next command)
                commands += [c for cmd in part.commands for c in (ASKING, cmd)]
            else:
                commands += part.commands
        try:
            replies = await self._send(node, commands, timeout)
        except (TimeoutError, RedisError, OSError) as exc:
            self._failed(node)
            for part in parts:
                part.result = exc
            return
        self._answered(node)
        start = 0
        for part in parts:
            count = len(part.commands) * (2 if part.asking is not None else 1)
            mine = replies[start : start + count]
            start += count
            part.result = mine[1::2] if part.asking is not None else mine
            if any(isinstance(r, (ClusterDownError, TryAgainError)) for r in part.result):
                self._stale = True

    async def _send(
        self, node: ClusterNode, commands: Commands, timeout: float | None
    ) -> list[Any]:
        """``commands`` to ``node`` in one write, their replies (error replies in place): one
        round trip, all its replies within ``timeout`` (else TimeoutError; None: each within
        the client's socket timeout). A broken pooled connection is retried once at once on a
        fresh one (safe: reads, and the idempotent parts of writes)."""
        chunks = [chunk for cmd in commands for chunk in cmd]
        for attempt in range(2):
            conn = node.acquire_connection()
            try:
                self.store.count_round_trip()
                await conn.send_packed_command(chunks, check_health=False)
                replies: list[Any] = []
                # Not read_response(timeout=...): past that timeout it returns None and leaves
                # the late reply on the connection, which the next call would read as its own.
                # A timeout here cancels the read, and the connection is closed below.
                async with asyncio.timeout(timeout):
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
                node.release(conn)
        raise AssertionError("unreachable")

    async def run_one(self, slot: int, commands: Commands, timeout: float | None = None) -> Any:
        """``commands`` on the master of ``slot``: their replies; raises the part's failure
        (an error reply among them included)."""
        part = Part(slot, commands)
        await self.run([part], timeout)
        result = part.result
        if isinstance(result, BaseException):
            raise PartlyUnavailable(str(result)) from result
        assert result is not None
        for reply in result:
            if isinstance(reply, BaseException):
                raise reply
        return result

    # ---- records -----------------------------------------------------------------------------

    async def read_records(self, namespace: str, keys: Sequence[RecordKey]) -> list[bytes | None]:
        """The records of ``keys``; raises PartlyUnavailable when a node did not answer."""
        read = await self.read_partly(namespace, keys)
        if read.unread:
            raise PartlyUnavailable(f"{len(read.unread)} of {len(keys)} records not read")
        return read.records

    async def read_partly(
        self, namespace: str, keys: Sequence[RecordKey], request_id: str | None = None
    ) -> Read:
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
        await self.run([*parts, *([claim] if claim is not None else [])], self.read_timeout)
        records: list[bytes | None] = []
        unread = set()
        for i, part in enumerate(parts):
            if _failed_part(part):
                unread.add(i)
                records.append(None)
            else:
                assert isinstance(part.result, list)
                records.append(part.result[0])
        digest = None
        if claim is not None and not _failed_part(claim):
            assert isinstance(claim.result, list)
            digest = stored_digest(claim.result[0])
        return Read(records, frozenset(unread), digest)

    def _claim_part(self, namespace: str, request_id: str | None) -> Part | None:
        """A GET of the statistics claim of ``request_id`` (the claim that counts it); None
        without an id, or for one that is not valid Unicode text (no claim of it can exist)."""
        if request_id is None:
            return None
        bucket = self._bucket_of(request_id)
        try:
            key = f"{self._bucket(namespace, bucket)}:claim:{request_id}".encode()
        except UnicodeEncodeError:
            return None
        return Part(self.bucket_slot(namespace, bucket), [command(b"GET", key)])

    # ---- writes ------------------------------------------------------------------------------

    async def record_many(
        self, namespace: str, request_ids: Sequence[str], update: StatsUpdate
    ) -> list[str] | None:
        """One request's write (at most one id: several requests of a write go through
        :meth:`record_requests`, which keeps each one's share apart)."""
        if len(request_ids) > 1:
            raise ValueError(
                "on a Redis Cluster a write counts each request in parts: write several "
                "requests with record_requests"
            )
        rid = request_ids[0] if request_ids else None
        request = RequestWrite(rid, tuple(update.records), update.tokens)

        async def refold(keys: Collection[RecordKey], keep: Sequence[int]) -> Records:
            return {k: update.records[k] for k in keys} if keep else {}

        (outcome,) = await self.record_requests(namespace, [request], update, refold)
        if outcome == COUNTED:
            return []
        if outcome == POISONED:
            raise Refused("the store refused the write")
        return None if outcome == LOST or rid is None else [rid]

    async def record_requests(
        self,
        namespace: str,
        requests: Sequence[RequestWrite],
        update: StatsUpdate,
        refold: Refold,
    ) -> list[Outcome]:
        """Write the records part by part (one per slot), then the statistics of the requests
        whose every part is written (one part per bucket): see :mod:`.redis_store`. A part
        refused as a whole (nothing applied) is written again in halves of its requests
        (:func:`.base.record_whole`'s rule, within its slot): the requests refused alone are
        ``poisoned``, their statistics not written."""
        store = self.store
        if store._skipping("record"):
            return [LOST] * len(requests)
        write = store.new_id()
        lock = store.new_id()
        start = time.perf_counter()
        outcomes: list[Outcome] = [LOST] * len(requests)
        try:
            done = await self._write_records(namespace, requests, update, refold, write)
            for i in done.poisoned:
                outcomes[i] = POISONED
            for i in done.conflicts:
                outcomes[i] = CONFLICT
            left_out = done.failed | done.poisoned | done.conflicts
            written = [i for i in range(len(requests)) if i not in left_out]
            compact = await self._write_statistics(
                namespace, requests, written, write, lock, outcomes
            )
        except (TimeoutError, RedisError, RedisClusterException, OSError) as exc:
            # (the cluster could not be reached at all: the store's backoff)
            store.unreachable("record", exc)
            return outcomes
        finally:
            if store._on_duration is not None:
                store._on_duration("record", time.perf_counter() - start)
        store._mark(True)
        if done.failed or LOST in outcomes or POISONED in outcomes:
            store.count_error("record")
        for bucket in compact:
            slot = self.bucket_slot(namespace, bucket)
            await store.compact_deltas(
                functools.partial(self.run_one, slot), self.delta_keys(namespace, bucket), lock
            )
        return outcomes

    async def _write_records(
        self,
        namespace: str,
        requests: Sequence[RequestWrite],
        update: StatsUpdate,
        refold: Refold,
        write: str,
    ) -> _Written:
        """Apply the records part by part; what became of the requests' parts."""
        records = dict(update.records)
        writers: dict[RecordKey, list[int]] = {}
        for i, request in enumerate(requests):
            for key in request.keys:
                writers.setdefault(key, []).append(i)
        by_slot: dict[int, _Pending] = {}
        for key in records:
            slot = self.record_slot(namespace, key)
            pending = by_slot.setdefault(slot, _Pending(slot, [], []))
            pending.keys.append(key)
        for pending in by_slot.values():
            pending.requests = sorted({i for key in pending.keys for i in writers.get(key, [])})
        done = _Written()
        refused: list[_Pending] = []
        todo = list(by_slot.values())
        # Each round leaves out one request of a part at least: it ends.
        while todo:
            sent, parts = [], []
            for pending in todo:
                try:
                    parts.append(self._record_part(namespace, pending, requests, records, write))
                except UnicodeEncodeError:  # (nothing sent)
                    refused.append(pending)
                    continue
                sent.append(pending)
            await self._run_parts(parts)
            again = []
            for pending, part in zip(sent, parts, strict=True):
                if _refused(part):
                    refused.append(pending)
                    continue
                reply = _script_reply(part)
                if reply is None:
                    done.failed.update(pending.requests)
                    continue
                if reply[0]:
                    continue
                left = self._claimed(pending.requests, requests, reply, done)
                if left is None:
                    done.failed.update(pending.requests)
                    continue
                pending.requests = left
                folded = await refold(pending.keys, pending.requests)
                records.update(folded)
                pending.keys = [key for key in pending.keys if key in folded]
                if pending.keys:
                    again.append(pending)
            todo = again
        for pending in refused:
            await self._split_records(namespace, pending, requests, writers, refold, write, done)
        return done

    def _claimed(
        self,
        members: list[int],
        requests: Sequence[RequestWrite],
        reply: list[Any],
        done: _Written,
    ) -> list[int] | None:
        """``members`` without the requests a part's reply found claimed (those claimed for
        another body added to ``done.conflicts``); None for a reply that names none of them."""
        ids = [rid for i in members if (rid := requests[i].request_id) is not None]
        positions = [int(p) for p in reply[3:]]
        claimed = {ids[p - 1] for p in positions if 0 < p <= len(ids)}
        other = {ids[-p - 1] for p in positions if 0 < -p <= len(ids)}
        if not claimed and not other:
            return None
        done.conflicts.update(i for i in members if requests[i].request_id in other)
        return [i for i in members if requests[i].request_id not in claimed | other]

    async def _split_records(
        self,
        namespace: str,
        pending: _Pending,
        requests: Sequence[RequestWrite],
        writers: dict[RecordKey, list[int]],
        refold: Refold,
        write: str,
        done: _Written,
    ) -> None:
        """A part refused as a whole (nothing of it applied): its requests written again in
        halves, one after the other, each half's records folded again on top of the requests
        of the part written before it; a request refused alone is poisoned."""
        written: list[int] = []
        tries = itertools.count(1)

        async def attempt(members: list[int]) -> None:
            while members:
                chosen = set(members)
                keys = [k for k in pending.keys if chosen.intersection(writers.get(k, ()))]
                folded = await refold(keys, sorted({*written, *members}))
                sub = _Pending(pending.slot, [k for k in keys if k in folded], members)
                if not sub.keys:
                    written.extend(members)
                    return
                # (a write id of its own: the part's id marks a part applied in this slot)
                part: Part | None
                try:
                    part = self._record_part(
                        namespace, sub, requests, folded, f"{write}.{next(tries)}"
                    )
                except UnicodeEncodeError:
                    part = None
                else:
                    await self._run_parts([part])
                if part is None or _refused(part):
                    if len(members) == 1:
                        done.poisoned.add(members[0])
                        return
                    half = len(members) // 2
                    await attempt(members[:half])
                    await attempt(members[half:])
                    return
                reply = _script_reply(part)
                if reply is None:
                    done.failed.update(members)
                    return
                if reply[0]:
                    written.extend(members)
                    return
                left = self._claimed(members, requests, reply, done)
                if left is None:
                    done.failed.update(members)
                    return
                members = left

        await attempt(list(pending.requests))

    def _record_part(
        self,
        namespace: str,
        pending: _Pending,
        requests: Sequence[RequestWrite],
        records: dict[RecordKey, bytes],
        write: str,
    ) -> Part:
        """The commands of a part of the records; raises UnicodeEncodeError for a key or
        request id that is not valid Unicode text."""
        base = self._in_slot(pending.slot, namespace)
        commands: Commands = []
        pairs: list[bytes] = []
        stage_ms = self.store.stage_ms
        staged_ok = self.store.staged
        for i, key in enumerate(pending.keys):
            staged = f"{base}:stage:{write}:{i}".encode()
            if staged_ok is None or staged_ok(namespace, key):
                commands.append(command(b"SET", staged, records[key], b"PX", stage_ms))
            pairs += [staged, self.record_key(namespace, key)]
        members = [requests[i] for i in pending.requests if requests[i].request_id is not None]
        keys = [
            f"{base}:write:{write}".encode(),
            *(f"{base}:claim:{r.request_id}".encode() for r in members),
            *pairs,
        ]
        digests = [r.digest for r in members]
        by_digest, by_text = self._commit(keys, write, digests, delta=False, lock="")
        return Part(pending.slot, [*commands, by_digest], fallback=by_text)

    def _commit(
        self, keys: list[bytes], write: str, digests: list[str | None], *, delta: bool, lock: str
    ) -> tuple[list[bytes], list[bytes]]:
        """The commit script's command by its digest (a write has a part per slot it touches,
        and the script's text would travel with each), and by its text (for a node that does
        not know it yet: see :meth:`_run_parts`). ``digests``: those of the claims, in order."""
        store = self.store
        args = [write.encode(), b"%d" % store.ttl_seconds, b"%d" % store.ttl_seconds]
        args += [b"%d" % len(digests), b"%d" % ANONYMOUS_CLAIM_TTL, b"1" if delta else b"0"]
        args += [b"%d" % store.compact_after, lock.encode(), b"%d" % store.lock_ms]
        args += [claim_digest(digest) for digest in digests]
        tail = [b"%d" % len(keys), *keys, *args]
        return command(b"EVALSHA", COMMIT_PART_SHA, *tail), command(b"EVAL", COMMIT_PART, *tail)

    async def _run_parts(self, parts: Sequence[Part]) -> None:
        """:meth:`run` for parts that end with the commit script; those sent to a node that had
        not loaded it (NOSCRIPT: nothing of them applied) go again with the script's text."""
        await self.run(parts)
        unknown = []
        for part in parts:
            result = part.result
            if isinstance(result, list) and result and isinstance(result[-1], NoScriptError):
                assert part.fallback is not None
                part.commands[-1] = part.fallback
                unknown.append(part)
        if unknown:
            await self.run(unknown)

    async def _write_statistics(
        self,
        namespace: str,
        requests: Sequence[RequestWrite],
        written: list[int],
        write: str,
        lock: str,
        outcomes: list[Outcome],
    ) -> list[int]:
        """Count the statistics of the ``written`` requests, one part per bucket (setting
        their ``outcomes``); the buckets whose compaction lock this write now holds. A bucket's
        part refused as a whole is written again in halves of its requests, as records are."""
        by_bucket: dict[int, list[int]] = {}
        for i in written:
            rid = requests[i].request_id
            bucket = self._bucket_of(rid if rid is not None else write)
            by_bucket.setdefault(bucket, []).append(i)
        compact: list[int] = []
        refused: list[tuple[int, list[int]]] = []
        todo = dict(by_bucket)
        while todo:
            order = list(todo)
            groups = [[requests[i].tokens for i in todo[b]] for b in order]
            tables = await asyncio.to_thread(_merge_each, groups)
            parts: list[Part | None] = []
            for b, table in zip(order, tables, strict=True):
                try:
                    parts.append(
                        self._statistics_part(
                            namespace, b, table, [requests[i] for i in todo[b]], write, lock
                        )
                    )
                except UnicodeEncodeError:  # (nothing sent)
                    parts.append(None)
            await self._run_parts([p for p in parts if p is not None])
            again: dict[int, list[int]] = {}
            for bucket, part in zip(order, parts, strict=True):
                members = todo[bucket]
                if part is None or _refused(part):
                    refused.append((bucket, members))
                    continue
                rest = self._counted(members, requests, part, outcomes, compact, bucket)
                if rest:
                    again[bucket] = rest
            todo = again
        tries = itertools.count(1)

        async def attempt(bucket: int, members: list[int]) -> None:
            while members:
                table = await asyncio.to_thread(
                    merge_token_stats, [requests[i].tokens for i in members]
                )
                part: Part | None
                try:
                    part = self._statistics_part(
                        namespace,
                        bucket,
                        table,
                        [requests[i] for i in members],
                        f"{write}.s{next(tries)}",
                        lock,
                    )
                except UnicodeEncodeError:
                    part = None
                else:
                    await self._run_parts([part])
                if part is None or _refused(part):
                    if len(members) == 1:
                        outcomes[members[0]] = POISONED
                        return
                    half = len(members) // 2
                    await attempt(bucket, members[:half])
                    await attempt(bucket, members[half:])
                    return
                members = self._counted(members, requests, part, outcomes, compact, bucket)

        for bucket, members in refused:
            await attempt(bucket, members)
        return compact

    def _counted(
        self,
        members: list[int],
        requests: Sequence[RequestWrite],
        part: Part,
        outcomes: list[Outcome],
        compact: list[int],
        bucket: int,
    ) -> list[int]:
        """Set the outcomes of a statistics part's ``members`` from its reply; those to write
        again (the part applied nothing, some of its ids being claimed before)."""
        reply = _script_reply(part)
        if reply is None:
            return []  # (their outcome stays LOST)
        if reply[0]:
            for i in members:
                outcomes[i] = COUNTED
            if reply[2] and bucket not in compact:
                compact.append(bucket)
            return []
        ids = [rid for i in members if (rid := requests[i].request_id) is not None]
        positions = [int(p) for p in reply[3:]]
        claimed = {ids[p - 1] for p in positions if 0 < p <= len(ids)}
        other = {ids[-p - 1] for p in positions if 0 < -p <= len(ids)}
        for i in members:
            rid = requests[i].request_id
            if rid in claimed:
                outcomes[i] = DUPLICATE
            elif rid in other:
                outcomes[i] = CONFLICT
        rest = [i for i in members if requests[i].request_id not in claimed | other]
        return rest if len(rest) < len(members) else []

    def _statistics_part(
        self,
        namespace: str,
        bucket: int,
        table: TokenStatsUpdate,
        members: list[RequestWrite],
        write: str,
        lock: str,
    ) -> Part:
        keys = self.delta_keys(namespace, bucket)
        base = self._bucket(namespace, bucket)
        staged = f"{base}:stage:{write}:d".encode()
        claims = [r for r in members if r.request_id is not None]
        commands = [
            command(b"RPUSH", staged, encode_token_stats(table)),
            command(b"PEXPIRE", staged, self.store.stage_ms),
        ]
        script_keys = [
            f"{base}:write:{write}".encode(),
            *(f"{base}:claim:{r.request_id}".encode() for r in claims),
            keys.delta,
            keys.compacted,
            keys.lock,
            staged,
        ]
        digests = [r.digest for r in claims]
        by_digest, by_text = self._commit(script_keys, write, digests, delta=True, lock=lock)
        return Part(self.bucket_slot(namespace, bucket), [*commands, by_digest], fallback=by_text)

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
        await self.run(parts, self.read_timeout)
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


Records = dict[RecordKey, bytes]
ASKING = command(b"ASKING")


def _redirect(result: list[Any] | BaseException | None) -> AskError | None:
    """The first MOVED or ASK reply among a part's replies."""
    if isinstance(result, list):
        for reply in result:
            if isinstance(reply, AskError):  # (MovedError is an AskError)
                return reply
    return None


def _merge_each(groups: list[list[TokenStatsUpdate]]) -> list[TokenStatsUpdate]:
    return [merge_token_stats(tables) for tables in groups]


def _failed_part(part: Part) -> bool:
    result = part.result
    return not isinstance(result, list) or any(isinstance(r, BaseException) for r in result)


def _refused(part: Part) -> bool:
    """True when a part's commit script refused it as a whole (nothing applied): what it
    staged was not all there."""
    result = part.result
    return isinstance(result, list) and bool(result) and is_refusal(result[-1])


def _script_reply(part: Part) -> list[Any] | None:
    """The reply of a part's commit script; None when the part failed, or when the reply is
    not one the script gives (at least three integers: a reply that was another command's would
    otherwise count a request as written, or as counted before, that was not)."""
    result = part.result
    if not isinstance(result, list) or not result:
        return None
    reply = result[-1]
    if isinstance(reply, list) and len(reply) >= 3 and all(isinstance(x, int) for x in reply):
        return reply
    return None


def _part_ids(pending: _Pending, requests: Sequence[RequestWrite]) -> list[str]:
    return [rid for i in pending.requests if (rid := requests[i].request_id) is not None]


__all__ = ["DEFAULT_BUCKETS", "ClusterLayout", "slot_tags"]
