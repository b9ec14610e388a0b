"""How commands reach Redis: one send path over a node's pooled connections, and the two ways of
choosing the node, :class:`OneNode` (one Redis) and :class:`ClusterNodes` (the master of each
slot of a Redis Cluster), both made from one :class:`Connection`. The stats store and the viewer's
keep both send through these.

Commands go as :class:`Part` s: the commands of one hash slot, each given its replies (an error
reply in place) or the failure of its node. The rules, the same for every node:

- a pipeline is one write and the read of all its replies: one round trip;
- a read (``read=True``) is bounded by the read timeout, a write by the write timeout (writes
  carry megabytes and run after the response); the read timeout counts time this process ran
  (:func:`loop_timeout`): a reply that came in time while the process was starved of CPU is
  read, not taken for a Redis that did not answer;
- a connection that timed out, broke mid-reply or read something that is not RESP is closed,
  never reused (replies may be left on it); a broken pooled connection is retried once at once
  on a fresh one (a restarted Redis), nothing else is retried;
- a node that failed is left alone for a :class:`~.redis_common.Backoff` interval (on one
  Redis, the store's own backoff does this: it fails the whole store).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import redis.asyncio as redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
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

from .redis_common import Backoff, Commands, command

# The view of the cluster is refreshed at most this often while a node fails.
REFRESH_SECONDS = 0.5
# Redirections (MOVED, ASK) followed per part of an operation.
REDIRECTS = 2
ASKING = command(b"ASKING")
# Replies carry megabytes of records: read them in large pieces.
READ_SIZE = 1 << 20


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


class NodeFailed(Exception):
    """A node did not answer (or is in its backoff after failing)."""


class Connections(Protocol):
    """Where one node's pooled connections come from and go back to."""

    async def acquire(self) -> Any: ...

    async def release(self, conn: Any) -> None: ...


@dataclass
class PoolConnections:
    pool: redis.ConnectionPool

    async def acquire(self) -> Any:
        return await self.pool.get_connection()

    async def release(self, conn: Any) -> None:
        await self.pool.release(conn)


@dataclass
class NodeConnections:
    node: ClusterNode

    async def acquire(self) -> Any:
        return self.node.acquire_connection()

    async def release(self, conn: Any) -> None:
        self.node.release(conn)


# A timer that runs more than LATE_SECONDS after its time found the event loop busy or the process
# not scheduled (a replica starved of CPU): a reply may have come in time and wait unread in the
# socket. It then gives the read LATE_SECONDS more, up to STRETCH times its timeout in all.
LATE_SECONDS = 0.05
STRETCH = 4


