"""The stats store on a real Redis Cluster (3 masters, started by the fixture): the cluster is
found from one node's URL, one namespace spreads over every master, a request id is counted
once per slot (resends, retried pipelines, two replicas at once), a resend completes what an
earlier write left missing, and the answers equal a single Redis's."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import redis
import torch
from advantage_client.grpc_client import compute_response_dict
from advantage_service.config import Settings
from advantage_service.estimators.ktae_history import SPACE
from advantage_service.estimators.state import WriteOptions
from advantage_service.observability.metrics import Metrics
from advantage_service.serving.engine import Engine
from advantage_service.serving.term_state import PendingWrites, fold_records
from advantage_service.stats import RedisStatsStore, StatsUpdate
from advantage_service.stats.base import COUNTED, DUPLICATE, LOST, RecordKey, RequestWrite
from advantage_service.stats.blobs import merge_token_stats
from advantage_service.stats.redis_cluster import ClusterLayout, Part, _script_reply
from advantage_service.transports.arrow import RESPONSE_METADATA, encode_response
from advantage_service.transports.grpc_codec import encode_compute_response
from advantage_service.wire.request import parse_request
from advantage_service.wire.response import build_response
from redis_cluster_support import LocalCluster
from redis_support import RedisServer
from stats_helpers import (
    assert_token_stats_are_the_sum,
    history_body,
    record_folded,
    small_tokens,
    writes_of,
)

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

NS = "run{7}/cluster"
EVERYTHING = 10**6
RETURN = {"return": ["ktae_score"]}


def body(seed: int, prompts: list[str], **extra: Any) -> dict[str, Any]:
    return history_body(NS, seed, prompts, **extra)


def layout(store: RedisStatsStore) -> ClusterLayout:
    assert store.cluster is not None, "the store did not take the cluster layout"
    return store.cluster


async def write(store: RedisStatsStore, writes: list[PendingWrites]) -> list[str]:
    """``writes`` in one round, handed over as the service's writer does: the outcomes."""
    requests = [RequestWrite(w.request_id, tuple(w.records), w.tokens) for w in writes]

    def fold(keys: frozenset[RecordKey], keep: tuple[int, ...]) -> dict[RecordKey, bytes]:
        return fold_records([writes[i] for i in keep], WriteOptions(), keys)

    records = fold_records(writes, WriteOptions())
    update = StatsUpdate(records, merge_token_stats([w.tokens for w in writes]))
    return await record_folded(store, NS, requests, update, fold)


def keys_per_master(cluster: LocalCluster, pattern: str) -> dict[int, int]:
    out = {}
    for port in cluster.masters():
        with cluster.client(port) as client:
            out[port] = sum(1 for _ in client.scan_iter(match=pattern, count=1000))
    return out


async def history(store: RedisStatsStore, prompts: list[str]) -> list[bytes | None]:
    records = await store.read_records(NS, [(SPACE, p) for p in prompts])
    assert records is not None
    return records


async def statistics(store: RedisStatsStore) -> dict[str, Any]:
    stats = await store.token_stats(NS, "occurrences", EVERYTHING)
    assert stats is not None
    return stats


async def test_the_store_finds_the_cluster_from_one_nodes_url_and_one_redis_stays_as_it_was(
    redis_cluster: LocalCluster, redis_server: RedisServer
) -> None:
    on_cluster = RedisStatsStore(redis_cluster.url)
    on_one = RedisStatsStore(redis_server.url)
    prompts = [f"p{i}" for i in range(24)]
    try:
        assert await on_cluster.ping() and await on_one.ping()
        assert on_cluster.cluster is not None and on_one.cluster is None
        assert on_cluster.status == on_one.status == "up"
        for store in (on_cluster, on_one):
            assert await write(store, [await writes_of(store, body(1, prompts, request_id="r"))])
            assert all(r is not None for r in await history(store, prompts))
            assert (await statistics(store))["rollouts_counted"] > 0
        # Every master holds some of the run's history; one Redis keeps today's layout.
        assert all(keys_per_master(redis_cluster, "adv:*:history:*").values())
        with redis.Redis.from_url(redis_server.url) as client:
            assert [k.decode() for k in client.keys("adv:*:history:p1")] == [
                "adv:{run%7B7%7D%2Fcluster}:history:p1"
            ]
    finally:
        await on_cluster.close()
        await on_one.close()


