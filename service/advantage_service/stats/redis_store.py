"""The Redis stats store: shared by every replica, survives restarts of the service.

Layout (``P`` = prefix, ``{N}`` = the namespace percent-encoded, in braces so that a Redis
Cluster keeps a namespace's keys in one slot, which multi-key scripts need):

- ``P:{N}:hist:<prompt id>``: hash, KTAE history of one prompt. Field ``t``: totals n_c, n_w,
  len_c, len_w, clock; field ``<token id>`` (decimal): a, b, occ_c, occ_w, clock at write. Each
  value is 5 little-endian float64 (40 bytes).
- ``P:{N}:tok:<stat>``: hashes, field ``<token id>``, for the stats ``correct``, ``wrong``,
  ``occ``, ``key_sum``, ``key_n``, ``sens_sum``, ``sens_n`` (HINCRBY / HINCRBYFLOAT counters).
- ``P:{N}:meta``: hash, field ``rollouts`` (rollouts counted).
- ``P:{N}:req:<request id>``: hash, the idempotency claim of a counted request (field
  ``claim``) and the ids of its write chunks already applied. ``P:{N}:write:<random>``: the same
  for a request without an id, kept five minutes (it only guards against resends).

Every write sets the key's TTL. Round trips: a request with history makes exactly two, one
pipeline to read (per prompt one HMGET of the totals and the group's own tokens) and one to write;
a request without history makes one (the write). The write pipeline starts with a claim of the
request id (HSETNX, random claim value) and every write script checks the claim first, so the
idempotency decision costs no extra round trip, a request whose writes never reached Redis is not
marked as counted, and a pipeline resent after a broken connection applies each chunk once.
The increments run in a small Lua script per hash and chunk of a few thousand fields; no script
holds the server for more than a few tens of milliseconds, so other clients (replicas' reads)
interleave between them.

A pipeline of this size (hundreds of thousands of arguments) is encoded to RESP with numpy
(:class:`_Text`) and sent in one write on a pooled connection (:meth:`RedisStatsStore._execute`):
redis-py's per-argument packing would take longer than Redis takes to execute it. That encoding
and the decoding of replies run in a worker thread, off the event loop.

Cost: Redis work per request grows with the distinct (prompt, token) pairs (history: one HMGET
field to read and one HSET field to write each) and the distinct token ids (statistics: up to
7 hash increments each); ``bench/bench_stats.py`` measures it on the training-sized batch.

Outage: reads and pings use a short socket timeout, writes (which run after the response) a
longer one; a broken pooled connection is retried once at once (a restarted Redis), nothing else
is retried. After a failure the store answers "unreachable" at once (reads None, writes False)
for a backoff interval that doubles from ``backoff_initial`` up to ``backoff_max``, then tries
again; the connection pools reconnect by themselves, so no restart is needed.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import quote

import numpy as np
import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from .base import (
    ROW_BYTES,
    ROW_DTYPE,
    ROW_FIELDS,
    HistoryPrior,
    HistoryQuery,
    OnDuration,
    OnError,
    OnUp,
    StatsUpdate,
    StoreStatus,
    check_order,
    token_stats_response,
)
from .memory import DEFAULT_TTL_SECONDS

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "adv"
# Rows (history) and pairs (statistics) per write script: a few milliseconds of server time each.
HISTORY_CHUNK = 16_384
STATS_CHUNK = 4_096
TOTALS_FIELD = b"t"
# Claims of writes without a request id only guard against resends of their own pipeline.
ANONYMOUS_CLAIM_TTL = 300
EMPTY_ROW = bytes(ROW_BYTES)
# Hash name, TokenStatsUpdate field, increment command of each statistic.
STATS = (
    ("correct", "correct", b"HINCRBY"),
    ("wrong", "wrong", b"HINCRBY"),
    ("occ", "occurrences", b"HINCRBY"),
    ("key_sum", "key_sum", b"HINCRBYFLOAT"),
    ("key_n", "key_count", b"HINCRBY"),
    ("sens_sum", "sens_sum", b"HINCRBYFLOAT"),
    ("sens_n", "sens_count", b"HINCRBY"),
)
STAT_KEYS = tuple(name for name, _, _ in STATS)

# The write pipeline is idempotent: CLAIM takes the request (or finds it already taken by this
# very claim, on a retry), and each chunk script applies only under its claim and only once
# (HSETNX of the chunk's id in the claim hash). So a pipeline resent after a broken connection
# never counts anything twice, and a request someone else counted counts nothing.

# KEYS[1] claim hash; ARGV: claim, ttl. 1 when the request is this claim's to count.
CLAIM = b"""
if redis.call('HSETNX', KEYS[1], 'claim', ARGV[1]) == 1 then
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  return 1
end
if redis.call('HGET', KEYS[1], 'claim') == ARGV[1] then return 1 end
return 0
"""

# Every chunk script starts with this: ARGV[1] claim, ARGV[3] the chunk's id.
_ONCE_UNDER_CLAIM = b"""
if redis.call('HGET', KEYS[1], 'claim') ~= ARGV[1] then return 0 end
if redis.call('HSETNX', KEYS[1], ARGV[3], 1) == 0 then return 1 end
"""

# KEYS[1] claim, KEYS[2] prompt hash; ARGV: claim, ttl, chunk id, then field, value pairs.
WRITE_HISTORY = (
    _ONCE_UNDER_CLAIM
    + b"""
