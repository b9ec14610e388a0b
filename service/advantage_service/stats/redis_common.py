"""What the Redis stats store shares between one Redis and a Redis Cluster: reachability (the
backoff after a failure, the callbacks), RESP commands as socket buffers, and the compaction of
statistics deltas (its script and its rounds). The layouts are in :mod:`.redis_store` (one
Redis) and :mod:`.redis_cluster` (a cluster)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from redis.exceptions import RedisClusterException, RedisError, ResponseError

from .base import OnDuration, OnError, OnUp, RecordKey
from .blobs import TokenStatsUpdate, decode_token_stats, encode_token_stats, merge_token_stats

log = logging.getLogger("advantage_service.stats.redis_store")

# What a write stages expires after a minute if its commit never comes.
STAGE_MS = 60_000
# Claims of writes without a request id only guard against resends of their own pipeline.
ANONYMOUS_CLAIM_TTL = 300
DEFAULT_COMPACT_AFTER = 8
DEFAULT_LOCK_MS = 30_000
COMPACT_ROUNDS = 8
# Arguments longer than this go to the socket as their own buffer, not copied into the command.
INLINE_ARG_BYTES = 1 << 16

T = TypeVar("T")
Commands = list[list[bytes]]
Execute = Callable[[Commands], Awaitable[list[Any]]]
# staged(namespace, key): False leaves that record unstaged (a seam for tests, see RedisBase).
Staged = Callable[[str, RecordKey], bool]

# The error a commit script answers when what the write staged is not all there (nothing
# applied: the caller writes the requests again in smaller groups).
REFUSAL = "ADVREFUSED"
# A claim's value: the claim of the write that made it, then "|" and the digest of its request
# (DIGEST_CHARS hex characters) when the request has one; an earlier release's claims have none.
DIGEST_CHARS = 32

# KEYS: 1 toklock, 2 staged record, 3 tokstats, 4 tokdelta. ARGV: 1 lock value, 2 deltas
# merged, 3 TTL, 4 compact after, 5 lock ms. Answers {committed, 1 when the caller keeps the
# lock to go on (compact_after or more deltas still pending)}; {0, 0} (nothing changed) when the
# lock is no longer the caller's.
COMMIT_COMPACTION = b"""
if redis.call('GET', KEYS[1]) ~= ARGV[1] or redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('DEL', KEYS[2])
  return {0, 0}
end
redis.call('RENAME', KEYS[2], KEYS[3])
redis.call('EXPIRE', KEYS[3], ARGV[3])
redis.call('LTRIM', KEYS[4], ARGV[2], -1)
if redis.call('LLEN', KEYS[4]) >= tonumber(ARGV[4]) then
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
  return {1, 1}
