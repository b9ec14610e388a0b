"""What only the in-memory store needs checked: its entries expire as Redis keys do."""

from __future__ import annotations

import numpy as np
import pytest
from advantage_service.estimators.ktae_history import prompt_ids
from advantage_service.stats import MemoryStatsStore
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
