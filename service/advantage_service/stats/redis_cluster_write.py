"""One write on a Redis Cluster, in its two steps: the records part by part (one part per slot),
then the statistics of the requests whose every part is written (one part per bucket). The
design is in :mod:`.redis_store`, the keys in :mod:`.redis_cluster`."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .base import (
    CONFLICT,
    COUNTED,
    DUPLICATE,
    POISONED,
    Outcome,
    RecordKey,
    Refold,
    RequestWrite,
    StatsUpdate,
)
from .blobs import TokenStatsUpdate, encode_token_stats, merge_token_stats
from .redis_commit import SlotKeys, commit_part, refused_whole, script_reply
from .redis_common import RedisContext
from .redis_nodes import Nodes, Part, run_scripts

Records = dict[RecordKey, bytes]


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


class ClusterWrite:
    """The write ``write`` of ``requests`` (folded into one update) to ``namespace`` on the
    cluster of ``layout``; the layout's ``record_requests`` runs its steps and reports
    reachability."""

    def __init__(
        self, layout: Slots, namespace: str, requests: Sequence[RequestWrite], write: str
    ) -> None:
        self.layout = layout
        self.context = layout.context
        self.namespace = namespace
        self.requests = requests
        self.write = write

    async def write_records(self, update: StatsUpdate, refold: Refold) -> _Written:
        """Apply the records part by part; what became of the requests' parts."""
        records = dict(update.records)
        writers: dict[RecordKey, list[int]] = {}
        for i, request in enumerate(self.requests):
            for key in request.keys:
                writers.setdefault(key, []).append(i)
        by_slot: dict[int, _Pending] = {}
        for key in records:
            slot = self.layout.record_slot(self.namespace, key)
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
                    parts.append(self._record_part(pending, records, self.write))
                except UnicodeEncodeError:  # (nothing sent)
                    refused.append(pending)
                    continue
                sent.append(pending)
            await run_scripts(self.layout.nodes, parts)
            again = []
            for pending, part in zip(sent, parts, strict=True):
                if refused_whole(part):
                    refused.append(pending)
                    continue
                reply = script_reply(part)
                if reply is None:
                    done.failed.update(pending.requests)
                    continue
                if reply[0]:
                    continue
                left = self._claimed(pending.requests, reply, done)
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
            await self._split_records(pending, writers, refold, done)
        return done

    def _claimed(self, members: list[int], reply: list[Any], done: _Written) -> list[int] | None:
        """``members`` without the requests a part's reply found claimed (those claimed for
        another body added to ``done.conflicts``); None for a reply that names none of them."""
        ids = [rid for i in members if (rid := self.requests[i].request_id) is not None]
        positions = [int(p) for p in reply[3:]]
        claimed = {ids[p - 1] for p in positions if 0 < p <= len(ids)}
        other = {ids[-p - 1] for p in positions if 0 < -p <= len(ids)}
        if not claimed and not other:
            return None
        done.conflicts.update(i for i in members if self.requests[i].request_id in other)
        return [i for i in members if self.requests[i].request_id not in claimed | other]

    async def _split_records(
        self,
        pending: _Pending,
        writers: dict[RecordKey, list[int]],
        refold: Refold,
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
                    part = self._record_part(sub, folded, f"{self.write}.{next(tries)}")
                except UnicodeEncodeError:
                    part = None
                else:
                    await run_scripts(self.layout.nodes, [part])
                if part is None or refused_whole(part):
                    if len(members) == 1:
                        done.poisoned.add(members[0])
                        return
                    half = len(members) // 2
                    await attempt(members[:half])
                    await attempt(members[half:])
                    return
                reply = script_reply(part)
                if reply is None:
                    done.failed.update(members)
                    return
                if reply[0]:
                    written.extend(members)
                    return
                left = self._claimed(members, reply, done)
                if left is None:
                    done.failed.update(members)
                    return
                members = left

        await attempt(list(pending.requests))

    def _record_part(self, pending: _Pending, records: Records, write: str) -> Part:
        """The commands of a part of the records; raises UnicodeEncodeError for a key or
        request id that is not valid Unicode text."""
        members = [self.requests[i] for i in pending.requests]
        return commit_part(
            self.context,
            self.layout.slot_keys(pending.slot, self.namespace),
            pending.slot,
            write,
            claims=[(rid, r.digest) for r in members if (rid := r.request_id) is not None],
            records=[(key, records[key]) for key in pending.keys],
            staged=self.context.staged_in(self.namespace),
        )

    async def write_statistics(
        self, written: list[int], lock: str, outcomes: list[Outcome]
    ) -> list[int]:
        """Count the statistics of the ``written`` requests, one part per bucket (setting
        their ``outcomes``); the buckets whose compaction lock this write now holds. A bucket's
        part refused as a whole is written again in halves of its requests, as records are."""
        by_bucket: dict[int, list[int]] = {}
        for i in written:
            rid = self.requests[i].request_id
            bucket = self.layout.bucket_of(rid if rid is not None else self.write)
            by_bucket.setdefault(bucket, []).append(i)
        compact: list[int] = []
        refused: list[tuple[int, list[int]]] = []
        todo = dict(by_bucket)
        while todo:
            order = list(todo)
            groups = [[self.requests[i].tokens for i in todo[b]] for b in order]
            tables = await asyncio.to_thread(_merge_each, groups)
            parts: list[Part | None] = []
            for b, table in zip(order, tables, strict=True):
                try:
                    parts.append(
                        self._statistics_part(
                            b, table, [self.requests[i] for i in todo[b]], self.write, lock
                        )
                    )
                except UnicodeEncodeError:  # (nothing sent)
                    parts.append(None)
            await run_scripts(self.layout.nodes, [p for p in parts if p is not None])
            again: dict[int, list[int]] = {}
            for bucket, part in zip(order, parts, strict=True):
                members = todo[bucket]
                if part is None or refused_whole(part):
                    refused.append((bucket, members))
                    continue
                rest = self._counted(members, part, outcomes, compact, bucket)
                if rest:
                    again[bucket] = rest
            todo = again
        tries = itertools.count(1)

        async def attempt(bucket: int, members: list[int]) -> None:
            while members:
                table = await asyncio.to_thread(
                    merge_token_stats, [self.requests[i].tokens for i in members]
                )
                part: Part | None
                try:
                    part = self._statistics_part(
                        bucket,
                        table,
                        [self.requests[i] for i in members],
                        f"{self.write}.s{next(tries)}",
                        lock,
                    )
                except UnicodeEncodeError:
                    part = None
                else:
                    await run_scripts(self.layout.nodes, [part])
                if part is None or refused_whole(part):
                    if len(members) == 1:
                        outcomes[members[0]] = POISONED
                        return
                    half = len(members) // 2
                    await attempt(bucket, members[:half])
                    await attempt(bucket, members[half:])
                    return
                members = self._counted(members, part, outcomes, compact, bucket)

        for bucket, members in refused:
            await attempt(bucket, members)
        return compact

    def _counted(
        self,
        members: list[int],
        part: Part,
        outcomes: list[Outcome],
        compact: list[int],
        bucket: int,
    ) -> list[int]:
        """Set the outcomes of a statistics part's ``members`` from its reply; those to write
        again (the part applied nothing, some of its ids being claimed before)."""
        reply = script_reply(part)
        if reply is None:
            return []  # (their outcome stays LOST)
        if reply[0]:
            for i in members:
                outcomes[i] = COUNTED
            if reply[2] and bucket not in compact:
                compact.append(bucket)
            return []
        ids = [rid for i in members if (rid := self.requests[i].request_id) is not None]
        positions = [int(p) for p in reply[3:]]
        claimed = {ids[p - 1] for p in positions if 0 < p <= len(ids)}
        other = {ids[-p - 1] for p in positions if 0 < -p <= len(ids)}
        for i in members:
            rid = self.requests[i].request_id
            if rid in claimed:
                outcomes[i] = DUPLICATE
            elif rid in other:
                outcomes[i] = CONFLICT
        rest = [i for i in members if self.requests[i].request_id not in claimed | other]
        return rest if len(rest) < len(members) else []

    def _statistics_part(
        self,
        bucket: int,
        table: TokenStatsUpdate,
        members: list[RequestWrite],
        write: str,
        lock: str,
    ) -> Part:
        return commit_part(
            self.context,
            self.layout.bucket_keys(self.namespace, bucket),
            self.layout.bucket_slot(self.namespace, bucket),
            write,
            claims=[(rid, r.digest) for r in members if (rid := r.request_id) is not None],
            records=[],
            delta=encode_token_stats(table),
            lock=lock,
        )

    # ---- reading the statistics -------------------------------------------------------------


def _merge_each(groups: list[list[TokenStatsUpdate]]) -> list[TokenStatsUpdate]:
    return [merge_token_stats(tables) for tables in groups]


__all__ = ["ClusterWrite", "Records", "Slots"]