async def test_one_namespace_spreads_over_every_master(redis_cluster: LocalCluster) -> None:
    """3000 prompts of one run: every master holds its share of the records (within 20% of
    their mean), and the statistics buckets are spread over the masters too."""
    store = RedisStatsStore(redis_cluster.url, buckets=16)
    try:
        for start in range(0, 3000, 100):
            records = {(SPACE, f"prompt-{i}"): b"r" * 16 for i in range(start, start + 100)}
            request = RequestWrite(f"req-{start}", tuple(records), small_tokens(start))
            update = StatsUpdate(records, request.tokens)
            assert await record_folded(store, NS, [request], update) == [COUNTED]
        assert (await statistics(store))["rollouts_counted"] == 60
    finally:
        await store.close()
    counts = keys_per_master(redis_cluster, "adv:*:history:*")
    mean = sum(counts.values()) / len(counts)
    assert sum(counts.values()) == 3000
    assert all(abs(c - mean) <= 0.2 * mean for c in counts.values()), counts
    buckets = keys_per_master(redis_cluster, "adv:{*:b*}:tok*")
    assert sum(1 for c in buckets.values() if c) >= 2, buckets


async def engine_run(url: str, requests: list[dict[str, Any]]) -> tuple[list[Any], Any]:
    """The requests one after the other through an engine on ``url``: their results, and the
    namespace's statistics after them."""
    engine = Engine(Settings(device="cpu", redis_url=url), Metrics(process=False))
    await engine.start()
    try:
        results = []
        for request in requests:
            computed = await engine.compute(parse_request(request), "test")
            assert computed.summary["recorded"]
            await engine.settle_writes()
            results.append((computed.summary["history"], computed.result))
        return results, await engine.store.token_stats(NS, "key", EVERYTHING)
    finally:
        await engine.flush()
        engine.close()


async def test_answers_and_statistics_equal_a_single_redis(
    redis_cluster: LocalCluster, redis_server: RedisServer
) -> None:
    """The same requests (prompts revisited, a resent request id) through the engine on one
    Redis and on the cluster: the same answers and the same statistics."""
    prompts = [f"q{i}" for i in range(12)]
    requests = [
        body(i, prompts[i % 3 * 4 : i % 3 * 4 + 8], request_id=f"id-{i}", **RETURN)
        for i in range(6)
    ]
    requests.insert(4, requests[2])  # resent: answered, not counted again
    one, one_stats = await engine_run(redis_server.url, requests)
    many, many_stats = await engine_run(redis_cluster.url, requests)
    assert [h for h, _ in one] == [h for h, _ in many]
    assert [h for h, _ in many][1:] == ["applied"] * (len(requests) - 1)
    for (_, a), (_, b) in zip(one, many, strict=True):
        assert torch.equal(a.advantages, b.advantages)
        assert torch.equal(a.diagnostics["ktae_score"], b.diagnostics["ktae_score"])
    assert one_stats["rollouts_counted"] == many_stats["rollouts_counted"]
    rows = {r["token_id"]: r for r in one_stats["tokens"]}
    assert sorted(rows) == sorted(r["token_id"] for r in many_stats["tokens"])
    for row in many_stats["tokens"]:
        other = rows[row["token_id"]]
        for name in ("correct_rollouts", "wrong_rollouts", "occurrences"):
            assert row[name] == other[name]
        for name in ("key_score", "mean_sensitivity"):
            assert (row[name] is None) == (other[name] is None)
            if row[name] is not None:  # (float sums merged in another order)
                assert row[name] == pytest.approx(other[name], rel=1e-6, abs=1e-12)


def block(store: RedisStatsStore, port: int) -> None:
    """Make the store treat the master on ``port`` as unreachable (its backoff)."""
    from advantage_service.stats.redis_cluster import _NodeState

    name = f"127.0.0.1:{port}"
    layout(store)._nodes[name] = _NodeState(retry_at=time.monotonic() + 3600, backoff=1.0)


def unblock(store: RedisStatsStore) -> None:
    layout(store)._nodes.clear()


