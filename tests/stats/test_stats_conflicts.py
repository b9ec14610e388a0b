"""A claim keeps the digest of the request that made it, on every backend (in memory, one Redis,
a Redis Cluster): a later write of the same id with the same digest is a retry (``duplicate``),
with another digest another request under a reused id (``conflict``), and neither is counted.
A claim without a digest (an earlier release's, or a write that gave none) is taken for a retry.
This is what catches two bodies sent at once under one id, which the check before the answer
cannot see (neither was written yet)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import numpy as np
import pytest
from advantage_service.estimators.ktae_history import SPACE
from advantage_service.stats import StatsStore, StatsUpdate
from advantage_service.stats.base import CONFLICT, COUNTED, DUPLICATE, RecordKey, RequestWrite
from advantage_service.stats.blobs import TokenStatsUpdate

pytestmark = pytest.mark.anyio

NS = "claims"
FIRST, SECOND = "1" * 32, "2" * 32


def tokens(seed: int) -> TokenStatsUpdate:
    rng = np.random.default_rng(seed)
    ids = np.unique(rng.integers(0, 50, size=10)).astype(np.int64)
    ones, zeros = np.ones(ids.size, np.int64), np.zeros(ids.size)
    return TokenStatsUpdate(2, ids, ones, ones, 2 * ones, zeros, 0 * ones, zeros, 0 * ones)


async def write(
    store: StatsStore, request_id: str, digest: str | None, seed: int, prompts: list[str]
) -> str:
    """One request's write (records under ``prompts``, 2 rollouts): its outcome."""
    records = {(SPACE, p): f"{p}:{seed}".encode() for p in prompts}
    request = RequestWrite(request_id, tuple(records), tokens(seed), digest)

    async def refold(keys: Collection[RecordKey], keep: Sequence[int]) -> Any:
        return {k: records[k] for k in keys} if keep else {}

    update = StatsUpdate(records, request.tokens)
    (outcome,) = await store.record_requests(NS, [request], update, refold)
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
    assert await store.record_many(NS, ["old"], StatsUpdate({}, tokens(1))) == []
    read = await store.read_partly(NS, [], "old")
    assert read is not None and read.claimed_digest is None
    assert await write(store, "old", SECOND, 2, ["a"]) == DUPLICATE
    assert await rollouts(store) == 2
