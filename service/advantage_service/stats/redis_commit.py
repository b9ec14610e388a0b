"""The stats store's keys and its one commit script, the same on one Redis and on a Redis Cluster.

Every key of a write lives under one *base* (:class:`SlotKeys`), all in one hash slot: on one
Redis the namespace's base ``P:{N}`` holds its records, claims and statistics together; on a
cluster a record slot's base ``P:{T(s)}:N`` holds its records and their claims, a statistics
bucket's base ``P:{N:b<b>}`` its deltas and their claims (see :mod:`.redis_store`).

A write to one base is a :class:`~.redis_nodes.Part` (:func:`commit_part`): stage the delta and
the records, then :data:`COMMIT`, which checks the claims and applies everything or nothing.
Where the claims live is its one parameter: on one Redis a write's claims are its mark (a write
claiming no request id gets a key of its own, ``write:<claim>``), on a cluster every part has
its own ``write:<write>`` key, since a request's claim in one slot says nothing of another.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .base import Claims, RecordKey, RequestWrite
from .redis_common import (
    ANONYMOUS_CLAIM_TTL,
    DeltaKeys,
    RedisContext,
    claim_digest,
    command,
    is_refusal,
)
from .redis_nodes import Part

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

# A write to one base. KEYS: 1 the write's own key, then ARGV[4] claims, then pairs (staged
# record, record), then, when ARGV[6] is 1, the statistics' tokdelta, tokstats, toklock and
# staged delta. ARGV: 1 the write's id, 2 claim TTL, 3 TTL, 4 claims, 5 TTL of the write's own
# key, 6 has a delta, 7 compact after, 8 lock value, 9 lock ms, 10 '1' when the claims mark the
# write (one Redis: its own key only without any), then one digest per claim ('' for none).
# Answers {1, pending deltas, 1 when the caller now holds the compaction lock} when applied (now,
# or before by the same write: a resent pipeline finds its mark); {0, 0, 0, positions of the
# claims found} when one of its request ids was counted before (negative where the claim keeps
# another digest: a conflict): nothing is claimed or applied then. Everything that can fail is
# checked before the first write, so that no error leaves half a write: a staged record or delta
# missing (its SET refused, or evicted) answers the error ADVREFUSED (nothing applied: the
# caller writes the requests again in smaller groups), a deltas list of another type WRONGTYPE.
COMMIT = (
    LUA_CLAIMS
    + b"""
local n = tonumber(ARGV[4])
local delta = ARGV[6] == '1'
local marked = ARGV[10] == '1' and n > 0
local last = #KEYS
if delta then last = last - 4 end
local function discard()
  for i = n + 2, last, 2 do redis.call('DEL', KEYS[i]) end
  if delta then redis.call('DEL', KEYS[last + 4]) end
