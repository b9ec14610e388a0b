"""One write on a Redis Cluster, in its two steps: the records part by part (one part per slot),
then the statistics of the requests whose every part is written (one part per bucket). Each part
is a group of :mod:`.write_groups`: applied whole or not at all, tried again without the
requests it found claimed (its records folded again by the caller), split when refused whole.
The design is in :mod:`.redis_store`, the keys in :mod:`.redis_cluster`."""

from __future__ import annotations

import asyncio
import functools
import itertools
from collections.abc import Mapping
from typing import Protocol

from redis.exceptions import RedisClusterException, RedisError

from .base import (
    CONFLICT,
    COUNTED,
    DUPLICATE,
    LOST,
    POISONED,
    Claims,
    FoldAgain,
    Outcome,
    RecordKey,
    Refused,
    RequestWrite,
    Write,
)
from .blobs import TokenStatsUpdate, encode_token_stats, merge_token_stats
from .redis_commit import SlotKeys, claims_found, commit_part, refused_whole, script_reply
from .redis_common import DeltaKeys, Execute, RedisContext
from .redis_nodes import Nodes, Part, run_scripts
from .write_groups import Answer, Attempt, GroupWrite, Records


class Slots(Protocol):
    """What a write needs of the cluster layout (:class:`.redis_cluster.ClusterLayout`): where
    each key lives, and the nodes to send its parts to."""

    @property
    def context(self) -> RedisContext: ...

    @property
    def nodes(self) -> Nodes: ...

    def record_slot(self, namespace: str, key: RecordKey) -> int: ...

    def slot_keys(self, slot: int, namespace: str) -> SlotKeys: ...

    def bucket_of(self, name: str) -> int: ...

    def bucket_slot(self, namespace: str, bucket: int) -> int: ...

    def bucket_keys(self, namespace: str, bucket: int) -> SlotKeys: ...

    def delta_keys(self, namespace: str, bucket: int) -> DeltaKeys: ...

    def execute_in(self, slot: int) -> Execute: ...