async def test_a_resend_completes_the_parts_a_failed_write_left_and_repeats_none(
    redis_cluster: LocalCluster,
) -> None:
    store = RedisStatsStore(redis_cluster.url)
    prompts = [f"r{i}" for i in range(30)]
    request = body(5, prompts, request_id="once")
    try:
        assert await store.ping()
        slots = {p: layout(store).record_slot(NS, (SPACE, p)) for p in prompts}
        down = redis_cluster.master_of(slots[prompts[0]])
        on_down = [p for p in prompts if redis_cluster.master_of(slots[p]) == down]
        elsewhere = [p for p in prompts if p not in on_down]
        writes = await writes_of(store, request)
        # The write while one master does not answer: its parts fail, the others apply, the
        # statistics wait (the request is not complete): lost, and the store says degraded.
        block(store, down)
        assert await write(store, [writes]) == [LOST]
        assert store.status == "degraded"
        unblock(store)
        first = await history(store, prompts)
        assert all(first[prompts.index(p)] is not None for p in elsewhere)
        assert all(first[prompts.index(p)] is None for p in on_down)
        assert (await statistics(store))["rollouts_counted"] == 0
        # The resend (computed again from what it reads now: the history written elsewhere
        # would change its records there) completes the missing parts only, and counts once.
        again = await writes_of(store, request)
        assert await write(store, [again]) == [COUNTED]
        second = await history(store, prompts)
        for p in elsewhere:
            assert second[prompts.index(p)] == first[prompts.index(p)], "applied twice"
        for p in on_down:
            assert second[prompts.index(p)] == fold_records([again], WriteOptions())[(SPACE, p)]
        assert_token_stats_are_the_sum(await statistics(store), [writes.tokens])
        # A third time: nothing at all.
        assert await write(store, [await writes_of(store, request)]) == [DUPLICATE]
        assert await history(store, prompts) == second
        assert_token_stats_are_the_sum(await statistics(store), [writes.tokens])
    finally:
        await store.close()


async def test_a_resent_write_pipeline_applies_nothing_twice(redis_cluster: LocalCluster) -> None:
    """A part resent with the same write id (what a retry after a broken connection sends)
    finds its own write applied."""
    store = RedisStatsStore(redis_cluster.url, new_id=lambda: "fixed-write")
    prompts = [f"s{i}" for i in range(10)]
    try:
        assert await write(store, [await writes_of(store, body(11, prompts, request_id="a"))])
        before = (await history(store, prompts), await statistics(store))
        other = await writes_of(store, body(12, prompts, request_id="a"))
        assert await write(store, [other]) == [COUNTED], "the same write: applied before"
        assert (await history(store, prompts), await statistics(store)) == before
    finally:
        await store.close()


async def test_two_replicas_writing_the_same_request_id_at_once_count_it_once_per_slot(
    redis_cluster: LocalCluster,
) -> None:
    """Replicas A and B each write a round holding the same request ``shared`` (a client's
    resend to the other replica) and a request of their own. Per slot one of them claims and
    applies ``shared``'s part, the other folds its part again without it; the statistics
    count ``shared`` once; nothing of either replica's own request is lost."""
    counter = itertools.count()
    a = RedisStatsStore(redis_cluster.url, new_id=lambda: f"A-{next(counter)}")
    b = RedisStatsStore(redis_cluster.url, new_id=lambda: f"B-{next(counter)}")
    rounds = 12
    try:
        expected = []
        for k in range(rounds):
            shared = [f"x{k}-{i}" for i in range(9)]
            own_a, own_b = [f"a{k}-{i}" for i in range(3)], [f"b{k}-{i}" for i in range(3)]
            # The shared request's prompts plus each replica's own (a prompt of each in
            # common with the shared request: their parts fold two requests).
            w_shared = await writes_of(a, body(100 + k, shared, request_id=f"shared-{k}"))
            w_a = await writes_of(a, body(200 + k, [*own_a, shared[0]], request_id=f"a-{k}"))
            w_b = await writes_of(b, body(300 + k, [*own_b, shared[1]], request_id=f"b-{k}"))
            got_a, got_b = await asyncio.gather(
                write(a, [w_shared, w_a]), write(b, [w_shared, w_b])
            )
            assert sorted([got_a[0], got_b[0]]) == [COUNTED, DUPLICATE], (got_a, got_b)
            assert got_a[1] == got_b[1] == COUNTED
            expected += [w_shared.tokens, w_a.tokens, w_b.tokens]
            # Each replica's own prompts hold its own visit whoever won the shared parts.
            records = await history(a, own_a + own_b)
            want = fold_records([w_a], WriteOptions()) | fold_records([w_b], WriteOptions())
            assert records == [want[(SPACE, p)] for p in own_a + own_b]
        assert_token_stats_are_the_sum(await statistics(a), expected)
        claims = keys_per_master(redis_cluster, "adv:*:claim:shared-*")
        # One claim per slot the shared requests touched, plus one per statistics part.
        slots = {
            (k, layout(a).record_slot(NS, (SPACE, f"x{k}-{i}")))
            for k in range(rounds)
            for i in range(9)
        }
        assert sum(claims.values()) == len(slots) + rounds
    finally:
        await a.close()
        await b.close()


