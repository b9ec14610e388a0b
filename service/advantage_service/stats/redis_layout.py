"""Where the Redis stats store keeps what: one interface (:class:`Layout`) with two layouts, one
Redis (:class:`.redis_single.SingleLayout`) and a Redis Cluster
(:class:`.redis_cluster.ClusterLayout`), and :class:`FirstContact`, which asks the node of the
store's URL which of the two at the first operation that reaches it. The store chooses one of
these once, in its constructor, and hands every operation to it.

A layout sends, and reports what reached Redis through the :class:`.redis_common.RedisContext`
it was given (the store's backoff and callbacks); the store wraps reads, pings and statistics
reads in :meth:`.RedisContext.call`, a layout's writes report for themselves (a cluster's write
may reach part of the cluster).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from .base import LOST, Read, Recording, RecordKey, Write
from .redis_common import RedisContext, Unavailable
from .redis_single import SingleLayout
from .write_groups import Finished

log = logging.getLogger("advantage_service.stats.redis_store")


class Layout(Protocol):
    """One layout of the stats store's keys (see :mod:`.redis_store`)."""

    @property
    def degraded(self) -> bool:
        """Part of the store does not answer (a Redis Cluster with a master down)."""
        ...

    async def ping(self) -> bool:
        """True when Redis answers; raises when it cannot be reached."""
        ...

    async def read(self, namespace: str, keys: Sequence[RecordKey], request_id: str | None) -> Read:
        """The records of ``keys`` (those on a part that did not answer in
        :attr:`~.base.Read.unread`) and the digest of ``request_id``'s claim; raises when
        Redis cannot be reached."""
        ...

    async def record_write(self, write: Write) -> Recording:
        """:meth:`.base.StatsStore.record_write` (reachability reported to the context)."""
        ...

    async def statistics_records(self, namespace: str) -> list[bytes | None]:
        """Every statistics record of ``namespace`` (compacted and pending); raises when any
        could not be read (the statistics would be short)."""
        ...

    async def close(self) -> None: ...


class FirstContact:
    """The layout the node of the URL names at the first operation that reaches it (``INFO
    cluster``): the cluster layout (made by ``cluster``) when it runs in cluster mode, else
    ``one``. Until then, every operation asks first (and fails when the node does not answer)."""

    def __init__(
        self, context: RedisContext, one: SingleLayout, cluster: Callable[[], Layout]
    ) -> None:
        self.context = context
        self.one = one
        self._make_cluster = cluster
        self.chosen: Layout | None = None

    async def choose(self, *, write: bool = False) -> Layout:
        """The layout; asks the node once (raises when it does not answer)."""
        if self.chosen is None:
            if await self.one.node.runs_cluster(write=write):
                log.info("stats store: the Redis node runs in cluster mode: the cluster layout")
                self.chosen = self._make_cluster()
            else:
                self.chosen = self.one
        return self.chosen

    @property
    def degraded(self) -> bool:
        return self.chosen is not None and self.chosen.degraded

    async def ping(self) -> bool:
        return await (await self.choose()).ping()

    async def read(self, namespace: str, keys: Sequence[RecordKey], request_id: str | None) -> Read:
        return await (await self.choose()).read(namespace, keys, request_id)

    async def record_write(self, write: Write) -> Recording:
        if self.chosen is None:
            # (a write reports for itself: asking is an attempt of its own)
            try:
                await self.context.call("record", lambda: self.choose(write=True))
            except Unavailable:
                return Finished([LOST] * len(write.requests))
        assert self.chosen is not None
        return await self.chosen.record_write(write)

    async def statistics_records(self, namespace: str) -> list[bytes | None]:
        return await (await self.choose()).statistics_records(namespace)

    async def close(self) -> None:
        await self.one.close()
        if self.chosen is not None and self.chosen is not self.one:
            await self.chosen.close()


__all__ = ["FirstContact", "Layout"]
