"""What only the in-memory store needs checked: its entries expire as Redis keys do, and its
bounds (records' bytes, request ids) are shared fairly between namespaces."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from advantage_service.estimators.ktae_history import SPACE, prompt_ids
from advantage_service.stats import MemoryStatsStore, StatsUpdate
from advantage_service.stats.blobs import TokenStatsUpdate, merge_token_stats
from advantage_service.stats.blobs import empty_token_stats as empty
from advantage_service.stats.memory import RECORD_OVERHEAD
from advantage_service.wire.request import parse_request
from stats_helpers import random_groups, read_history, serve

pytestmark = pytest.mark.anyio


async def test_memory_entries_expire_after_the_ttl() -> None:
    clock = [1000.0]
    store = MemoryStatsStore(ttl_seconds=60, now=lambda: clock[0])
    rng = np.random.default_rng(0)
    body = {
        "namespace": "ns",
        "request_id": "once",
        "estimator": {"outcome": "grpo", "ktae": {"history": "prompt"}},
        "groups": random_groups(rng, ["p"]),
    }
    assert (await serve(store, body)).counted
    query = prompt_ids(parse_request(body).batch)
    clock[0] += 59
    assert not (await serve(store, body)).counted
    prior = await read_history(store, "ns", query)
    assert prior is not None and float(prior.n_c[0] + prior.n_w[0]) > 0
    clock[0] += 61  # past the TTL of every entry (the duplicate wrote nothing)
    prior = await read_history(store, "ns", query)
    assert prior is not None and float(prior.n_c[0] + prior.n_w[0]) == 0.0
    assert await store.token_stats("ns", "key", 10) == {
        "namespace": "ns",
        "rollouts_counted": 0,
        "tokens": [],
    }
    assert (await serve(store, body)).counted, "the request id expired with the rest"


async def test_memory_store_stays_bounded_and_forgets_the_oldest_prompts_first() -> None:
    store = MemoryStatsStore(max_record_bytes=4_000, max_request_ids=50, max_namespaces=3)
    rng = np.random.default_rng(1)
    for visit in range(40):
        body = {
            "namespace": f"ns-{visit % 5}",
            "request_id": f"r-{visit}",
            "estimator": {"outcome": "grpo", "ktae": {"history": "prompt"}},
            "groups": random_groups(rng, [f"p-{visit}"]),
        }
        assert (await serve(store, body)).counted
        assert store.record_bytes <= 4_000
    assert store.request_ids_kept <= 50
    assert store.namespaces_kept <= 3
    newest = prompt_ids(parse_request({**body, "groups": random_groups(rng, ["p-39"])}).batch)
    prior = await read_history(store, "ns-4", newest)
    assert prior is not None and float(prior.n_c[0] + prior.n_w[0]) > 0, "newest kept"
    oldest = prompt_ids(parse_request({**body, "groups": random_groups(rng, ["p-0"])}).batch)
    prior = await read_history(store, "ns-0", oldest)
    assert prior is not None and float(prior.n_c[0] + prior.n_w[0]) == 0.0, "oldest evicted"


# ---- fair eviction between namespaces ------------------------------------------------------

RECORD = 2_000  # bytes of each record below (the store adds RECORD_OVERHEAD to each)


async def write_records(store: MemoryStatsStore, namespace: str, names: list[str]) -> None:
    for name in names:
        update = StatsUpdate({(SPACE, name): name.encode().ljust(RECORD, b".")}, empty())
        assert await store.record_many(namespace, [], update) == []


async def kept(store: MemoryStatsStore, namespace: str, names: list[str]) -> list[str]:
    records = await store.read_records(namespace, [(SPACE, n) for n in names])
    assert records is not None
    return [n for n, r in zip(names, records, strict=True) if r is not None]


async def test_a_tenant_flooding_the_store_evicts_its_own_history_not_another_tenants() -> None:
    """Tenant B writes a few prompts first (the oldest records of the store); tenant A then
    writes 200 prompts, seven times what the store holds. A gives up its own oldest prompts;
    B, holding far less than A, keeps every one. (Before, the store evicted the oldest records
    whoever held them: B's history went first.)"""
    bound = 30 * (RECORD + RECORD_OVERHEAD)
    store = MemoryStatsStore(max_record_bytes=bound)
    tenant_b = [f"b{i}" for i in range(3)]
    await write_records(store, "tenant-b", tenant_b)
    flood = [f"a{i}" for i in range(200)]
    await write_records(store, "tenant-a", flood)
    assert store.record_bytes <= bound
    assert await kept(store, "tenant-b", tenant_b) == tenant_b
    assert store.namespace_record_bytes("tenant-b") == 3 * (RECORD + RECORD_OVERHEAD)
    # A keeps its newest prompts, as many as fit beside B's.
    assert await kept(store, "tenant-a", flood) == flood[-27:]


async def test_two_tenants_flooding_the_store_keep_equal_shares() -> None:
    """A writes three times as often as C; once the store is full, each keeps half of it
    (before: A three quarters, C a quarter)."""
    bound = 40 * (RECORD + RECORD_OVERHEAD)
    store = MemoryStatsStore(max_record_bytes=bound)
    for i in range(150):
        await write_records(store, "tenant-a", [f"a{i}"])
        if i % 3 == 0:
            await write_records(store, "tenant-c", [f"c{i}"])
    a = await kept(store, "tenant-a", [f"a{i}" for i in range(150)])
    c = await kept(store, "tenant-c", [f"c{i}" for i in range(0, 150, 3)])
    assert store.record_bytes <= bound
    assert (len(a), len(c)) == (20, 20)


async def test_a_tenant_flooding_request_ids_evicts_its_own_claims_not_another_tenants() -> None:
    """The same for the request ids kept for idempotency (``max_request_ids``): B's claim
    survives A's flood, so B's resend is still refused as a duplicate."""
    store = MemoryStatsStore(max_request_ids=100)
    update = StatsUpdate({}, empty())
    assert await store.record_many("tenant-b", ["b-1"], update) == []
    for i in range(500):
        assert await store.record_many("tenant-a", [f"a-{i}"], update) == []
    assert store.request_ids_kept <= 100
    assert await store.record_many("tenant-b", ["b-1"], update) == ["b-1"], "B counted twice"
    assert await store.record_many("tenant-a", ["a-499"], update) == ["a-499"]
    assert await store.record_many("tenant-a", ["a-0"], update) == [], "A's oldest evicted"


def token_update(ids: np.ndarray, rollouts: int) -> StatsUpdate:
    """An update counting each of ``ids`` once in ``rollouts`` correct rollouts."""
    ones = np.ones(ids.size, np.int64)
    table = TokenStatsUpdate(
        rollouts, ids.astype(np.int64), ones, 0 * ones, ones, ones * 0.5, ones, ones * 0.25, ones
    )
    return StatsUpdate(records={}, tokens=table)


async def test_the_vocabulary_table_is_merged_off_the_event_loop_and_no_commit_is_lost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Merging a vocabulary's worth of ids takes tens of milliseconds: on the event loop it
    held back every other client's request at each write. It runs on a worker thread; two
    commits to one namespace that overlap both count (the second, whose table changed while
    it merged, merges again)."""
    import threading

    from advantage_service.stats import memory

    threads: list[int] = []

    def merge(parts: list[TokenStatsUpdate]) -> TokenStatsUpdate:
        threads.append(threading.get_ident())
        return merge_token_stats(parts)

    monkeypatch.setattr(memory, "merge_token_stats", merge)
    store = MemoryStatsStore()
    ids = np.arange(0, 150_000, 3)
    await store.commit("ns", [], token_update(ids, 4))  # (into an empty table: nothing to add)
    await asyncio.gather(
        store.commit("ns", [], token_update(ids, 1)),
        store.commit("ns", [], token_update(ids[::2], 2)),
    )
    loop = threading.get_ident()
    assert threads[0] == loop and threads[1:] and loop not in threads[1:]
    stats = await store.token_stats("ns", "occurrences", 3)
    assert stats is not None and stats["rollouts_counted"] == 4 + 1 + 2
    counts = {row["token_id"]: row["occurrences"] for row in stats["tokens"]}
    assert counts == {0: 3, 6: 3, 12: 3}  # every even-indexed id: in all three updates
