"""One bad request never costs the other requests of its write round their statistics.

The service's writer (``serving/stats_writer.py``) folds every waiting request's writes into one
store call per namespace. A request whose write the store cannot take must fail alone: it is
counted ``lost`` and ``poisoned``, and every other request of the round is counted exactly once,
its history visits folded in order (the records byte for byte what writing the good requests
alone leaves), its statistics summed, its request id claimed (a resend is a duplicate).

The bad requests, each folded between good ones into one round:

- a request id that is not valid Unicode text (a lone surrogate: the decoders refuse it, so the
  test builds the request past them, as a decoder bug would let one through). Before, the Redis
  key encoding failed for the whole round: every request of it was lost, answered
  ``recorded: true``;
- a record the store refuses: on Redis and on a Redis Cluster, one the store's ``staged`` seam
  leaves unstaged, which the commit script then finds missing (as a staged record Redis refused
  or evicted) and refuses, applying nothing of the write (before, the script skipped it and
  counted the request without its record); in memory, a record larger than the store holds
  (before, it evicted every other record to fit, then itself).

Real stores: the in-memory store, a real redis-server, a real 3-master Redis Cluster.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest
import torch
from advantage_service.estimators.ktae_history import SPACE
from advantage_service.estimators.state import WriteOptions
from advantage_service.serving.compute import compute_request
from advantage_service.serving.stats_writer import StatsWriter
from advantage_service.serving.term_state import StateSession, fold_records, fold_writes
from advantage_service.stats import MemoryStatsStore, RedisStatsStore, StatsStore
from advantage_service.stats.base import COUNTED, POISONED, RecordKey, RequestWrite
from advantage_service.wire.request import ComputeRequest, parse_request
from redis_cluster_support import LocalCluster
from redis_support import RedisServer
from stats_helpers import assert_token_stats_are_the_sum, random_groups, record_folded

pytestmark = pytest.mark.anyio

NS = "poisoned"
BAD_ID = "bad-\ud800-id"
POISON_PROMPT = "poison"
# Six good requests over four prompts (each prompt visited by requests in both halves of the
# round, so that a split write must fold a later half on top of an earlier one).
GOOD = [["p0", "p1"], ["p1", "p2"], ["p2", "p3"], ["p0", "p3"], ["p1", "p3"], ["p0", "p2"]]
# The in-memory store's bound in the test: the good records fit in it many times over, the
# poisoned prompt's record (thousands of distinct tokens) does not.
MEMORY_BOUND = 40_000


def body(seed: int, prompts: list[str], request_id: str) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "namespace": NS,
        "request_id": request_id,
        "estimator": {"outcome": "grpo", "ktae": {"history": "prompt", "history_decay": 0.5}},
        "groups": random_groups(rng, prompts, vocab=30),
    }


def poison_body(seed: int) -> dict[str, Any]:
    """A request whose one prompt has a record of thousands of distinct token ids (~100 KB)."""
    rng = np.random.default_rng(seed)
    rollouts = [
        {"tokens": (1000 + 5000 * r + np.arange(4000)).tolist(), "reward": float(r % 2)}
        for r in range(2)
    ]
    rollouts[0]["tokens"] = rollouts[0]["tokens"][: int(rng.integers(3000, 4000))]
    return {
        "namespace": NS,
        "request_id": "poison-record",
        "estimator": {"outcome": "grpo", "ktae": {"history": "prompt", "history_decay": 0.5}},
        "groups": [{"id": POISON_PROMPT, "rollouts": rollouts}],
    }


def refuse_poison(namespace: str, key: RecordKey) -> bool:
    """The Redis stores' ``staged`` seam: the poisoned prompt's record is never staged."""
    return key[1] != POISON_PROMPT


@pytest.fixture(params=["memory", "redis", "redis-cluster"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[StatsStore]:
    made: StatsStore
    if request.param == "memory":
        made = MemoryStatsStore(max_record_bytes=MEMORY_BOUND)
    else:
        request.applymarker(pytest.mark.integration)
        server: RedisServer | LocalCluster = request.getfixturevalue(
            "redis_server" if request.param == "redis" else "redis_cluster"
        )
        made = RedisStatsStore(server.url, staged=refuse_poison, socket_timeout=10.0)
        assert await made.ping()
    yield made
    await made.close()


@dataclass
class Tally:
    outcomes: dict[str, int]
    poisoned: int = 0
    rounds: list[int] | None = None


def writer_for(tally: Tally) -> StatsWriter:
    """The service's writer, its outcomes counted in ``tally`` (as the engine wires them to
    advantage_stats_requests_total and advantage_stats_poisoned_total)."""

    def outcome(name: str, count: int) -> None:
        tally.outcomes[name] = tally.outcomes.get(name, 0) + count

    def poisoned(count: int) -> None:
        tally.poisoned += count

    tally.rounds = []
    writer = StatsWriter(WriteOptions(), 64, on_outcome=outcome, on_round=tally.rounds.append)
    writer.on_poisoned = poisoned
    return writer


async def session_of(store: StatsStore, req: ComputeRequest) -> tuple[StateSession, Any]:
    session = StateSession(store, req, torch.device("cpu"), WriteOptions())
    result = await asyncio.to_thread(compute_request, req, "cpu", session.context)
    assert await session.settle() in ("empty", "applied")
    return session, result


async def one_round(writer: StatsWriter, entries: list[tuple[StateSession, Any]]) -> None:
    """Hand every entry to the writer before it runs: they are written in one round."""
    for session, result in entries:
        assert writer.accept(session, result)
    assert await writer.settle(60) == 0


def requests(kinds: list[str]) -> tuple[list[ComputeRequest], list[ComputeRequest]]:
    """The good requests, and the round: the good ones with the bad ones of ``kinds`` between
    them."""
    good = [parse_request(body(i, prompts, f"good-{i}")) for i, prompts in enumerate(GOOD)]
    bad: list[ComputeRequest] = []
    if "request_id" in kinds:
        bad.append(replace(parse_request(body(90, ["p0", "p2"], "x")), request_id=BAD_ID))
    if "record" in kinds:
        bad.append(parse_request(poison_body(91)))
    round_ = good[:2] + bad[:1] + good[2:4] + bad[1:] + good[4:]
    return good, round_


async def assert_only_the_good_are_counted(
    store: StatsStore, good: list[ComputeRequest], expected_writes: list[Any]
) -> None:
    """What the store holds is what the good requests alone leave: their history records byte
    for byte, their statistics summed."""
    wanted = fold_writes(expected_writes, WriteOptions())
    keys = sorted(wanted.records)
    stored = await store.read_records(NS, keys)
    assert stored == [wanted.records[k] for k in keys], "history visits lost or folded wrong"
    poison = await store.read_records(NS, [(SPACE, POISON_PROMPT)])
    assert poison == [None], "the refused request's record was written"
    stats = await store.token_stats(NS, "occurrences", 10**6)
    assert_token_stats_are_the_sum(stats, [w.tokens for w in expected_writes])
    assert stats is not None
    assert stats["rollouts_counted"] == sum(r.batch.num_rollouts for r in good)


@pytest.mark.parametrize(
    "kinds", [["request_id"], ["request_id", "record"]], ids=["bad-id", "bad-id-and-record"]
)
@pytest.mark.integration
async def test_a_write_the_store_cannot_take_fails_alone_and_every_other_request_counts_once(
    store: StatsStore, kinds: list[str]
) -> None:
    tally = Tally({})
    writer = writer_for(tally)
    try:
        good, round_ = requests(kinds)
        entries = [await session_of(store, req) for req in round_]  # all read before any write
        expected = [
            s.writes(r)
            for (s, r), req in zip(entries, round_, strict=True)
            if any(req is g for g in good)
        ]
        await one_round(writer, entries)

        assert tally.rounds == [len(round_)], "not one round"
        assert tally.outcomes == {"counted": len(good), "lost": len(kinds)}, tally.outcomes
        assert tally.poisoned == len(kinds)
        await assert_only_the_good_are_counted(store, good, expected)

        # Every good request's id was claimed: resent, each is a duplicate, nothing changes.
        again = [await session_of(store, req) for req in good]
        await one_round(writer, again)
        assert tally.outcomes["duplicate"] == len(good), tally.outcomes
        await assert_only_the_good_are_counted(store, good, expected)
    finally:
        writer.close()


@pytest.mark.integration
async def test_a_bad_request_id_alone_in_its_round_costs_nothing_else(
    store: StatsStore,
) -> None:
    """The next round after a poisoned one is written as usual (no backoff, store up)."""
    tally = Tally({})
    writer = writer_for(tally)
    try:
        bad = replace(parse_request(body(90, ["p0"], "x")), request_id=BAD_ID)
        await one_round(writer, [await session_of(store, bad)])
        assert tally.outcomes == {"lost": 1} and tally.poisoned == 1
        assert store.writable and store.status in ("memory", "up")
        good = parse_request(body(1, ["p0"], "after"))
        await one_round(writer, [await session_of(store, good)])
        assert tally.outcomes == {"lost": 1, "counted": 1}
    finally:
        writer.close()


@pytest.mark.integration
async def test_a_store_handed_a_request_it_cannot_encode_splits_the_write_around_it(
    store: StatsStore,
) -> None:
    """The store's own defence, without the writer's check before the fold: a write holding a
    request id it cannot encode is refused whole (nothing applied) and written again in halves
    until that request is alone; the others are counted once, their visits in order."""
    good = [parse_request(body(i, prompts, f"good-{i}")) for i, prompts in enumerate(GOOD)]
    writes = []
    for req in [*good, parse_request(body(90, ["p0", "p2"], "x"))]:
        session, result = await session_of(store, req)
        writes.append(session.writes(result))
    *expected, bad = writes
    round_ = [*expected[:3], replace(bad, request_id=BAD_ID), *expected[3:]]
    requests = [RequestWrite(w.request_id, tuple(w.records), w.tokens, w.digest) for w in round_]

    def fold(keys: frozenset[RecordKey], keep: tuple[int, ...]) -> dict[RecordKey, bytes]:
        return fold_records([round_[i] for i in keep], WriteOptions(), keys)

    update = fold_writes(round_, WriteOptions())
    outcomes = await record_folded(store, NS, requests, update, fold)
    assert outcomes == [COUNTED] * 3 + [POISONED] + [COUNTED] * 3
    await assert_only_the_good_are_counted(store, good, expected)