async def test_a_32_prompt_request_costs_one_round_trip_per_master_to_read_and_two_to_write(
    redis_cluster: LocalCluster,
) -> None:
    store = RedisStatsStore(redis_cluster.url)
    prompts = [f"t{i}" for i in range(32)]
    try:
        assert await store.ping()
        masters = {
            redis_cluster.master_of(layout(store).record_slot(NS, (SPACE, p))) for p in prompts
        }
        assert len(masters) == 3
        # (every master has run the write script once: it is sent by its digest)
        warm = await writes_of(store, body(20, prompts))
        assert await write(store, [warm]) == [COUNTED]
        before = store.round_trips
        writes = await writes_of(store, body(21, prompts, request_id="rt"))
        assert store.round_trips - before == 3, "the read: one pipeline per master"
        before = store.round_trips
        assert await write(store, [writes]) == [COUNTED]
        # The records (one pipeline per master), then the statistics (one bucket's master).
        assert store.round_trips - before == 3 + 1
        # Masters that do not know the script (restarted, or promoted replicas) answer NOSCRIPT
        # to its digest: those parts go again once, with its text (which loads it: the
        # statistics part after them finds it), and apply once.
        for port in redis_cluster.masters():
            with redis_cluster.client(port) as client:
                client.script_flush()
        before = store.round_trips
        again = await writes_of(store, body(22, prompts, request_id="rt-2"))
        assert await write(store, [again]) == [COUNTED]
        assert store.round_trips - before == 3 + (3 + 3) + 1
        assert_token_stats_are_the_sum(
            await statistics(store), [w.tokens for w in (warm, writes, again)]
        )
    finally:
        await store.close()


async def test_a_cluster_down_at_start_is_found_once_it_answers(tmp_path: Path) -> None:
    """ADV_REDIS_CLUSTER=true uses the cluster client while the node is down; unset, the store
    asks the node once it answers. Both report the store down, then up, without a restart."""
    cluster = LocalCluster(tmp_path / "late", masters=3)
    told = RedisStatsStore(cluster.url, cluster=True, backoff_initial=0.05, backoff_max=0.1)
    asks = RedisStatsStore(cluster.url, backoff_initial=0.05, backoff_max=0.1)
    try:
        for store in (told, asks):
            assert not await store.ping() and store.status == "down"
            assert await store.read_records(NS, [(SPACE, "p")]) is None
        assert told.cluster is not None and asks.cluster is None
        cluster.start()
        await asyncio.sleep(0.2)
        for store in (told, asks):
            assert await store.ping() and store.status == "up"
            assert store.cluster is not None
            assert await write(store, [await writes_of(store, body(31, ["late"]))]) == [COUNTED]
    finally:
        await told.close()
        await asks.close()
        cluster.stop()