class Deadline:
    """The deadline of :func:`loop_timeout`: :meth:`restart` gives the read its whole timeout
    again from now (one timer for a pipeline whose every reply has the timeout)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, seconds: float) -> None:
        self.loop, self.seconds = loop, seconds
        self.restart()

    def restart(self) -> None:
        self.at = self.loop.time() + self.seconds
        self.limit = self.at + (STRETCH - 1) * self.seconds


@contextlib.asynccontextmanager
async def loop_timeout(seconds: float | None) -> AsyncIterator[Deadline | None]:
    """``asyncio.timeout(seconds)`` (None: none) that does not fire while the event loop was
    late. asyncio runs the callbacks of what the socket received before the timers that are due,
    but the task they wake only after them: in a process that was not running when its timeout
    came (a busy machine, a CPU limit), a plain timeout cancels a read whose reply arrived in
    time, and the store takes Redis for unreachable (a replica restarted on a loaded machine
    did so three times in a second, and lost 11 requests' statistics). A hung Redis still times
    out on time: the loop is not late then."""
    if seconds is None:
        yield None
        return
    loop = asyncio.get_running_loop()
    deadline = Deadline(loop, seconds)
    async with asyncio.timeout(None) as timer:

        def due(planned: float) -> None:
            now = loop.time()
            if now < deadline.at:  # (restarted meanwhile)
                handle[0] = loop.call_at(deadline.at, due, deadline.at)
            elif now - planned > LATE_SECONDS and now < deadline.limit:
                later = now + LATE_SECONDS
                handle[0] = loop.call_at(later, due, later)
            else:
                timer.reschedule(now)  # (expired: the task is cancelled, TimeoutError)

        handle = [loop.call_at(deadline.at, due, deadline.at)]
        try:
            yield deadline
        finally:
            handle[0].cancel()


async def send(
    connections: Connections,
    commands: Commands,
    timeout: float | None = None,
    count: Callable[[], None] | None = None,
    *,
    each: bool = False,
) -> list[Any]:
    """``commands`` in one write, their replies (error replies in place): one round trip, all
    its replies within ``timeout`` (``each``: each reply within it, as one Redis's reads have
    always been bounded) (else TimeoutError; None: each socket operation within the client's
    socket timeout). Used instead of redis-py's pipeline so that megabyte records go to the
    socket as they are, without a copy per command. ``count`` is called per pipeline sent."""
    chunks = [chunk for cmd in commands for chunk in cmd]
    for attempt in range(2):
        conn = await connections.acquire()
        try:
            if count is not None:
                count()
            await conn.send_packed_command(chunks, check_health=False)
            replies: list[Any] = []
            # Not read_response(timeout=...): past that timeout it returns None and leaves the
            # late reply on the connection, which the next call would read as its own. A
            # timeout here cancels the read, and the connection is closed below. (inf: none of
            # the connection's own, whose timer is not patient with a late event loop.)
            within = math.inf if timeout is not None else None
            async with loop_timeout(timeout) as deadline:
                for _ in commands:
                    try:
                        replies.append(await conn.read_response(timeout=within))
                    except ResponseError as exc:
                        replies.append(exc)
                    if each and deadline is not None:
                        deadline.restart()
            return replies
        except RedisConnectionError:
            await conn.disconnect()
            if attempt:
                raise
        except BaseException:
            # A timeout, a reply that is not RESP, a cancellation: replies may be left unread,
            # the connection cannot be reused.
            await conn.disconnect()
            raise
        finally:
            await connections.release(conn)
    raise AssertionError("unreachable")


def replies_of(part: Part) -> list[Any]:
    """A part's replies; raises its failure, or the first error reply among them."""
    result = part.result
    if isinstance(result, BaseException):
        raise result
    assert result is not None
    for reply in result:
        if isinstance(reply, BaseException):
            raise reply
    return result


class Nodes(Protocol):
    """Sends parts to the node of their slot."""

    async def run(self, parts: Sequence[Part], *, read: bool = False) -> None:
        """Every part gets its replies or its node's failure; raises when Redis cannot be
        reached at all."""
        ...

    async def close(self) -> None: ...


async def run_scripts(nodes: Nodes, parts: Sequence[Part]) -> None:
    """:meth:`Nodes.run` for parts that end with a script by its digest; those sent to a node
    that had not loaded it (NOSCRIPT: nothing of them applied) go again with its text."""
    await nodes.run(parts)
    unknown = []
    for part in parts:
        result = part.result
        if isinstance(result, list) and result and isinstance(result[-1], NoScriptError):
            assert part.fallback is not None
            part.commands[-1] = part.fallback
            unknown.append(part)
    if unknown:
        await nodes.run(unknown)


@dataclass(frozen=True)
class Connection:
    """How to reach a Redis (one node, or a Redis Cluster from one node's URL): the timeout of
    every socket operation of reads and pings (``socket_timeout``), of writes, which run after
    the response and may carry megabytes (``write_timeout``), of a connect; the rest of the
    options go to redis-py's ``from_url``. The stats store and the viewer's keep share it."""

    url: str
    socket_timeout: float
    write_timeout: float
    connect_timeout: float
    redis_kwargs: dict[str, Any] = field(default_factory=dict)

    def options(self) -> dict[str, Any]:
        return {
            "socket_connect_timeout": self.connect_timeout,
            "decode_responses": False,
            "socket_read_size": READ_SIZE,
            **self.redis_kwargs,
        }


class OneNode:
    """One Redis: reads and writes over separate pools (a read waits behind no write).
    ``count`` is called per pipeline sent."""

    def __init__(self, connection: Connection, count: Callable[[], None] | None = None) -> None:
        url, connect_timeout = connection.url, connection.connect_timeout
        socket_timeout, write_timeout = connection.socket_timeout, connection.write_timeout
        kwargs = connection.options()
        # One immediate retry on a broken connection (a pooled socket that died with a
        # restarted Redis) for the commands redis-py sends itself (INFO, PING).
        kwargs.setdefault("retry", Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)))
        self.reader = redis.Redis.from_url(url, socket_timeout=socket_timeout, **kwargs)
        # A write runs after its response, so it may wait for a connection as long as for its
        # reply: a connect held up by a busy event loop (many requests' work on a loaded
        # machine) would otherwise lose an answered request's statistics.
        write_kwargs = {**kwargs, "socket_connect_timeout": max(connect_timeout, write_timeout)}
        self.writer = redis.Redis.from_url(url, socket_timeout=write_timeout, **write_kwargs)
        self.read_timeout = socket_timeout
        self.count = count

    async def run(self, parts: Sequence[Part], *, read: bool = False) -> None:
        """Every part in one pipeline (the one node holds every slot); raises when it fails."""
        client = self.reader if read else self.writer
        commands = [c for part in parts for c in part.commands]
        timeout = self.read_timeout if read else None
        pool = PoolConnections(client.connection_pool)
        replies = await send(pool, commands, timeout, self.count, each=True)
        start = 0
        for part in parts:
            part.result = replies[start : start + len(part.commands)]
            start += len(part.commands)

    async def runs_cluster(self, *, write: bool = False) -> bool:
        """Whether the node runs in cluster mode (raises when it does not answer); a write asks
        over the write pool, with its budget."""
        try:
            info = await (self.writer if write else self.reader).info("cluster")
        except ResponseError:  # (INFO not allowed, as on some managed Redis: one Redis)
            info = {}
        return str(info.get("cluster_enabled", 0)) == "1"

    async def ping(self) -> bool:
        # Both pools: reads and writes go over separate connections. (The read pool's through
        # send, whose timeout is patient with a late event loop.)
        pool = PoolConnections(self.reader.connection_pool)
        (pong,) = await send(pool, [command(b"PING")], self.read_timeout)
        return pong in (True, b"PONG") and bool(await self.writer.ping())

    degraded = False

    async def close(self) -> None:
        await self.reader.aclose()
        await self.writer.aclose()