end
local own = KEYS[1]
if marked then own = KEYS[2] end
local mine = redis.pcall('GET', own)
if type(mine) == 'string'
    and (mine == ARGV[1] or string.sub(mine, 1, #ARGV[1] + 1) == ARGV[1] .. '|') then
  discard()
  return {1, 0, 0}
end
local claimed = claims(2, n + 1, 9, 1)
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
  if ARGV[9 + i] ~= '' then value = value .. '|' .. ARGV[9 + i] end
  redis.call('SET', KEYS[i], value, 'EX', ARGV[2])
end
if not marked then redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[5]) end
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
COMMIT_SHA = hashlib.sha1(COMMIT).hexdigest().encode()


@dataclass(frozen=True)
class SlotKeys:
    """The keys under one base ``P:{...}...`` (one hash slot): records, claims, a write's own
    key, what a write stages, and the statistics tables. The one key scheme of both layouts."""

    base: str

    def record(self, key: RecordKey) -> bytes:
        space, name = key
        return f"{self.base}:{space}:{name}".encode()

    def claim(self, request_id: str) -> bytes:
        return f"{self.base}:claim:{request_id}".encode()

    def write(self, write: str) -> bytes:
        return f"{self.base}:write:{write}".encode()

    def stage(self, write: str, i: int | str) -> bytes:
        return f"{self.base}:stage:{write}:{i}".encode()

    def deltas(self) -> DeltaKeys:
        return DeltaKeys(
            delta=f"{self.base}:tokdelta".encode(),
            compacted=f"{self.base}:tokstats".encode(),
            lock=f"{self.base}:toklock".encode(),
            stage=f"{self.base}:stage",
        )


def commit_part(
    settings: RedisContext,
    keys: SlotKeys,
    slot: int,
    write: str,
    *,
    claims: Sequence[tuple[str, str | None]],
    records: Sequence[tuple[RecordKey, bytes]],
    delta: bytes | None = None,
    lock: str = "",
    staged: Callable[[RecordKey], bool] | None = None,
    marked_by_claims: bool = False,
    by_digest: bool = True,
) -> Part:
    """A write to ``keys``' base: stage ``delta`` and ``records``, then :data:`COMMIT`
    claiming ``claims`` ((request id, digest), in order: the positions its reply names).
    ``staged(key)`` False leaves a record unstaged (a test seam). ``by_digest``: the script by
    its digest (a write has a part per slot it touches, and the text would travel with each),
    the text in ``fallback`` for a node that does not know it yet; else by its text. Raises
    UnicodeEncodeError for a key or request id that is not valid Unicode text."""
    commands = []
    stage_ms = settings.stage_ms
    staged_delta = keys.stage(write, "d")
    if delta is not None:
        commands += [
            command(b"RPUSH", staged_delta, delta),
            command(b"PEXPIRE", staged_delta, stage_ms),
        ]
    pairs: list[bytes] = []
    for i, (key, record) in enumerate(records):
        stage = keys.stage(write, i)
        if staged is None or staged(key):
            commands.append(command(b"SET", stage, record, b"PX", stage_ms))
        pairs += [stage, keys.record(key)]
    script_keys = [keys.write(write), *(keys.claim(rid) for rid, _ in claims), *pairs]
    if delta is not None:
        tables = keys.deltas()
        script_keys += [tables.delta, tables.compacted, tables.lock, staged_delta]
    ttl = b"%d" % settings.ttl_seconds
    args = [write.encode(), ttl, ttl, b"%d" % len(claims), b"%d" % ANONYMOUS_CLAIM_TTL]
    args += [b"1" if delta is not None else b"0", b"%d" % settings.compact_after]
    args += [lock.encode(), b"%d" % settings.lock_ms, b"1" if marked_by_claims else b"0"]
    args += [claim_digest(digest) for _, digest in claims]
    tail = [b"%d" % len(script_keys), *script_keys, *args]
    by_text = command(b"EVAL", COMMIT, *tail)
    if not by_digest:
        return Part(slot, [*commands, by_text])
    return Part(slot, [*commands, command(b"EVALSHA", COMMIT_SHA, *tail)], fallback=by_text)


def refused_whole(part: Part) -> bool:
    """True when a part's commit script refused it as a whole (nothing applied): what it
    staged was not all there."""
    result = part.result
    return isinstance(result, list) and bool(result) and is_refusal(result[-1])


def script_reply(part: Part) -> list[Any] | None:
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


def claims_found(reply: list[Any], requests: Sequence[RequestWrite]) -> Claims | None:
    """The requests (positions in ``requests``) a commit script's reply found claimed before;
    None when it names none of them. (The script counts only the requests with an id: its
    positions are among those.)"""
    with_id = [p for p, r in enumerate(requests) if r.request_id is not None]
    found = [int(p) for p in reply[3:]]
    before = tuple(with_id[p - 1] for p in found if 0 < p <= len(with_id))
    other = tuple(with_id[-p - 1] for p in found if 0 < -p <= len(with_id))
    return Claims(before, other) if before or other else None


__all__ = [
    "COMMIT",
    "LUA_CLAIMS",
    "SlotKeys",
    "claims_found",
    "commit_part",
    "refused_whole",
    "script_reply",
]