async def test_groups_on_a_master_that_does_not_answer_lose_their_history_alone(
    redis_cluster: LocalCluster,
) -> None:
    """One master unreachable: the groups whose prompts live there are computed as a first
    visit and their stored history is left as it was; the others read and write theirs. The
    answer says which (summary.history ``partial``, a ``history`` on each group)."""
    engine = Engine(Settings(device="cpu", redis_url=redis_cluster.url), Metrics(process=False))
    await engine.start()
    store = engine.store
    assert isinstance(store, RedisStatsStore)
    prompts = [f"g{i}" for i in range(12)]
    try:
        await engine.compute(parse_request(body(41, prompts)), "test")
        await engine.settle_writes()
        before = await history(store, prompts)
        down = redis_cluster.master_of(layout(store).record_slot(NS, (SPACE, prompts[0])))
        on_down = {
            p
            for p in prompts
            if redis_cluster.master_of(layout(store).record_slot(NS, (SPACE, p))) == down
        }
        assert 0 < len(on_down) < len(prompts)
        block(store, down)
        computed = await engine.compute(parse_request(body(42, prompts)), "test")
        await engine.settle_writes()
        assert store.status == "degraded"
        want = ["unavailable" if p in on_down else "applied" for p in prompts]
        assert computed.summary["history"] == "partial"
        assert computed.summary["group_history"] == want
        answer = build_response(computed.request, computed.result, computed.summary)
        assert [g["history"] for g in answer["groups"]] == want
        assert "group_history" not in answer["summary"]
        # gRPC carries it in Summary.group_history, which the client puts on the groups as the
        # JSON answer does; Arrow in its summary.
        message = encode_compute_response(computed.request, computed.result, computed.summary)
        assert list(message.summary.group_history) == want
        as_json = compute_response_dict(message)
        assert [g["history"] for g in as_json["groups"]] == want
        assert "group_history" not in as_json["summary"]
        arrow = pa.ipc.open_stream(
            encode_response(computed.request, computed.result, computed.summary)
        ).read_all()
        meta = json.loads(arrow.schema.metadata[RESPONSE_METADATA])
        assert meta["summary"]["group_history"] == want
        unblock(store)
        after = await history(store, prompts)
        for p, old, new in zip(prompts, before, after, strict=True):
            assert (new == old) == (p in on_down), p
        assert (await engine.compute(parse_request(body(43, prompts)), "test")).summary[
            "history"
        ] == "applied"
        assert store.status == "up"
    finally:
        await engine.flush()
        engine.close()


def test_adv_redis_cluster_chooses_the_cluster_client_before_redis_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from advantage_service.serving.assembly import stats_store

    url = "redis://127.0.0.1:1/0"  # nothing listens there
    monkeypatch.setenv("ADV_REDIS_CLUSTER", "true")
    monkeypatch.setenv("ADV_REDIS_CLUSTER_BUCKETS", "4")
    told = stats_store(Settings(device="cpu", redis_url=url), Metrics(process=False))
    monkeypatch.delenv("ADV_REDIS_CLUSTER")
    asks = stats_store(Settings(device="cpu", redis_url=url), Metrics(process=False))
    assert isinstance(told, RedisStatsStore) and isinstance(asks, RedisStatsStore)
    assert told.cluster is not None and told.cluster.buckets == 4
    assert asks.cluster is None and told.status == asks.status == "down"


async def test_a_redis_that_refuses_info_is_taken_for_one_redis(tmp_path: Path) -> None:
    """Some managed Redis services refuse INFO: the store cannot ask, and uses one Redis."""
    server = RedisServer(tmp_path / "no-info", extra_args=["--rename-command", "INFO", ""])
    server.start()
    store = RedisStatsStore(server.url)
    try:
        assert await store.ping() and store.cluster is None and store.status == "up"
        assert await write(store, [await writes_of(store, body(61, ["p"]))]) == [COUNTED]
        assert await history(store, ["p"]) != [None]
    finally:
        await store.close()
        server.stop()


async def test_the_store_follows_a_slot_moved_to_another_master(tmp_path: Path) -> None:
    """A slot migrated while the store's view is old: a key already moved answers ASK on the
    old master (the store asks the importing one), and once the slot is moved every master
    answers MOVED (the store updates its view). Reads and writes go on, nothing lost."""
    cluster = LocalCluster(tmp_path / "moving", masters=3)
    cluster.start()
    store = RedisStatsStore(cluster.url)
    prompts = [f"m{i}" for i in range(12)]
    try:
        assert await write(store, [await writes_of(store, body(71, prompts))]) == [COUNTED]
        before = await history(store, prompts)
        moving = prompts[0]
        slot = layout(store).record_slot(NS, (SPACE, moving))
        source = cluster.master_of(slot)
        target = next(port for port in cluster.masters() if port != source)
        ids = {}
        for port in (source, target):
            with cluster.client(port) as client:
                ids[port] = client.execute_command("CLUSTER MYID").decode()
        key = layout(store).record_key(NS, (SPACE, moving))
        with cluster.client(target) as client:
            client.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", ids[source])
        with cluster.client(source) as client:
            client.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", ids[target])
            client.execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", key)
        assert await history(store, prompts) == before, "ASK"
        for port in cluster.masters():
            with cluster.client(port) as client:
                client.execute_command("CLUSTER SETSLOT", slot, "NODE", ids[target])
        assert await history(store, prompts) == before, "MOVED"
        assert layout(store).client.nodes_manager.get_node_from_slot(slot).port == target
        again = await writes_of(store, body(72, prompts, request_id="after-move"))
        assert await write(store, [again]) == [COUNTED]
        after = await history(store, prompts)
        assert all(a != b for a, b in zip(after, before, strict=True))
        assert store.status == "up"
    finally:
        await store.close()
        cluster.stop()