class ClusterNodes:
    """A Redis Cluster (redis-py's ``RedisCluster``: its view of the slots and nodes, its
    connections to each node): each node gets one pipeline per operation (all the parts of its
    slots), every node at once. A node that does not answer fails only its own slots' parts and
    is skipped for its backoff; the view of the cluster is refreshed (``CLUSTER SLOTS``) while a
    node is failing and on a ``MOVED`` reply, so the sender follows a failover."""

    def __init__(
        self, connection: Connection, backoff: Backoff, count: Callable[[], None] | None = None
    ) -> None:
        self.read_timeout = connection.socket_timeout
        self.backoff = backoff
        self.count = count
        # Sends use the write timeout (writes carry megabytes); reads pass the read timeout.
        self.client = RedisCluster.from_url(
            connection.url,
            socket_timeout=connection.write_timeout,
            # The other masters go on serving while one shard has none.
            require_full_coverage=False,
            **connection.options(),
        )
        self.nodes: dict[str, Backoff] = {}
        self._refresh_at = 0.0
        self._stale = False

    @property
    def degraded(self) -> bool:
        """Some masters of the cluster's current view did not answer their last call."""
        primaries = {node.name for node in self.client.get_primaries()}
        return any(name in primaries for name in self.nodes)

    def _failed(self, node: ClusterNode) -> None:
        state = self.nodes.get(node.name)
        if state is None:
            state = self.nodes[node.name] = Backoff(self.backoff.initial, self.backoff.maximum)
        state.failed()
        self._stale = True

    def _skipped(self, node: ClusterNode) -> bool:
        state = self.nodes.get(node.name)
        return state is not None and state.waiting

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
            self.nodes = {name: state for name, state in self.nodes.items() if name in known}

    async def ping(self) -> bool:
        """Ping every master at once (those in their backoff count as failed): True when one
        answered at least (up, maybe degraded); raises when none did."""
        await self._view()
        pings = [(node, Part(0, [command(b"PING")])) for node in self.client.get_primaries()]
        timeout = self.read_timeout
        await asyncio.gather(*(self._run_node(node, [part], timeout) for node, part in pings))
        if not pings or all(failed(part) for _, part in pings):
            raise RedisConnectionError("no master of the Redis Cluster answered")
        return True

    async def close(self) -> None:
        await self.client.aclose()

    async def run(self, parts: Sequence[Part], *, read: bool = False) -> None:
        """Send every part to the master of its slot: one pipeline per node, all nodes at once.
        Follows MOVED and ASK replies (the view is updated) up to REDIRECTS times. Raises when
        the cluster cannot be reached at all."""
        timeout = self.read_timeout if read else None
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
            replies = await send(NodeConnections(node), commands, timeout, self.count)
        except (TimeoutError, RedisError, OSError) as exc:
            self._failed(node)
            for part in parts:
                part.result = exc
            return
        self.nodes.pop(node.name, None)
        start = 0
        for part in parts:
            count = len(part.commands) * (2 if part.asking is not None else 1)
            mine = replies[start : start + count]
            start += count
            part.result = mine[1::2] if part.asking is not None else mine
            if any(isinstance(r, (ClusterDownError, TryAgainError)) for r in part.result):
                self._stale = True


def failed(part: Part) -> bool:
    """True when a part did not get every reply, or got an error reply."""
    result = part.result
    return not isinstance(result, list) or any(isinstance(r, BaseException) for r in result)


def _redirect(result: list[Any] | BaseException | None) -> AskError | None:
    """The first MOVED or ASK reply among a part's replies."""
    if isinstance(result, list):
        for reply in result:
            if isinstance(reply, AskError):  # (MovedError is an AskError)
                return reply
    return None


__all__ = [
    "ClusterNodes",
    "Connection",
    "NodeFailed",
    "Nodes",
    "OneNode",
    "Part",
    "failed",
    "loop_timeout",
    "replies_of",
    "run_scripts",
    "send",
]