class ClusterWrite:
    """``write`` on the cluster of ``layout`` (a :class:`.base.Recording`): its records' parts
    until each is written, found claimed, refused or lost (asking for records folded again where
    a part goes again with fewer requests), then the statistics of the requests whose every
    part is written, then the compactions the write triggered. Reachability is reported to the
    layout's context."""

    def __init__(self, layout: Slots, write: Write) -> None:
        self.layout = layout
        self.context = context = layout.context
        self.namespace = namespace = write.namespace
        self.requests = requests = write.requests
        self.write = context.new_id()
        self.lock = context.new_id()
        self._tries = itertools.count(1)
        by_slot: dict[int, Records] = {}
        for key, record in write.update.records.items():
            by_slot.setdefault(layout.record_slot(namespace, key), {})[key] = record
        parts = []
        for slot, records in by_slot.items():
            keys = frozenset(records)
            members = [i for i, r in enumerate(requests) if keys.intersection(r.keys)]
            parts.append((slot, keys, members, records))
        self.records = GroupWrite(requests, parts, self._send_records, together=write.together)
        # The statistics step, once the records' is over: its parts, the requests it counts.
        self._statistics: GroupWrite | None = None
        self._counting: set[int] = set()

    @property
    def again(self) -> list[FoldAgain]:
        return self.records.again

    @property
    def outcomes(self) -> list[Outcome]:
        """A request is ``lost`` until the statistics step counts it (or the records' step
        finds it conflicting or poisoned)."""
        if self._statistics is None:
            return [LOST] * len(self.requests)
        counted = self._statistics.outcomes
        return [
            counted[i] if i in self._counting else (o if o in (CONFLICT, POISONED) else LOST)
            for i, o in enumerate(self.records.outcomes)
        ]

    async def send(self, records: Mapping[RecordKey, bytes] | None = None) -> None:
        context = self.context
        with context.timed("record"):
            try:
                await self.records.send(records)
                if self.records.again:
                    return
                compact = await self._write_statistics()
            except (TimeoutError, RedisError, RedisClusterException, OSError) as exc:
                # (the cluster could not be reached at all: the store's backoff)
                self.records.again = []
                context.unreachable("record", exc)
                return
        context.mark(True)
        outcomes = self.outcomes
        unanswered = any(g.unanswered for g in self.records.groups)
        if unanswered or LOST in outcomes or POISONED in outcomes:
            context.count_error("record")
        for bucket in compact:
            await context.compact_deltas(
                self.layout.execute_in(self.layout.bucket_slot(self.namespace, bucket)),
                self.layout.delta_keys(self.namespace, bucket),
                self.lock,
            )

    def _write_id(self, attempt: Attempt, kind: str) -> str:
        # (a part of a refused part has a write id of its own: the part's id marks it applied)
        return f"{self.write}.{kind}{next(self._tries)}" if attempt.split else self.write

    async def _send_records(self, attempts: list[Attempt]) -> list[Answer]:
        parts: list[Part | None] = []
        for attempt in attempts:
            members = [self.requests[i] for i in attempt.members]
            try:
                parts.append(
                    commit_part(
                        self.context,
                        self.layout.slot_keys(attempt.tag, self.namespace),
                        attempt.tag,
                        self._write_id(attempt, ""),
                        claims=_claims(members),
                        records=list(attempt.records.items()),
                        staged=self.context.staged_in(self.namespace),
                    )
                )
            except UnicodeEncodeError:  # (nothing sent)
                parts.append(None)
        return await self._answers(attempts, parts)

    async def _answers(self, attempts: list[Attempt], parts: list[Part | None]) -> list[Answer]:
        """Send ``parts`` (None: one that could not be encoded) at once; what each got."""
        await run_scripts(self.layout.nodes, [p for p in parts if p is not None])
        answers: list[Answer] = []
        for attempt, part in zip(attempts, parts, strict=True):
            if part is None or refused_whole(part):
                answers.append(Refused(f"slot {attempt.tag}: the part was refused"))
                continue
            reply = script_reply(part)
            if reply is None:
                answers.append(None)
            elif reply[0]:
                answers.append(Claims())
            else:
                answers.append(claims_found(reply, [self.requests[i] for i in attempt.members]))
        return answers

    async def _write_statistics(self) -> list[int]:
        """Count the statistics of the requests whose records are all written, one part per
        bucket (a bucket's part refused whole goes again in halves, as records do); the buckets
        whose compaction lock this write now holds."""
        by_bucket: dict[int, list[int]] = {}
        for i, outcome in enumerate(self.records.outcomes):
            if outcome in (COUNTED, DUPLICATE):
                rid = self.requests[i].request_id
                bucket = self.layout.bucket_of(rid if rid is not None else self.write)
                by_bucket.setdefault(bucket, []).append(i)
                self._counting.add(i)
        compact: list[int] = []
        empty: frozenset[RecordKey] = frozenset()
        self._statistics = GroupWrite(
            self.requests,
            [(bucket, empty, members, {}) for bucket, members in by_bucket.items()],
            functools.partial(self._send_statistics, compact),
        )
        await self._statistics.send()
        return compact

    async def _send_statistics(self, compact: list[int], attempts: list[Attempt]) -> list[Answer]:
        groups = [[self.requests[i].tokens for i in a.members] for a in attempts]
        tables = await asyncio.to_thread(_merge_each, groups)
        parts: list[Part | None] = []
        for attempt, table in zip(attempts, tables, strict=True):
            try:
                parts.append(self._statistics_part(attempt, table))
            except UnicodeEncodeError:  # (nothing sent)
                parts.append(None)
        answers = await self._answers(attempts, parts)
        for attempt, part in zip(attempts, parts, strict=True):
            reply = None if part is None else script_reply(part)
            if reply is not None and reply[0] and reply[2] and attempt.tag not in compact:
                compact.append(attempt.tag)
        return answers

    def _statistics_part(self, attempt: Attempt, table: TokenStatsUpdate) -> Part:
        members = [self.requests[i] for i in attempt.members]
        return commit_part(
            self.context,
            self.layout.bucket_keys(self.namespace, attempt.tag),
            self.layout.bucket_slot(self.namespace, attempt.tag),
            self._write_id(attempt, "s"),
            claims=_claims(members),
            records=[],
            delta=encode_token_stats(table),
            lock=self.lock,
        )


def _claims(members: list[RequestWrite]) -> list[tuple[str, str | None]]:
    return [(rid, r.digest) for r in members if (rid := r.request_id) is not None]


def _merge_each(groups: list[list[TokenStatsUpdate]]) -> list[TokenStatsUpdate]:
    return [merge_token_stats(tables) for tables in groups]


__all__ = ["ClusterWrite", "Slots"]
