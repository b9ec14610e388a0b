"""A claim keeps the digest of the request that made it, on every backend (in memory, one Redis,
a Redis Cluster): a later write of the same id with the same digest is a retry (``duplicate``),
with another digest another request under a reused id (``conflict``), and neither is counted.
A claim without a digest (an earlier release's, or a write that gave none) is taken for a retry.
This is what catches two bodies sent at once under one id, which the check before the answer
cannot see (neither was written yet)."""

from __future__ import annotations

import pytest
from advantage_service.estimators.ktae_history import SPACE
from advantage_service.stats import StatsStore, StatsUpdate
from advantage_service.stats.base import CONFLICT, COUNTED, DUPLICATE, RecordKey, RequestWrite
from advantage_service.stats.blobs import merge_token_stats
from stats_helpers import record_folded, small_tokens

pytestmark = pytest.mark.anyio

NS = "claims"
FIRST, SECOND = "1" * 32, "2" * 32


async def write(
    store: StatsStore, request_id: str, digest: str | None, seed: int, prompts: list[str]
) -> str:
    """One request's write (records under ``prompts``, 2 rollouts): its outcome."""
    records = {(SPACE, p): f"{p}:{seed}".encode() for p in prompts}
    request = RequestWrite(request_id, tuple(records), small_tokens(seed), digest)

    # (a write of one request is never written again without it: nothing to fold)
    (outcome,) = await record_folded(store, NS, [request], StatsUpdate(records, request.tokens))
    return outcome


async def rollouts(store: StatsStore) -> int:
    stats = await store.token_stats(NS, "occurrences", 1)
    assert stats is not None
    return int(stats["rollouts_counted"])


async def test_a_claim_tells_a_retry_from_another_request_under_the_same_id(
    store: StatsStore, backend: str
) -> None:
    assert await write(store, "step", FIRST, 1, ["a", "b"]) == COUNTED
    read = await store.read_partly(NS, [(SPACE, "a")], "step")
    assert read is not None and read.claimed_digest == FIRST
    assert await write(store, "step", FIRST, 1, ["a", "b"]) == DUPLICATE
    assert await write(store, "step", SECOND, 2, ["c", "d"]) == CONFLICT
    assert await write(store, "step", None, 3, ["a"]) == DUPLICATE  # (no digest: a retry)
    assert await rollouts(store) == 2
    assert await store.read_records(NS, [(SPACE, "a")]) == [b"a:1"]
    if backend != "redis-cluster":
        # The conflicting request's records were not written either. (A cluster claims a
        # request id per slot: the parts of its records in slots the first request did not
        # write apply; its statistics are not counted.)
        assert await store.read_records(NS, [(SPACE, "c"), (SPACE, "d")]) == [None, None]


async def test_a_claim_without_a_digest_takes_any_request_for_a_retry(store: StatsStore) -> None:
    """A claim made without a digest (as an earlier release made every claim) proves nothing:
    a request of any digest is a duplicate, and the check before the answer finds nothing."""
    assert await store.record_many(NS, ["old"], StatsUpdate({}, small_tokens(1))) == []
    read = await store.read_partly(NS, [], "old")
    assert read is not None and read.claimed_digest is None
    assert await write(store, "old", SECOND, 2, ["a"]) == DUPLICATE
    assert await rollouts(store) == 2


async def test_a_round_counts_a_request_without_an_id_beside_a_resent_one(
    store: StatsStore,
) -> None:
    """The claims a write finds are told by request id: a request without one, ahead of a
    resent request in the same round, is counted, and only the resent one is a duplicate."""
    assert await write(store, "seen", FIRST, 1, ["a"]) == COUNTED
    records = {(SPACE, "b"): b"b:2", (SPACE, "a"): b"a:1"}
    fresh = RequestWrite(None, ((SPACE, "b"),), small_tokens(2))
    resent = RequestWrite("seen", ((SPACE, "a"),), small_tokens(1), FIRST)
    update = StatsUpdate(records, merge_token_stats([fresh.tokens, resent.tokens]))

    def fold(keys: frozenset[RecordKey], keep: tuple[int, ...]) -> dict[RecordKey, bytes]:
        assert keep == (0,), "folded again without the resent request"
        return {key: records[key] for key in keys}

    assert await record_folded(store, NS, [fresh, resent], update, fold) == [COUNTED, DUPLICATE]
    assert await rollouts(store) == 4
    assert await store.read_records(NS, [(SPACE, "a"), (SPACE, "b")]) == [b"a:1", b"b:2"]