async def test_a_read_past_its_timeout_leaves_no_reply_behind_for_the_next_call(
    redis_cluster: LocalCluster,
) -> None:
    """Every master paused past the read timeout: a read fails (statistics None, history
    unavailable), and the connections it used carry none of the late replies into the next
    calls: once the masters answer again, reads return what was written and a write counts (a
    connection reused with unread replies hands each call an earlier call's answers)."""
    store = RedisStatsStore(redis_cluster.url, socket_timeout=0.2)
    prompts = [f"p{i}" for i in range(16)]

    def pause() -> float:
        for port in redis_cluster.masters():
            with redis_cluster.client(port) as client:
                client.execute_command("CLIENT", "PAUSE", 1000, "ALL")
        return time.monotonic()

    async def answers_again(paused: float) -> None:
        await asyncio.sleep(max(0.0, paused + 1.2 - time.monotonic()))
        for _ in range(3):  # (each read takes the pooled connections in turn)
            await asyncio.sleep(0.6)  # (the store's backoff after the failed read)
            assert await history(store, prompts) == stored
            assert_token_stats_are_the_sum(await statistics(store), [first.tokens])

    try:
        assert await store.ping()
        first = await writes_of(store, body(61, prompts, request_id="before"))
        assert await write(store, [first]) == [COUNTED]
        stored = await history(store, prompts)
        assert all(r is not None for r in stored)
        paused = pause()
        assert await store.token_stats(NS, "occurrences", EVERYTHING) is None
        assert time.monotonic() - paused < 1.0, "the read outlived the pause: no test"
        await answers_again(paused)
        paused = pause()
        assert await store.read_records(NS, [(SPACE, p) for p in prompts]) is None
        assert time.monotonic() - paused < 1.0, "the read outlived the pause: no test"
        await answers_again(paused)
        second = await writes_of(store, body(62, prompts, request_id="after"))
        assert await write(store, [second]) == [COUNTED]
        assert_token_stats_are_the_sum(await statistics(store), [first.tokens, second.tokens])
    finally:
        await store.close()


def test_a_reply_the_commit_script_does_not_give_fails_its_part() -> None:
    """Only the commit script's own replies count a part written or counted before: another
    command's reply in its place (a list of records, a status) fails the part (its requests
    counted lost, visibly), never counts them."""

    def reply(last: Any) -> Any:
        return _script_reply(Part(0, [], result=[b"OK", last]))

    assert reply([1, 3, 0]) == [1, 3, 0]
    assert reply([0, 0, 0, 2]) == [0, 0, 0, 2]
    for other in ([b"record", b"record"], [1, 0], b"OK", None, 7, [1, b"x", 0]):
        assert reply(other) is None, other


async def test_masters_that_answered_while_the_process_was_not_running_are_up(
    redis_cluster: LocalCluster,
) -> None:
    """A master answers a ping in time while this process is not running (its event loop held
    past the read timeout): the reply is read, the cluster is not taken for unreachable (a
    restarted replica on a loaded machine was, three times in a second)."""
    errors: list[str] = []
    store = RedisStatsStore(
        redis_cluster.url, socket_timeout=0.3, backoff_initial=0.1, on_error=errors.append
    )
    port = next(iter(redis_cluster.masters()))
    process = redis_cluster.nodes[port].process
    assert process is not None
    loop = asyncio.get_running_loop()

    def starved() -> None:
        os.kill(process.pid, signal.SIGCONT)  # the master answers now; this process sleeps
        time.sleep(0.6)

    try:
        assert await store.ping()
        os.kill(process.pid, signal.SIGSTOP)
        loop.call_later(0.1, starved)
        start = time.perf_counter()
        assert await store.ping()
        assert 0.6 < time.perf_counter() - start < 1.5
        assert errors == [] and store.status == "up"
    finally:
        os.kill(process.pid, signal.SIGCONT)
        await store.close()