for i = 4, #ARGV, 4000 do
  redis.call('HSET', KEYS[2], unpack(ARGV, i, math.min(#ARGV, i + 3999)))
end
redis.call('EXPIRE', KEYS[2], ARGV[2])
return 1
"""
)

# KEYS[1] claim, KEYS[2] a hash; ARGV: claim, ttl, chunk id, HINCRBY or HINCRBYFLOAT, then
# field, increment pairs.
INCREMENT = (
    _ONCE_UNDER_CLAIM
    + b"""
local command = ARGV[4]
for i = 5, #ARGV, 2 do redis.call(command, KEYS[2], ARGV[i], ARGV[i + 1]) end
redis.call('EXPIRE', KEYS[2], ARGV[2])
return 1
"""
)

T = TypeVar("T")


class _Unavailable(Exception):
    """The operation did not reach Redis (it failed, or the store is in backoff)."""


class RedisStatsStore:
    """The Redis :class:`~advantage_service.stats.base.StatsStore` (redis-py asyncio, hiredis).

    ``on_error(op)``: an operation failed or was skipped during backoff; ``on_duration(op, s)``:
    an attempted operation's wall time; ``on_up(bool)``: reachability changed. ``op`` is one of
    ``read_history``, ``record``, ``token_stats``, ``ping``. Status is ``down`` until the first
    successful operation (call :meth:`ping` at startup). ``socket_timeout`` bounds every socket
    operation of reads and pings (a hung Redis costs a request at most that); ``write_timeout``
    those of writes, which run after the response and may carry megabytes. Extra keyword
    arguments go to ``redis.asyncio.Redis.from_url``.
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
        on_error: OnError | None = None,
        on_duration: OnDuration | None = None,
        on_up: OnUp | None = None,
        **redis_kwargs: Any,
    ) -> None:
        self.prefix = prefix
        self.ttl_seconds = int(ttl_seconds)
        options = {
            "socket_connect_timeout": connect_timeout,
            # One immediate retry on a broken connection (a pooled socket that died with a
            # restarted Redis); none on timeouts. Safe for writes too: the pipeline is idempotent.
            "retry": Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            "decode_responses": False,
            **redis_kwargs,
        }
        self._client = redis.Redis.from_url(url, socket_timeout=socket_timeout, **options)
        self._writer = redis.Redis.from_url(url, socket_timeout=write_timeout, **options)
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._backoff = backoff_initial
        self._retry_at = 0.0
        self._up = False
        self._on_error = on_error
        self._on_duration = on_duration
        self._on_up = on_up

    # ---- keys ------------------------------------------------------------------------------

    def _ns(self, namespace: str) -> str:
        return f"{self.prefix}:{{{quote(namespace, safe='')}}}"

    def history_key(self, namespace: str, prompt_id: str) -> str:
        return f"{self._ns(namespace)}:hist:{prompt_id}"

    def stat_keys(self, namespace: str) -> list[str]:
        return [f"{self._ns(namespace)}:tok:{name}" for name in STAT_KEYS]

    def meta_key(self, namespace: str) -> str:
        return f"{self._ns(namespace)}:meta"

    def request_key(self, namespace: str, request_id: str) -> str:
        return f"{self._ns(namespace)}:req:{request_id}"

    # ---- reachability ------------------------------------------------------------------------

    @property
    def status(self) -> StoreStatus:
        return "up" if self._up else "down"

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
            if self._on_error is not None:
                self._on_error(op)
            return True
        return False

    async def _call(self, op: str, fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``fn`` against Redis, or raise _Unavailable (counted, with backoff)."""
        if self._skipping(op):
            raise _Unavailable(op)
        start = time.perf_counter()
        try:
            result = await fn()
        except (TimeoutError, RedisError, OSError) as exc:
            if self._up:
                log.warning("stats store: Redis unreachable (%s: %s)", op, exc)
            self._mark(False)
            if self._on_error is not None:
                self._on_error(op)
            raise _Unavailable(op) from exc
        finally:
            if self._on_duration is not None:
                self._on_duration(op, time.perf_counter() - start)
        self._mark(True)
        return result

    async def ping(self) -> bool:
        async def run() -> bool:
            # Both pools: reads and writes go over separate connections.
            return bool(await self._client.ping()) and bool(await self._writer.ping())

        try:
            return await self._call("ping", run)
        except _Unavailable:
            return False

    async def close(self) -> None:
        await self._client.aclose()
        await self._writer.aclose()

    # ---- history ---------------------------------------------------------------------------

    async def read_history(self, namespace: str, query: HistoryQuery) -> HistoryPrior | None:
        if self._skipping("read_history"):
            return None
        # Encoding and decoding are numpy work of tens of milliseconds: off the event loop.
        commands = await asyncio.to_thread(self._history_reads, namespace, query)
        try:
            replies = await self._call(
                "read_history", lambda: self._execute(self._client, commands)
            )
        except _Unavailable:
            return None
        return await asyncio.to_thread(_prior_from_replies, query, replies)

    def _history_reads(self, namespace: str, query: HistoryQuery) -> list[bytes]:
        """Per prompt: HMGET of the totals and of the group's own tokens."""
        fields = _Text.integers(query.tokens)
        return [
            _command(
                b"HMGET",
                self.history_key(namespace, prompt).encode(),
                TOTALS_FIELD,
                tail=_records(fields.take(slice(lo, hi)).bulk()),
                tail_args=hi - lo,
            )
            for prompt, lo, hi in zip(
                query.prompt_ids,
                query.offsets[:-1].tolist(),
                query.offsets[1:].tolist(),
                strict=True,
            )
        ]

    # ---- writes ----------------------------------------------------------------------------

    async def record(self, namespace: str, request_id: str | None, update: StatsUpdate) -> bool:
        if self._skipping("record"):
            return False
        commands = await asyncio.to_thread(self._writes, namespace, request_id, update)
        try:
            replies = await self._call("record", lambda: self._execute(self._writer, commands))
        except _Unavailable:
            return False
        return bool(replies[0] == 1)

    def _writes(self, namespace: str, request_id: str | None, update: StatsUpdate) -> list[bytes]:
        """The write pipeline: the claim, then history and statistics in chunks."""
        claim = uuid.uuid4().hex.encode()
        if request_id is not None:
            claim_key, claim_ttl = self.request_key(namespace, request_id), self.ttl_seconds
        else:  # no idempotency asked for: a private claim that only guards against resends
            claim_key = f"{self._ns(namespace)}:write:{claim.decode()}"
            claim_ttl = ANONYMOUS_CLAIM_TTL
        key, ttl = claim_key.encode(), b"%d" % self.ttl_seconds
        chunks = (b"%d" % i for i in itertools.count())
        commands = [_command(b"EVAL", CLAIM, b"1", key, claim, b"%d" % claim_ttl)]
        history = update.history
        if history is not None:
            fields = _Text.integers(history.tokens)
            rows = np.ascontiguousarray(history.rows, dtype=ROW_DTYPE).view(np.uint8)
            values = _Text.raw(rows.reshape(-1, ROW_BYTES))
            for g, prompt in enumerate(history.prompt_ids):
                hist_key = self.history_key(namespace, prompt).encode()
                lo, hi = int(history.offsets[g]), int(history.offsets[g + 1])
                totals = np.ascontiguousarray(history.totals[g], dtype=ROW_DTYPE).tobytes()
                for start in range(lo, max(hi, lo + 1), HISTORY_CHUNK):
                    end = min(hi, start + HISTORY_CHUNK)
                    first = (TOTALS_FIELD, totals) if start == lo else ()
                    part = slice(start, end)
                    commands.append(
                        _command(
                            *(b"EVAL", WRITE_HISTORY, b"2", key, hist_key, claim, ttl),
                            *(next(chunks), *first),
                            tail=_records(fields.take(part).bulk() + values.take(part).bulk()),
                            tail_args=2 * (end - start),
                        )
                    )
        stats = update.tokens
        tokens = _Text.integers(stats.tokens)
        for hash_key, (_, name, command) in zip(self.stat_keys(namespace), STATS, strict=True):
            increments = np.asarray(getattr(stats, name))
            nonzero = np.flatnonzero(increments)
            if not nonzero.size:
                continue
            floats = command == b"HINCRBYFLOAT"
            deltas = _Text.floats(increments) if floats else _Text.integers(increments)
            for start in range(0, nonzero.size, STATS_CHUNK):
                at = nonzero[start : start + STATS_CHUNK]
                commands.append(
                    _command(
                        *(b"EVAL", INCREMENT, b"2", key, hash_key.encode(), claim, ttl),
                        *(next(chunks), command),
                        tail=_records(tokens.take(at).bulk() + deltas.take(at).bulk()),
                        tail_args=2 * at.size,
                    )
                )
        meta = self.meta_key(namespace).encode()
        commands.append(
            _command(
                *(b"EVAL", INCREMENT, b"2", key, meta, claim, ttl, next(chunks), b"HINCRBY"),
                *(b"rollouts", b"%d" % stats.rollouts),
            )
        )
        return commands

    async def _execute(self, client: redis.Redis, commands: list[bytes]) -> list[Any]:
        """Send RESP-encoded ``commands`` in one write and read their replies: one round trip.

        Used instead of redis-py's pipeline for commands with hundreds of thousands of
        arguments, which its per-argument packing would spend most of the time on. A broken
        connection is retried once on a fresh one (safe: reads, and the idempotent writes).
        """
        pool = client.connection_pool
        for attempt in range(2):
            conn = await pool.get_connection()
            try:
                await conn.send_packed_command(commands, check_health=False)
                return [await conn.read_response() for _ in commands]
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

    # ---- reading the statistics ---------------------------------------------------------------

    async def token_stats(self, namespace: str, order: str, limit: int) -> dict[str, Any] | None:
        check_order(order)
        commands = [_command(b"HGET", self.meta_key(namespace).encode(), b"rollouts")]
        commands += [_command(b"HGETALL", key.encode()) for key in self.stat_keys(namespace)]
        try:
            rollouts, *hashes = await self._call(
                "token_stats", lambda: self._execute(self._client, commands)
            )
        except _Unavailable:
            return None
        columns = await asyncio.to_thread(_stat_columns, hashes)
        return token_stats_response(namespace, int(rollouts or 0), columns, order, limit)


def _bulk(arg: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(arg), arg)


def _command(*args: bytes, tail: bytes = b"", tail_args: int = 0) -> bytes:
    """One RESP command: ``args`` then ``tail_args`` arguments already encoded in ``tail``."""
    return b"".join([b"*%d\r\n" % (len(args) + tail_args), *map(_bulk, args), tail])


class _Text:
    """One byte string per record, as a left-aligned padded matrix: ``matrix`` uint8 (K, W),
    ``lengths`` int64 (K,). Lets RESP for hundreds of thousands of arguments be built with
    numpy, without a Python object per argument."""

    def __init__(self, matrix: np.ndarray, lengths: np.ndarray) -> None:
        self.matrix, self.lengths = matrix, lengths

    @classmethod
    def const(cls, text: bytes, k: int) -> _Text:
        row = np.frombuffer(text, np.uint8)
        return cls(np.broadcast_to(row, (k, row.size)), np.full(k, row.size, np.int64))

    @classmethod
    def raw(cls, rows: np.ndarray) -> _Text:
        """Fixed-width binary records, uint8 (K, W)."""
        return cls(rows, np.full(rows.shape[0], rows.shape[1], np.int64))

    @classmethod
    def integers(cls, values: np.ndarray) -> _Text:
        """Decimal ASCII of int64 ``values``: every digit of every value in one array pass."""
        v = np.asarray(values, dtype=np.int64)
        if v.size == 0:
            return cls(np.zeros((0, 0), np.uint8), np.zeros(0, np.int64))
        negative = v < 0
        magnitude = np.abs(v)
        digits = np.ones(v.shape, np.int64)
        power, largest = 10, int(magnitude.max())
        while power <= largest:
            digits += magnitude >= power
            power *= 10
        exponent = digits[:, None] - 1 - np.arange(int(digits.max()))
        place = 10 ** np.clip(exponent, 0, None)
        # Columns past a value's own digits hold junk; its length masks them out.
        matrix = (48 + (magnitude[:, None] // place) % 10).astype(np.uint8)
        if negative.any():
            signed = np.empty((v.size, matrix.shape[1] + 1), np.uint8)
            signed[:, 0] = ord("-")
            signed[:, 1:] = matrix
            signed[~negative, :-1] = matrix[~negative]
            matrix = signed
        return cls(matrix, digits + negative)

    @classmethod
    def floats(cls, values: np.ndarray) -> _Text:
        """``values`` (finite float64) as ``<integer>e-<k>``, with one k for the array that
        keeps 15 significant digits of the largest (what HINCRBYFLOAT parses)."""
        x = np.asarray(values, dtype=np.float64)
        largest = float(np.abs(x).max()) if x.size else 0.0
        k = 0 if largest == 0 else max(0, 15 - (math.floor(math.log10(largest)) + 1))
        mantissa = cls.integers(np.rint(x * 10.0**k).astype(np.int64))
        return mantissa if k == 0 else mantissa.then(cls.const(b"e-%d" % k, x.size))

    def take(self, index: slice | np.ndarray) -> _Text:
        return _Text(self.matrix[index], self.lengths[index])

    def then(self, other: _Text) -> _Text:
        return _Text(*_concatenate([self, other]))

    def bulk(self) -> list[_Text]:
        """RESP bulk strings of the records: ``$<length> CRLF <record> CRLF``."""
        k = self.lengths.size
        crlf = _Text.const(b"\r\n", k)
        return [_Text.const(b"$", k), _Text.integers(self.lengths), crlf, self, crlf]


def _concatenate(parts: list[_Text]) -> tuple[np.ndarray, np.ndarray]:
    """Record-wise concatenation, as a padded matrix and lengths."""
    flat = _records(parts)
    lengths = np.sum([p.lengths for p in parts], axis=0)
    matrix = np.zeros((lengths.size, int(lengths.max()) if lengths.size else 0), np.uint8)
    matrix[np.arange(matrix.shape[1]) < lengths[:, None]] = np.frombuffer(flat, np.uint8)
    return matrix, lengths


def _records(parts: list[_Text]) -> bytes:
    """Record i of every part, in order, for every record: the bytes of one RESP stretch."""
    if not parts or parts[0].lengths.size == 0:
        return b""
    matrix = np.concatenate([p.matrix for p in parts], axis=1)
    valid = np.concatenate(
        [np.arange(p.matrix.shape[1]) < p.lengths[:, None] for p in parts], axis=1
    )
    return matrix[valid].tobytes()


def _prior_from_replies(query: HistoryQuery, replies: list[Any]) -> HistoryPrior:
    totals = np.zeros((len(query.prompt_ids), ROW_FIELDS), np.float64)
    rows = np.zeros((query.tokens.size, ROW_FIELDS), np.float64)
    for g, values in enumerate(replies):
        lo, hi = int(query.offsets[g]), int(query.offsets[g + 1])
        block = _rows_from_values(values).reshape(hi - lo + 1, ROW_FIELDS)
        totals[g] = block[0]
        rows[lo:hi] = block[1:]
    return HistoryPrior.from_stored(totals, query.offsets, query.tokens, rows)


def _rows_from_values(values: list[bytes | None]) -> np.ndarray:
    """HMGET replies (40-byte packed rows, None where absent) as float64 (K * 5,)."""
    joined = b"".join(EMPTY_ROW if v is None else v for v in values)
    if len(joined) != ROW_BYTES * len(values):  # a value not written by this store: ignore it
        joined = b"".join(v if v is not None and len(v) == ROW_BYTES else EMPTY_ROW for v in values)
    return np.frombuffer(joined, dtype=ROW_DTYPE)


def _stat_columns(hashes: list[Any]) -> dict[str, np.ndarray]:
    """The stat hashes' HGETALL replies as aligned columns over their union of token ids."""
    parsed = [_hash_columns(h) for h in hashes]
    tokens = np.unique(np.concatenate([fields for fields, _ in parsed]))
    columns: dict[str, np.ndarray] = {"token_id": tokens}
    for (_, name, command), (fields, values) in zip(STATS, parsed, strict=True):
        column = np.zeros(tokens.size, np.float64)
        column[np.searchsorted(tokens, fields)] = values
        columns[name] = column if command == b"HINCRBYFLOAT" else column.astype(np.int64)
    return columns


def _hash_columns(reply: list[bytes] | dict[bytes, bytes]) -> tuple[np.ndarray, np.ndarray]:
    """An HGETALL reply (a flat field, value list; a map in RESP3) as token ids int64 and
    values float64, parsed by numpy in one pass each."""
    if not reply:
        return np.zeros(0, np.int64), np.zeros(0, np.float64)
    if isinstance(reply, dict):
        fields, values = list(reply), list(reply.values())
    else:
        fields, values = reply[0::2], reply[1::2]
    return np.array(fields).astype(np.int64), np.array(values).astype(np.float64)


__all__ = ["DEFAULT_PREFIX", "RedisStatsStore"]