end
redis.call('DEL', KEYS[1])
return {1, 0}
"""


class Unavailable(Exception):
    """The operation did not reach Redis (it failed, or the store is in backoff)."""


class PartlyUnavailable(Exception):
    """Part of a Redis Cluster did not answer (a master down, a slot moving): the operation
    failed, the rest of the cluster is up (no backoff)."""


@dataclass(frozen=True)
class DeltaKeys:
    """The keys of one statistics table: pending deltas, the compacted record, the compaction
    lock, and the prefix of what a compaction stages (all in one slot)."""

    delta: bytes
    compacted: bytes
    lock: bytes
    stage: str


class RedisBase:
    """Reachability and the settings both layouts share (see :class:`.RedisStatsStore`)."""

    def __init__(
        self,
        *,
        prefix: str,
        ttl_seconds: int,
        backoff_initial: float,
        backoff_max: float,
        compact_after: int,
        lock_ms: int,
        on_error: OnError | None,
        on_duration: OnDuration | None,
        on_up: OnUp | None,
        on_round_trip: Callable[[], None] | None,
        merge: Callable[[list[bytes | None]], bytes] | None,
        new_id: Callable[[], str] | None,
        staged: Staged | None = None,
    ) -> None:
        # merge and new_id are seams for the race tests: a compaction that merges slowly, a
        # write pipeline resent with the same claim. staged is one for the tests of a write the
        # commit script refuses: a record it leaves unstaged is missing at the commit, as one
        # whose SET Redis refused or evicted would be.
        self.merge = merge if merge is not None else merge_records
        self.new_id = new_id if new_id is not None else (lambda: uuid.uuid4().hex)
        self.staged = staged
        self.prefix = prefix
        self.ttl_seconds = int(ttl_seconds)
        self.compact_after = max(1, int(compact_after))
        self.lock_ms = int(lock_ms)
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._backoff = backoff_initial
        self._retry_at = 0.0
        self._up = False
        self._on_error = on_error
        self._on_duration = on_duration
        self._on_up = on_up
        self._on_round_trip = on_round_trip
        # Pipelines sent to Redis nodes (one per node an operation touches).
        self.round_trips = 0

    def count_round_trip(self) -> None:
        self.round_trips += 1
        if self._on_round_trip is not None:
            self._on_round_trip()

    @property
    def stage_ms(self) -> bytes:
        return b"%d" % min(STAGE_MS, 1000 * self.ttl_seconds)

    # ---- reachability ------------------------------------------------------------------------

    def _mark(self, up: bool) -> None:
        if up:
            self._backoff, self._retry_at = self._backoff_initial, 0.0
        else:
            self._retry_at = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, self._backoff_max)
        if up != self._up:
            self._up = up
            if up:
                log.info("stats store: Redis reachable")
            if self._on_up is not None:
                self._on_up(up)

    def _skipping(self, op: str) -> bool:
        """True (and counted) while in backoff after a failure: no attempt, no encoding."""
        if time.monotonic() < self._retry_at:
            self.count_error(op)
            return True
        return False

    def unreachable(self, op: str, exc: BaseException) -> None:
        """``op`` did not reach Redis: counted, and the store's backoff starts."""
        if self._up:
            log.warning("stats store: Redis unreachable (%s: %s)", op, exc)
        self._mark(False)
        self.count_error(op)

    def count_error(self, op: str) -> None:
        if self._on_error is not None:
            self._on_error(op)

    @property
    def writable(self) -> bool:
        return time.monotonic() >= self._retry_at

    async def _call(self, op: str, fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``fn`` against Redis, or raise Unavailable (counted, with backoff)."""
        if self._skipping(op):
            raise Unavailable(op)
        start = time.perf_counter()
        try:
            result = await fn()
        except (ResponseError, PartlyUnavailable) as exc:
            # Redis answered, with an error: this operation failed (e.g. "OOM command not
            # allowed" once maxmemory is reached and nothing more can be evicted), but Redis is
            # up, so there is no backoff: reads (never refused for memory) go on. The same for
            # a cluster of which only some masters answered.
            log.warning("stats store: Redis refused %s: %s", op, exc)
            self._mark(True)
            self.count_error(op)
            raise Unavailable(op) from exc
        except (TimeoutError, RedisError, RedisClusterException, OSError) as exc:
            self.unreachable(op, exc)
            raise Unavailable(op) from exc
        finally:
            if self._on_duration is not None:
                self._on_duration(op, time.perf_counter() - start)
        self._mark(True)
        return result

    # ---- compaction --------------------------------------------------------------------------

    async def compact_deltas(self, execute: Execute, keys: DeltaKeys, lock: str) -> None:
        """Merge the pending deltas of ``keys`` into their compacted record, holding the lock
        ``lock`` (``execute`` sends commands to the node of their slot: one round trip)."""
        # At most 2 * compact_after deltas at once (a backlog left by a dead compactor is
        # worked off over the next writes), so that one compaction's memory stays bounded.
        last = b"%d" % (2 * self.compact_after - 1)
        reads = [command(b"GET", keys.compacted), command(b"LRANGE", keys.delta, b"0", last)]

        async def run(last_round: bool) -> bool:
            current, deltas = await execute(reads)
            merged = await asyncio.to_thread(self.merge, [current, *deltas])
            staged = f"{keys.stage}:{lock}:c".encode()
            script_keys = [keys.lock, staged, keys.compacted, keys.delta]
            go_on_at = 2**62 if last_round else self.compact_after
            args = [lock.encode(), b"%d" % len(deltas), b"%d" % self.ttl_seconds]
            args += [b"%d" % go_on_at, b"%d" % self.lock_ms]
            _, (_, go_on) = await execute(
                [
                    command(b"SET", staged, merged, b"PX", self.stage_ms),
                    command(b"EVAL", COMMIT_COMPACTION, b"4", *script_keys, *args),
                ]
            )
            return bool(go_on)

        # While writes race ahead, go on with the lock, a few rounds per call at most. On
        # failure the deltas stay pending; the lock expires after lock_ms.
        with contextlib.suppress(Unavailable):
            for round_ in range(COMPACT_ROUNDS):
                last_round = round_ == COMPACT_ROUNDS - 1
                if not await self._call("compact", functools.partial(run, last_round)):
                    break


def merge_tables(records: list[bytes | None]) -> TokenStatsUpdate:
    """The sum of statistics records (absent or foreign ones count as empty)."""
    return merge_token_stats([t for t in map(decode_token_stats, records) if t is not None])


def merge_records(records: list[bytes | None]) -> bytes:
    return encode_token_stats(merge_tables(records))


def claim_digest(digest: str | None) -> bytes:
    """A request's digest as a commit script's argument (empty: none, or not one of ours)."""
    if digest is None or len(digest) != DIGEST_CHARS or not digest.isascii():
        return b""
    return digest.encode()


def stored_digest(value: Any) -> str | None:
    """The digest a claim's value keeps (None: no claim, or one without a digest)."""
    if not isinstance(value, bytes) or len(value) <= DIGEST_CHARS + 1:
        return None
    if value[-DIGEST_CHARS - 1 : -DIGEST_CHARS] != b"|":
        return None
    return value[-DIGEST_CHARS:].decode("ascii", "replace")


def is_refusal(reply: Any) -> bool:
    """True for the error a commit script answers when what was staged is not all there."""
    return isinstance(reply, ResponseError) and str(reply).startswith(REFUSAL)


def command(*args: bytes) -> list[bytes]:
    """One RESP command as buffers for the socket; long arguments stay their own buffer."""
    out: list[bytes] = []
    small = [b"*%d\r\n" % len(args)]
    for arg in args:
        if len(arg) > INLINE_ARG_BYTES:
            small.append(b"$%d\r\n" % len(arg))
            out += [b"".join(small), arg]
            small = [b"\r\n"]
        else:
            small.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    out.append(b"".join(small))
    return out


# The Lua both commit scripts (redis_store.COMMIT_WRITE, redis_cluster.COMMIT_PART) begin with:
# ``claims(first, last, at, base)`` looks up the claims KEYS[first..last]; each request id found
# claimed adds ``i - base`` (its 1-based position), or ``base - i`` when the claim keeps another
# digest than ARGV[at + i] (a conflict). A claim is the write's claim, then '|' and the request's
# 32-hex-digit digest when it has one (earlier releases wrote none: never a conflict).
LUA_CLAIMS = b"""
local function digest_of(value)
  if type(value) == 'string' and #value > 33 and string.sub(value, -33, -33) == '|' then
    return string.sub(value, -32)
  end
  return ''
end
local function claims(first, last, at, base)
  local claimed = {0, 0, 0}
  for i = first, last do
    if redis.call('EXISTS', KEYS[i]) == 1 then
      local stored = digest_of(redis.pcall('GET', KEYS[i]))
      local digest = ARGV[at + i]
      if stored ~= '' and digest ~= '' and stored ~= digest then
        claimed[#claimed + 1] = base - i
      else
        claimed[#claimed + 1] = i - base
      end
    end
  end
  return claimed
end
"""

__all__ = [
    "ANONYMOUS_CLAIM_TTL",
    "COMPACT_ROUNDS",
    "DEFAULT_COMPACT_AFTER",
    "DEFAULT_LOCK_MS",
    "DIGEST_CHARS",
    "LUA_CLAIMS",
    "REFUSAL",
    "STAGE_MS",
    "DeltaKeys",
    "PartlyUnavailable",
    "RedisBase",
    "Staged",
    "Unavailable",
    "claim_digest",
    "command",
    "is_refusal",
    "merge_records",
    "merge_tables",
    "stored_digest",
]
