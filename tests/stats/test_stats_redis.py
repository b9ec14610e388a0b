"""The Redis store against a real redis-server: TTLs, replicas, outages, round trips."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import numpy as np
import pytest
import redis
import redis.asyncio
import torch
from advantage_service.estimators.ktae_history import prompt_ids
from advantage_service.stats import MemoryStatsStore, RedisStatsStore
from advantage_service.wire.request import parse_request
from redis_support import RedisServer
from stats_helpers import (
    assert_same_stored,
    assert_token_stats_are_the_sum,
    history_body,
    random_groups,
    read_history,
    serve,
    update_of,
)

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

NS = "ns:with{odd}chars"


def body(seed: int, prompts: list[str], **extra: Any) -> dict[str, Any]:
    return history_body(NS, seed, prompts, **extra)


class CountingConnection(redis.asyncio.Connection):
    """Counts what the client sends: one send per command or per pipeline, i.e. round trips."""

    sends = 0

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        CountingConnection.sends += 1
        await super().send_packed_command(command, check_health)


def fast_store(server: RedisServer, **options: Any) -> RedisStatsStore:
    return RedisStatsStore(server.url, backoff_initial=0.1, backoff_max=0.4, **options)


async def test_every_key_has_a_ttl(redis_server: RedisServer) -> None:
    store = RedisStatsStore(redis_server.url, ttl_seconds=600, prefix="ttl", compact_after=2)
    try:
        await serve(store, body(1, ["a", "b"], request_id="r-1"))
        await serve(store, body(2, ["a", "c"]))
        await serve(store, body(3, ["c"]))
    finally:
        await store.close()
    sync = redis.Redis.from_url(redis_server.url)
    keys = sorted(k.decode() for k in sync.scan_iter(match="ttl:*"))
    kinds = {k.split("}:")[1].split(":")[0] for k in keys}
    # A compaction ran (2 pending deltas) and left neither its lock nor staged records behind.
    assert kinds == {"history", "claim", "write", "tokdelta", "tokstats"}, keys
    assert len(keys) == len(list(sync.scan_iter())), "every key is under the prefix"
    for key in keys:
        assert 0 < sync.ttl(key) <= 600, key
    # The namespace is encoded: its ':' and braces cannot collide with the layout.
    assert all(k.startswith("ttl:{ns%3Awith%7Bodd%7Dchars}:") for k in keys)


async def test_two_replicas_on_one_redis_share_history_statistics_and_request_ids(
    redis_server: RedisServer,
) -> None:
    a, b = RedisStatsStore(redis_server.url), RedisStatsStore(redis_server.url)
    try:
        first = body(3, ["p", "q"], request_id="shared-id")
        assert (await serve(a, first)).counted
        assert not (await serve(b, first)).counted, "the other replica sees the request id"
        assert await a.token_stats(NS, "key", 50) == await b.token_stats(NS, "key", 50)
        second = body(4, ["q", "p"])
        via_a, via_b = await serve(a, second), None
        query = prompt_ids(parse_request(second).batch)
        prior_a, prior_b = await read_history(a, NS, query), await read_history(b, NS, query)
        assert prior_a is not None and prior_b is not None
        assert_same_stored(prior_a, prior_b)
        assert float(prior_b.n_c.sum()) > 0 and prior_b.rows > 0
        via_b = await serve(b, body(5, ["p"]))
        assert via_b.prior is not None and via_a.prior is not None
        # b's prior for p includes a's second visit: the sum of both visits, decayed.
        assert float(via_b.prior.n_c[0] + via_b.prior.n_w[0]) > float(
            via_a.prior.n_c[1] + via_a.prior.n_w[1]
        )
    finally:
        await a.close()
        await b.close()


async def test_killing_redis_degrades_to_unavailable_and_a_restart_on_the_same_port_recovers(
    redis_server: RedisServer,
) -> None:
    errors: list[str] = []
    ups: list[bool] = []
    store = fast_store(redis_server, on_error=errors.append, on_up=ups.append)
    try:
        assert store.status == "down" and await store.ping() and store.status == "up"
        assert (await serve(store, body(6, ["k"]))).history == "empty"  # (a first visit)

        redis_server.kill()
        query = prompt_ids(parse_request(body(7, ["k"])).batch)
        start = time.perf_counter()
        assert await read_history(store, NS, query) is None
        assert time.perf_counter() - start < 1.0
        assert store.status == "down" and ups == [True, False]
        down = await serve(store, body(7, ["k"], request_id="during-outage"))
        assert down.history == "unavailable" and not down.counted
        assert down.result.advantages.shape == (down.req.batch.num_tokens,)
        assert await store.token_stats(NS, "key", 5) is None
        assert {"read_history", "record", "token_stats"} <= set(errors)

        redis_server.start()  # same port, empty (no persistence)
        deadline = time.monotonic() + 5.0
        while not await store.ping():
            assert time.monotonic() < deadline, "no recovery after the restart"
            time.sleep(0.05)
        assert store.status == "up" and ups == [True, False, True]
        again = await serve(store, body(7, ["k"], request_id="during-outage"))
        # (the restarted Redis is empty: read, nothing stored)
        assert again.history == "empty" and again.counted, "the failed write claimed nothing"
    finally:
        await store.close()


async def test_requests_keep_being_answered_while_redis_dies_mid_run(
    redis_server: RedisServer,
) -> None:
    store = fast_store(redis_server)
    histories: list[str] = []
    try:
        for i in range(48):
            if i == 10:
                redis_server.kill()
            if i == 22:
                redis_server.start()
            start = time.perf_counter()
            served = await serve(store, body(100 + i, [f"p{i % 3}"], request_id=f"r{i}"))
            assert time.perf_counter() - start < 1.5
            assert served.result.advantages.shape == (served.req.batch.num_tokens,)
            histories.append(served.history)
            time.sleep(0.03)
    finally:
        await store.close()
    # (three prompts: their first visits find nothing stored)
    assert histories[:10] == ["empty"] * 3 + ["applied"] * 7
    assert histories[10:22] == ["unavailable"] * 12
    # Restarted (empty): once the store reconnects (within its backoff), each prompt's first
    # visit reads nothing and every later one reads its history again.
    after = list(enumerate(histories))[22:]
    while after and after[0][1] == "unavailable":
        after.pop(0)
    assert len(after) >= 4, histories  # (reconnected, and a prompt visited twice since)
    seen: set[int] = set()
    for i, history in after:
        assert history == ("applied" if i % 3 in seen else "empty"), (i, histories)
        seen.add(i % 3)


async def test_a_hung_redis_times_out_quickly(redis_server: RedisServer) -> None:
    store = RedisStatsStore(redis_server.url, socket_timeout=0.3, backoff_initial=0.1)
    query = prompt_ids(parse_request(body(8, ["h"])).batch)
    try:
        assert await read_history(store, NS, query) is not None
        assert redis_server.process is not None
        os.kill(redis_server.process.pid, signal.SIGSTOP)
        try:
            start = time.perf_counter()
            assert await read_history(store, NS, query) is None
            assert time.perf_counter() - start < 1.0
        finally:
            os.kill(redis_server.process.pid, signal.SIGCONT)
        time.sleep(0.15)
        assert await read_history(store, NS, query) is not None
    finally:
        await store.close()


async def test_a_reply_that_came_while_the_process_was_not_running_is_read(
    redis_server: RedisServer,
) -> None:
    """Redis answers in time while this process is not running (its event loop held past the
    read timeout, as on a machine short of CPU): the reply is read, Redis is not taken for
    unreachable (it was, with a plain timer: the read was cancelled after its reply had come)."""
    errors: list[str] = []
    store = RedisStatsStore(
        redis_server.url, socket_timeout=0.3, backoff_initial=0.1, on_error=errors.append
    )
    query = prompt_ids(parse_request(body(8, ["h"])).batch)
    assert redis_server.process is not None
    pid = redis_server.process.pid
    loop = asyncio.get_running_loop()

    def starved() -> None:
        os.kill(pid, signal.SIGCONT)  # Redis answers now, and this process sleeps meanwhile
        time.sleep(0.6)

    try:
        assert await read_history(store, NS, query) is not None
        for read in (lambda: read_history(store, NS, query), store.ping):
            os.kill(pid, signal.SIGSTOP)
            loop.call_later(0.1, starved)
            start = time.perf_counter()
            assert await read() not in (None, False)
            assert 0.6 < time.perf_counter() - start < 1.5
        assert errors == [] and store.status == "up"
    finally:
        os.kill(pid, signal.SIGCONT)
        await store.close()


async def test_backoff_skips_attempts_until_it_expires(redis_server: RedisServer) -> None:
    durations: list[str] = []
    store = RedisStatsStore(
        redis_server.url,
        backoff_initial=1.0,
        on_duration=lambda op, seconds: durations.append(op),
    )
    try:
        assert await store.ping()
        redis_server.kill()
        assert not await store.ping()
        failed_at = time.monotonic()
        redis_server.start()
        attempts = len(durations)
        assert not await store.ping(), "still in backoff: not even tried"
        assert len(durations) == attempts
        time.sleep(max(0.0, failed_at + 1.05 - time.monotonic()))
        assert await store.ping() and len(durations) == attempts + 1
    finally:
        await store.close()


async def test_round_trips_per_request(redis_server: RedisServer) -> None:
    store = RedisStatsStore(redis_server.url, connection_class=CountingConnection)
    try:
        await store.ping()  # connect (the handshake is not a request's cost)
        for i, (extra, estimator, want) in enumerate(
            [
                ({}, {"outcome": "grpo", "ktae": {"history": "prompt"}}, 2),
                ({"request_id": "rt"}, {"outcome": "grpo", "ktae": {"history": "prompt"}}, 2),
                ({"request_id": "rt"}, {"outcome": "grpo", "ktae": {"history": "prompt"}}, 2),
                ({}, {"outcome": "grpo", "ktae": {}, "cscr": {}}, 1),
                ({}, "grpo", 1),
            ]
        ):
            groups = random_groups(
                np.random.default_rng(i), [f"g{j}" for j in range(8)], teacher=True
            )
            request = {"namespace": NS, "estimator": estimator, "groups": groups, **extra}
            CountingConnection.sends = 0
            await serve(store, request)
            assert CountingConnection.sends == want, (i, estimator)
        CountingConnection.sends = 0
        await store.token_stats(NS, "key", 10)
        assert CountingConnection.sends == 1
    finally:
        await store.close()


async def test_a_restart_between_requests_costs_no_request(redis_server: RedisServer) -> None:
    """Pooled connections die with the old process; the next request reconnects and counts."""
    store = RedisStatsStore(redis_server.url)
    try:
        assert (await serve(store, body(9, ["r"]))).counted
        redis_server.restart()
        served = await serve(store, body(10, ["r"], request_id="after-restart"))
        # (the restarted Redis keeps nothing: read, and nothing stored)
        assert served.history == "empty" and served.counted and store.status == "up"
    finally:
        await store.close()


async def test_a_resent_write_pipeline_applies_nothing_twice(redis_server: RedisServer) -> None:
    """What a redis-py retry after a broken connection does: the same claim, the same chunks."""
    # (A read past a short socket timeout on a busy machine would put the store in its backoff,
    # and the resend would be skipped: not this test's subject.)
    store = RedisStatsStore(redis_server.url, new_id=lambda: "fixed-claim", socket_timeout=10.0)
    try:
        served = await serve(store, body(11, ["s", "t"], request_id="resent"))
        query = prompt_ids(served.req.batch)
        before = (await read_history(store, NS, query), await store.token_stats(NS, "key", 10**6))
        update = await update_of(store, body(12, ["s", "t"]))
        claimed = await store.record_many(NS, ["resent"], update)
        # [] applied (the same claim: a resend of its own); None: Redis was not reached;
        # ["resent"]: taken for another write's request.
        assert claimed == [], claimed
        after = (await read_history(store, NS, query), await store.token_stats(NS, "key", 10**6))
        assert before[1] == after[1]
        assert before[0] is not None and after[0] is not None
        assert_same_stored(before[0], after[0])
    finally:
        await store.close()


def token_updates(seed: int, count: int) -> list[Any]:
    """The statistics updates of ``count`` requests without history."""
    from advantage_service.serving.compute import compute_request
    from advantage_service.serving.term_state import StateSession

    rng = np.random.default_rng(seed)
    updates = []
    for _ in range(count):
        request = {
            "namespace": NS,
            "estimator": {"outcome": "grpo", "ktae": {}, "cscr": {}},
            "groups": random_groups(rng, ["u0", "u1"], vocab=30, teacher=True),
        }
        req = parse_request(request)
        session = StateSession(MemoryStatsStore(), req, torch.device("cpu"))
        updates.append(session.update(compute_request(req, "cpu", session.context)))
    return updates


def pending(server: RedisServer) -> tuple[int, list[str]]:
    """Pending deltas of NS, and any staged record or lock left behind."""
    sync = redis.Redis.from_url(server.url)
    ns = "adv:{ns%3Awith%7Bodd%7Dchars}"
    leftovers = [k.decode() for k in sync.scan_iter(match=f"{ns}:stage:*")]
    leftovers += [k.decode() for k in sync.scan_iter(match=f"{ns}:toklock")]
    return int(sync.llen(f"{ns}:tokdelta")), leftovers


async def test_replicas_appending_and_compacting_concurrently_lose_no_counts(
    redis_server: RedisServer,
) -> None:
    a = RedisStatsStore(redis_server.url, compact_after=2)
    b = RedisStatsStore(redis_server.url, compact_after=3)
    updates = token_updates(51, 40)
    try:
        counted = await asyncio.gather(
            *((a if i % 2 else b).record(NS, None, update) for i, update in enumerate(updates))
        )
        assert all(counted)
        # The same request id sent to both replicas at once counts exactly once.
        twice = await asyncio.gather(
            a.record(NS, "both", updates[0]), b.record(NS, "both", updates[0])
        )
        assert sorted(twice) == [False, True]
        stats = await a.token_stats(NS, "key", 10**6)
        assert stats == await b.token_stats(NS, "key", 10**6)
    finally:
        await a.close()
        await b.close()
    assert_token_stats_are_the_sum(stats, [u.tokens for u in updates + updates[:1]])
    deltas, leftovers = pending(redis_server)
    assert deltas < 3 and leftovers == []


class BusyLoopConnection(redis.asyncio.Connection):
    """Connects while the event loop is busy elsewhere for longer than the connect timeout
    (other requests' work on a loaded machine): the loop blocks inside the connect's window."""

    def _connection_arguments(self) -> Any:
        time.sleep(0.8)
        return super()._connection_arguments()


async def test_a_write_whose_connect_a_busy_event_loop_holds_up_still_counts(
    redis_server: RedisServer,
) -> None:
    # Writes run after the response: a 0.5 s connect budget (the reads') lost their counts.
    store = RedisStatsStore(
        redis_server.url, connect_timeout=0.5, connection_class=BusyLoopConnection
    )
    update = token_updates(57, 1)[0]
    reader = RedisStatsStore(redis_server.url)
    try:
        assert await store.record(NS, None, update)
        stats = await reader.token_stats(NS, "key", 10**6)
    finally:
        await store.close()
        await reader.close()
    assert_token_stats_are_the_sum(stats, [update.tokens])


async def test_a_compactor_that_dies_holding_the_lock_leaves_its_deltas_to_the_next(
    redis_server: RedisServer,
) -> None:
    store = RedisStatsStore(redis_server.url, compact_after=2, lock_ms=300)
    updates = token_updates(53, 8)
    sync = redis.Redis.from_url(redis_server.url)
    # A replica took the lock (and maybe read the deltas) and died: its lock only expires.
    assert sync.set(store.lock_key(NS), "dead", nx=True, px=300)
    try:
        for update in updates[:4]:
            assert await store.record(NS, None, update)
        assert pending(redis_server)[0] == 4, "no compaction while the lock is held"
        assert_token_stats_are_the_sum(
            await store.token_stats(NS, "key", 10**6), [u.tokens for u in updates[:4]]
        )
        await asyncio.sleep(0.35)
        for update in updates[4:]:
            assert await store.record(NS, None, update)
        assert_token_stats_are_the_sum(
            await store.token_stats(NS, "key", 10**6), [u.tokens for u in updates]
        )
    finally:
        await store.close()
    deltas, leftovers = pending(redis_server)
    assert deltas < 2 and leftovers == []


async def test_a_compactor_that_lost_its_lock_commits_nothing(redis_server: RedisServer) -> None:
    """A compacts slowly: its lock expires, B takes it and compacts the same deltas. A's
    commit must then be refused, or those deltas would count twice."""
    from advantage_service.stats import redis_store

    calls = []

    def merge_slowly_the_first_time(records: list[bytes | None]) -> bytes:
        calls.append(len(records))
        if len(calls) == 1:
            time.sleep(0.4)
        return redis_store.merge_records(records)

    options = {"compact_after": 100, "lock_ms": 200, "merge": merge_slowly_the_first_time}
    slow = redis_store.RedisStatsStore(redis_server.url, **options)
    fast = redis_store.RedisStatsStore(redis_server.url, **options)
    updates = token_updates(57, 6)
    sync = redis.Redis.from_url(redis_server.url)
    try:
        for update in updates[:4]:
            assert await slow.record(NS, None, update)
        assert sync.set(slow.lock_key(NS), "slow", nx=True, px=200)
        slow_compaction = asyncio.create_task(slow.compact(NS, "slow"))
        await asyncio.sleep(0.25)  # the slow one is merging; its lock has expired
        assert sync.set(fast.lock_key(NS), "fast", nx=True, px=200)
        await fast.compact(NS, "fast")
        assert pending(redis_server)[0] == 0
        assert await fast.record(NS, None, updates[4])
        await slow_compaction
        assert calls == [5, 5], "both read the compacted record and the 4 deltas"
        assert pending(redis_server) == (1, []), "the refused commit trimmed nothing"
        assert await slow.record(NS, None, updates[5])
        assert_token_stats_are_the_sum(
            await slow.token_stats(NS, "key", 10**6), [u.tokens for u in updates]
        )
    finally:
        await slow.close()
        await fast.close()


async def test_keys_of_the_earlier_layout_are_left_alone(redis_server: RedisServer) -> None:
    """A deploy over a Redis holding the hash layout: its keys must not fail reads or writes
    (a GET of a hash answers WRONGTYPE); they just expire."""
    sync = redis.Redis.from_url(redis_server.url)
    ns = "adv:{ns%3Awith%7Bodd%7Dchars}"
    sync.hset(f"{ns}:hist:old", mapping={"t": b"x" * 40, "5": b"y" * 40})
    sync.hset(f"{ns}:req:old-id", "claim", "someone")
    sync.hset(f"{ns}:tok:occ", "5", 3)
    store = RedisStatsStore(redis_server.url)
    try:
        for visit in range(2):
            served = await serve(store, body(61, ["old"], request_id="old-id"))
            # (the old layout's keys are not read: the first visit finds nothing)
            assert served.history == ("applied" if visit else "empty") and store.status == "up"
        assert served.prior is not None and float(served.prior.n_c[0] + served.prior.n_w[0]) > 0
    finally:
        await store.close()
    assert sync.type(f"{ns}:hist:old") == b"hash"


async def test_a_full_redis_evicts_old_histories_and_they_start_over(
    redis_server: RedisServer,
) -> None:
    """docs/deploy.md: with too little memory, volatile-lru evicts the least recently used
    histories; such a prompt is computed as on a first visit, and no request fails. A write
    Redis refuses for memory fails alone: the store stays up and history stays applied."""
    admin = redis.Redis.from_url(redis_server.url)
    baseline = int(admin.info("memory")["used_memory"])
    admin.config_set("maxmemory", baseline + 3_000_000)
    admin.config_set("maxmemory-policy", "volatile-lru")
    rng = np.random.default_rng(41)

    def wide(prompt: str) -> dict[str, Any]:
        """A prompt whose history holds ~1,500 token ids (~30 kB)."""
        rollouts = [
            {
                "tokens": rng.choice(200_000, size=400, replace=False).tolist(),
                "reward": float(i % 2),
            }
            for i in range(4)
        ]
        return {
            "namespace": NS,
            "estimator": {"outcome": "grpo", "ktae": {"history": "prompt"}},
            "groups": [{"id": prompt, "rollouts": rollouts}],
        }

    # (reads of ~30 kB histories: the 0.5 s default read timeout is no subject here, and a
    # loaded machine reached it)
    store = RedisStatsStore(redis_server.url, socket_timeout=5.0)
    try:
        prompts = [f"wide-{i}" for i in range(200)]  # ~6 MB of history: twice what fits
        counted = 0
        for prompt in prompts:
            if prompt == prompts[-1]:
                # Redis's LRU clock ticks once a second: written in the same second as the last
                # dozens, the newest would be as likely as they to be evicted (its own staged
                # record by its commit among them). A second later it is the newest.
                await asyncio.sleep(1.1)
            served = await serve(store, wide(prompt))
            assert served.history == "empty", prompt  # (each prompt's first visit)
            counted += served.counted
        assert int(admin.info("stats")["evicted_keys"]) > 0
        assert counted > len(prompts) // 2 and store.status == "up"
        # Redis's LRU is approximate: of the oldest prompts most are gone, the newest is kept.
        prior = await read_history(store, NS, prompts[:10] + prompts[-1:])
        assert prior is not None
        evicted = [p for p, h in zip(prompts[:10], prior.stored[:10], strict=True) if h is None]
        assert len(evicted) >= 5, "the least recently used histories were evicted"
        assert prior.stored[-1] is not None and prior.stored[-1].rows > 1000
        # An evicted prompt starts over: its scores are those of a first visit.
        again = wide(evicted[0])
        served = await serve(store, again)
        first_visit = await serve(store, {**again, "namespace": "fresh"})
        assert served.history == "empty" and served.prior is not None
        assert float(served.prior.n_c[0] + served.prior.n_w[0]) == 0.0
        assert np.array_equal(
            served.result.advantages.numpy(), first_visit.result.advantages.numpy()
        )
    finally:
        await store.close()
        admin.close()


async def test_replicas_with_and_without_compression_read_each_others_history(
    redis_server: RedisServer,
) -> None:
    """ADV_STATS_COMPRESSION can differ between replicas (or change on a running deployment):
    each reads both kinds of record."""
    from advantage_service.config import Settings
    from advantage_service.estimators.ktae_history import SPACE, is_compressed
    from advantage_service.observability.metrics import Metrics
    from advantage_service.serving.engine import Engine

    engine = Engine(
        Settings(device="cpu", redis_url=redis_server.url, stats_compression="zstd"),
        Metrics(process=False),
    )
    # The setting reaches the writes of the engine's requests.
    assert engine.write_options.compression == "zstd"
    packed = engine.store
    raw = RedisStatsStore(redis_server.url)
    admin = redis.Redis.from_url(redis_server.url)

    def key(prompt: str) -> str:
        return raw.record_key(NS, (SPACE, prompt))

    try:
        assert isinstance(packed, RedisStatsStore)
        await serve(raw, body(50, ["plain"]), compression="none")
        await serve(packed, body(51, ["packed"]), compression="zstd")
        blobs = [admin.get(key(p)) for p in ("plain", "packed")]
        assert not is_compressed(blobs[0]) and is_compressed(blobs[1])
        by_raw = await read_history(raw, NS, ["plain", "packed"])
        by_packed = await read_history(packed, NS, ["plain", "packed"])
        assert by_raw is not None and by_packed is not None and by_raw.rows > 0
        assert_same_stored(by_raw, by_packed)
        # A visit through the compressing replica rewrites a raw record compressed, same counts.
        await serve(packed, body(52, ["plain"]), compression="zstd")
        assert is_compressed(admin.get(key("plain")))
    finally:
        await raw.close()
        await packed.close()
        admin.close()


async def test_a_write_redis_refuses_fails_alone_without_backoff(
    redis_server: RedisServer,
) -> None:
    """An error reply (here OOM: maxmemory reached under noeviction) is not an outage: the
    write is counted as failed, nothing of it is committed, and reads go on at once."""
    errors: list[str] = []
    store = RedisStatsStore(redis_server.url, on_error=errors.append)
    admin = redis.Redis.from_url(redis_server.url)
    try:
        first = await serve(store, body(60, ["full"]))
        assert first.counted
        before = await read_history(store, NS, ["full"])
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", 1)  # every write command is refused
        refused = await serve(store, body(61, ["full"], request_id="refused"))
        assert refused.history == "applied" and not refused.counted
        assert errors == ["record"] and store.status == "up"
        # No backoff: the next read is attempted (and answered) right away.
        after = await read_history(store, NS, ["full"])
        assert after is not None and before is not None and errors == ["record"]
        assert_same_stored(before, after)
        admin.config_set("maxmemory", 0)
        again = await serve(store, body(61, ["full"], request_id="refused"))
        assert again.counted, "the refused request id was never claimed"
    finally:
        await store.close()
        admin.close()


async def test_a_coalesced_write_is_one_round_trip_and_a_refused_one_leaves_nothing(
    redis_server: RedisServer,
) -> None:
    from advantage_service.estimators.state import WriteOptions
    from advantage_service.serving.compute import compute_request
    from advantage_service.serving.term_state import StateSession, fold_writes

    store = RedisStatsStore(redis_server.url, connection_class=CountingConnection)
    try:
        await store.ping()
        writes = []
        for seed in range(6):
            req = parse_request(body(seed, ["k0", "k1", f"x{seed}"]))
            session = StateSession(store, req, torch.device("cpu"))
            result = await asyncio.to_thread(compute_request, req, "cpu", session.context)
            await session.settle()
            writes.append(session.writes(result))
        update = fold_writes(writes, WriteOptions())
        CountingConnection.sends = 0
        assert await store.record_many(NS, [f"id{i}" for i in range(6)], update) == []
        assert CountingConnection.sends == 1, "six requests, one write"
        before = pending(redis_server)
        stats = await store.token_stats(NS, "key", 10**6)
        # One id of the write was counted before: nothing applied, nothing claimed or staged.
        assert await store.record_many(NS, ["new", "id3"], update) == ["id3"]
        assert pending(redis_server) == before and before[1] == []
        assert await store.token_stats(NS, "key", 10**6) == stats
        sync = redis.Redis.from_url(redis_server.url)
        assert not sync.exists("adv:{ns%3Awith%7Bodd%7Dchars}:claim:new")
    finally:
        await store.close()
