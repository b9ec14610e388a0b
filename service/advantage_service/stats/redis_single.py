"""The stats store's layout on one Redis: one namespace's keys in one hash slot (``P:{N}``, the
keys in :class:`.redis_commit.SlotKeys`), a write applied whole by one commit script. The design
is in :mod:`.redis_store`; the cluster's layout is in :mod:`.redis_cluster`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

from redis.exceptions import ResponseError

from .base import Claims, Read, RecordKey, Refused, RequestWrite, StatsUpdate, Write
from .blobs import encode_token_stats
from .redis_commit import SlotKeys, claims_found, commit_part
from .redis_common import (
    Commands,
    RedisContext,
    Unavailable,
    command,
    is_refusal,
    stored_digest,
)
from .redis_nodes import Connection, OneNode, Part, replies_of
from .write_groups import GroupWrite, record_whole

log = logging.getLogger("advantage_service.stats.redis_store")


def namespace_keys(prefix: str, namespace: str) -> SlotKeys:
    """One namespace's keys on one Redis, all in one slot. (quote encodes as UTF-8: a namespace
    that is not valid Unicode text raises UnicodeEncodeError, which a write answers as
    Refused)"""
    return SlotKeys(f"{prefix}:{{{quote(namespace, safe='')}}}")


class SingleLayout:
    """One Redis (:class:`.redis_nodes.OneNode`: reads and writes over separate pools).
    Reachability and settings are ``context``'s, shared with the store."""

    # (one Redis answers as a whole, or not at all)
    degraded = False

    def __init__(self, context: RedisContext, connection: Connection) -> None:
        self.context = context
        self.node = OneNode(connection, context.count_round_trip)

    def keys(self, namespace: str) -> SlotKeys:
        return namespace_keys(self.context.prefix, namespace)

    async def ping(self) -> bool:
        return await self.node.ping()

    async def close(self) -> None:
        await self.node.close()

    # ---- records -----------------------------------------------------------------------------

    async def read(self, namespace: str, keys: Sequence[RecordKey], request_id: str | None) -> Read:
        """The records of ``keys`` and the digest of ``request_id``'s claim, in one pipeline;
        raises when Redis does not answer (every record or none)."""
        commands = [command(b"GET", self.keys(namespace).record(key)) for key in keys]
        claim = self._claim_key(namespace, request_id)
        if claim is not None:
            commands.append(command(b"GET", claim))
        replies = await self._send(commands, read=True, errors=False)
        if claim is None:
            return Read(replies)
        return Read(replies[:-1], claimed_digest=stored_digest(replies[-1]))

    def _claim_key(self, namespace: str, request_id: str | None) -> bytes | None:
        """The claim key of ``request_id``; None without an id, or for one that is not valid
        Unicode text (no claim of it can exist: nothing to read)."""
        if request_id is None:
            return None
        try:
            return self.keys(namespace).claim(request_id)
        except UnicodeEncodeError:
            return None

    # ---- writes ------------------------------------------------------------------------------

    async def record_write(self, write: Write) -> GroupWrite:
        """Whole writes (:meth:`commit`), written again without the requests counted before
        and split when refused (:func:`.write_groups.record_whole`)."""
        return await record_whole(self, write)

    async def commit(
        self, namespace: str, requests: Sequence[RequestWrite], update: StatsUpdate
    ) -> Claims | None:
        """The write pipeline (one round trip) and its commit script."""
        context = self.context
        if context.skipping("record"):
            return None
        lock = context.new_id()
        try:
            commands = await asyncio.to_thread(self._writes, namespace, requests, update, lock)
        except UnicodeEncodeError as exc:  # (nothing was sent)
            context.count_error("record")
            raise Refused(f"a key or request id is not valid Unicode text: {exc.reason}") from exc

        async def run() -> list[Any]:
            replies = await self._send(commands)
            for reply in replies[:-1]:
                if isinstance(reply, ResponseError):
                    # (a staging command refused, e.g. for memory: refused as a whole, as
                    # before; the script, which checks what was staged, applied nothing)
                    raise reply
            if isinstance(replies[-1], ResponseError) and not is_refusal(replies[-1]):
                raise replies[-1]
            return replies

        try:
            replies = await context.call("record", run)
        except Unavailable:
            return None
        reply = replies[-1]
        if isinstance(reply, ResponseError):
            log.warning(
                "stats store: Redis refused a write of %d requests: %s", len(requests), reply
            )
            context.count_error("record")
            raise Refused(str(reply))
        if reply[2]:
            await self.compact(namespace, lock)
        return Claims() if reply[0] else claims_found(reply, requests)

    def _writes(
        self, namespace: str, requests: Sequence[RequestWrite], update: StatsUpdate, lock: str
    ) -> Commands:
        """The write pipeline: stage the records and the delta, then commit (claiming every
        request id of ``requests`` with its digest, or, without any, a claim of the write's
        own). Raises UnicodeEncodeError for a key that is not valid Unicode text."""
        claims = {r.request_id: r.digest for r in requests if r.request_id is not None}
        part = commit_part(
            self.context,
            self.keys(namespace),
            0,
            self.context.new_id(),
            claims=list(claims.items()),
            records=list(update.records.items()),
            delta=encode_token_stats(update.tokens),
            lock=lock,
            staged=self.context.staged_in(namespace),
            # (no idempotency asked for: a key of the write's own only guards against resends)
            marked_by_claims=True,
            by_digest=False,
        )
        return part.commands

    async def compact(self, namespace: str, lock: str) -> None:
        """Merge the pending deltas into the compacted record, holding the lock ``lock``."""
        await self.context.compact_deltas(self._execute_writes, self.keys(namespace).deltas(), lock)

    async def _execute_writes(self, commands: Commands) -> list[Any]:
        return await self._send(commands, errors=False)

    async def _send(
        self, commands: Commands, *, read: bool = False, errors: bool = True
    ) -> list[Any]:
        """``commands`` to the one Redis in one round trip (:func:`.redis_nodes.send`): their
        replies, an error reply in its command's place, or with ``errors`` False raised."""
        part = Part(0, commands)
        await self.node.run([part], read=read)
        if errors:
            assert isinstance(part.result, list)
            return part.result
        return replies_of(part)

    # ---- reading the statistics -------------------------------------------------------------

    async def statistics_records(self, namespace: str) -> list[bytes | None]:
        """The compacted record and the pending deltas, in one round trip."""
        tables = self.keys(namespace).deltas()
        commands = [
            command(b"GET", tables.compacted),
            command(b"LRANGE", tables.delta, b"0", b"-1"),
        ]
        current, deltas = await self._send(commands, read=True, errors=False)
        return [current, *deltas]


__all__ = ["SingleLayout", "namespace_keys"]
