"""What the Redis stats store shares between one Redis and a Redis Cluster: its settings and
reachability (:class:`Reachability`, within :class:`RedisContext`: the backoff after a
failure, the callbacks; the viewer's keep uses it too), RESP commands
as socket buffers, and the compaction of statistics deltas (its script and its rounds). The
layouts are in :mod:`.redis_single` (one Redis) and :mod:`.redis_cluster` (a cluster), chosen
by :mod:`.redis_layout`."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
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
# staged(namespace, key): False leaves that record unstaged (a seam for tests, see RedisContext).
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


@dataclass
class Backoff:
    """How long to leave a Redis node alone after a failure: ``initial`` seconds after the first,
    doubling up to ``maximum`` while it keeps failing, none once it answers. The store's (one
    Redis, or a whole cluster), each cluster node's and the viewer's keep use this one rule."""

    initial: float = 0.25
    maximum: float = 4.0
    retry_at: float = 0.0
    # The wait after the next failure (unset: ``initial``).
    backoff: float = field(default=-1.0)

    def __post_init__(self) -> None:
        if self.backoff < 0:
            self.backoff = self.initial

    @property
    def waiting(self) -> bool:
        """True while in the interval after a failure: no attempt now."""
        return time.monotonic() < self.retry_at

    @property
    def left(self) -> float:
        """Seconds until the interval after a failure ends (0: none now)."""
        return max(0.0, self.retry_at - time.monotonic())

    @property
    def failing(self) -> bool:
        """True from a failure until the next answer."""
        return self.retry_at > 0.0

    def failed(self) -> None:
        self.retry_at = time.monotonic() + self.backoff
        self.backoff = min(self.backoff * 2, self.maximum)

    def answered(self) -> None:
        self.backoff, self.retry_at = self.initial, 0.0


@dataclass(frozen=True)
class DeltaKeys:
    """The keys of one statistics table: pending deltas, the compacted record, the compaction
    lock, and the prefix of what a compaction stages (all in one slot)."""

    delta: bytes
    compacted: bytes
    lock: bytes
    stage: str


class Reachability:
    """Whether a Redis answers, as of the last operations: the backoff after a failure (no
    attempt for its interval) and the callbacks. The stats store's (:class:`RedisContext`) and
    the viewer's keep use this one rule. ``name`` names the user in log lines; ``up``: as
    assumed before the first operation (a change of it is logged, the first failure included
    when True)."""

    def __init__(
        self,
        *,
        name: str,
        backoff_initial: float,
        backoff_max: float,
        on_error: OnError | None = None,
        on_duration: OnDuration | None = None,
        on_up: OnUp | None = None,
        up: bool = False,
    ) -> None:
        self.name = name
        self.backoff = Backoff(backoff_initial, backoff_max)
        self.up = up
        self._on_error = on_error
        self._on_duration = on_duration
        self._on_up = on_up

    def mark(self, up: bool) -> None:
        """Redis answered (``up``) or could not be reached: the backoff, and ``on_up`` when
        reachability changed."""
        if up:
            self.backoff.answered()
        else:
            self.backoff.failed()
        if up != self.up:
            self.up = up
            if up:
                log.info("%s: Redis reachable", self.name)
            if self._on_up is not None:
                self._on_up(up)

    def skipping(self, op: str) -> bool:
        """True (and counted) while in backoff after a failure: no attempt, no encoding."""
        if self.backoff.waiting:
            self.count_error(op)
            return True
        return False

    def unreachable(self, op: str, exc: BaseException) -> None:
        """``op`` did not reach Redis: counted, and the backoff starts."""
        if self.up:
            log.warning("%s: Redis unreachable (%s: %s)", self.name, op, exc)
        self.mark(False)
        self.count_error(op)

    def count_error(self, op: str) -> None:
        if self._on_error is not None:
            self._on_error(op)

    @contextlib.contextmanager
    def timed(self, op: str) -> Iterator[None]:
        """Report the wall time of an attempted ``op`` (``on_duration``), however it ends."""
        start = time.perf_counter()
        try:
            yield
        finally:
            if self._on_duration is not None:
                self._on_duration(op, time.perf_counter() - start)

    @property
    def writable(self) -> bool:
        return not self.backoff.waiting

    async def call(self, op: str, fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``fn`` against Redis, or raise Unavailable (counted, with backoff)."""
        if self.skipping(op):
            raise Unavailable(op)
        with self.timed(op):
            try:
                result = await fn()
            except (ResponseError, PartlyUnavailable) as exc:
                # Redis answered, with an error: this operation failed (e.g. "OOM command not
                # allowed" once maxmemory is reached and nothing more can be evicted), but Redis
                # is up, so there is no backoff: reads (never refused for memory) go on. The
                # same for a cluster of which only some masters answered.
                log.warning("%s: Redis refused %s: %s", self.name, op, exc)
                self.mark(True)
                self.count_error(op)
                raise Unavailable(op) from exc
            except (TimeoutError, RedisError, RedisClusterException, OSError) as exc:
                self.unreachable(op, exc)
                raise Unavailable(op) from exc
        self.mark(True)
        return result


class RedisContext(Reachability):
    """The settings and the reachability the store and its layout share (see
    :class:`.RedisStatsStore`): each layout is handed this one object, and reports through it
    what reached Redis and what did not."""

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
        super().__init__(
            name="stats store",
            backoff_initial=backoff_initial,
            backoff_max=backoff_max,
            on_error=on_error,
            on_duration=on_duration,
            on_up=on_up,
        )
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
        self._on_round_trip = on_round_trip
        # Pipelines sent to Redis nodes (one per node an operation touches).
        self.round_trips = 0

    def count_round_trip(self) -> None:
        self.round_trips += 1
        if self._on_round_trip is not None:
            self._on_round_trip()

    def staged_in(self, namespace: str) -> Callable[[RecordKey], bool] | None:
        """The ``staged`` seam for one namespace's records."""
        return None if self.staged is None else functools.partial(self.staged, namespace)

    @property
    def stage_ms(self) -> bytes:
        return b"%d" % min(STAGE_MS, 1000 * self.ttl_seconds)

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
                if not await self.call("compact", functools.partial(run, last_round)):
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


__all__ = [
    "ANONYMOUS_CLAIM_TTL",
    "COMPACT_ROUNDS",
    "DEFAULT_COMPACT_AFTER",
    "DEFAULT_LOCK_MS",
    "DIGEST_CHARS",
    "REFUSAL",
    "STAGE_MS",
    "Backoff",
    "DeltaKeys",
    "PartlyUnavailable",
    "Reachability",
    "RedisContext",
    "Staged",
    "Unavailable",
    "claim_digest",
    "command",
    "is_refusal",
    "merge_records",
    "merge_tables",
    "stored_digest",
]
