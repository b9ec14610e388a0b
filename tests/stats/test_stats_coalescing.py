"""Coalesced writes, on both backends: the writer folds the writes of many requests into one
store call per namespace (``term_state.fold_writes``, ``StatsStore.record_many``). It must leave
exactly what writing the requests one by one leaves, and count each request id once."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from advantage_service.estimators.ktae_history import SPACE
from advantage_service.serving.term_state import PendingWrites, fold_writes
from advantage_service.stats import StatsStore
from stats_helpers import (
    assert_token_stats_are_the_sum,
    random_groups,
    update_of,
    write_options,
    writes_of,
)

pytestmark = pytest.mark.anyio

PROMPTS = ["a", "b", "c", "d"]
# Visits in order: prompts visited several times, some left out, decays that are powers of two
# and one that is not (its float32 rounding must come out the same).
VISITS = [(["a", "b"], 0.5), (["b", "c"], 0.5), (["a", "b"], 0.3), (["c"], 0.25), (["a"], 0.5)]
VISITS += [(["b", "c", "d"], 0.5), (["a", "d"], 0.3)]


def bodies(namespace: str) -> list[dict[str, Any]]:
    rng = np.random.default_rng(21)
    return [
        {
            "namespace": namespace,
            "estimator": {"outcome": "grpo", "ktae": {"history": "prompt", "history_decay": d}},
            "groups": random_groups(rng, prompts),
        }
        for prompts, d in VISITS
    ]


async def one_by_one(store: StatsStore, namespace: str) -> list[PendingWrites]:
    """The visits written one after the other (each reads what the one before wrote)."""
    done = []
    for body in bodies(namespace):
        writes = await writes_of(store, body)
        assert (
            await store.record_many(namespace, [], fold_writes([writes], write_options(store)))
            == []
        )
        done.append(writes)
    return done


async def records(store: StatsStore, namespace: str) -> list[bytes | None]:
    got = await store.read_records(namespace, [(SPACE, p) for p in PROMPTS])
    assert got is not None and all(r is not None for r in got)
    return got


async def tokens(store: StatsStore, namespace: str) -> dict[str, Any]:
    stats = await store.token_stats(namespace, "occurrences", 10**6)
    assert stats is not None
    return stats


def assert_same_statistics(
    first: dict[str, Any], second: dict[str, Any], *, scores: bool = True
) -> None:
    """Equal counts; equal key scores up to the order of a float sum (when ``scores``)."""
    assert first["rollouts_counted"] == second["rollouts_counted"]
    rows = {r["token_id"]: r for r in second["tokens"]}
    assert sorted(rows) == sorted(r["token_id"] for r in first["tokens"])
    for row in first["tokens"]:
        other = rows[row["token_id"]]
        for name in ("correct_rollouts", "wrong_rollouts", "occurrences"):
            assert row[name] == other[name], (row, other)
        if scores and row["key_score"] is not None:
            assert other["key_score"] == pytest.approx(row["key_score"], rel=1e-12, abs=1e-15)


async def test_one_round_of_the_same_writes_leaves_what_one_by_one_writes_leave(
    store: StatsStore,
) -> None:
    written = await one_by_one(store, "one")
    assert await store.record_many("round", [], fold_writes(written, write_options(store))) == []
    assert await records(store, "round") == await records(store, "one")
    assert_same_statistics(await tokens(store, "one"), await tokens(store, "round"))


async def test_visits_of_one_prompt_in_one_round_fold_in_their_order(store: StatsStore) -> None:
    """Requests answered together read the same (empty) history, and are written in one round:
    every prompt's record is the one their one-by-one visits leave, no visit lost."""
    await one_by_one(store, "one")
    together = [await writes_of(store, body) for body in bodies("together")]  # none written yet
    assert (
        await store.record_many("together", [], fold_writes(together, write_options(store))) == []
    )
    assert await records(store, "together") == await records(store, "one")
    # (the scores differ: each request was computed with the history it read)
    assert_same_statistics(
        await tokens(store, "one"), await tokens(store, "together"), scores=False
    )


async def test_the_order_of_the_visits_matters_and_is_kept(store: StatsStore) -> None:
    """Decay makes the fold order-dependent: reversed, the records differ."""
    await one_by_one(store, "one")
    together = [await writes_of(store, body) for body in bodies("reversed")]
    update = fold_writes(list(reversed(together)), write_options(store))
    assert await store.record_many("reversed", [], update) == []
    assert await records(store, "reversed") != await records(store, "one")


async def test_record_many_claims_every_request_id_or_none(store: StatsStore, backend: str) -> None:
    if backend == "redis-cluster":
        pytest.skip("a cluster claims per slot: test_stats_cluster.py tests its record_requests")
    ns = bodies("ids")[0]["namespace"]
    first, second, third = [await update_of(store, body) for body in bodies("ids")[:3]]
    assert await store.record_many(ns, ["x"], first) == []
    before = (await records_of(store, ns), await tokens(store, ns))
    # "x" was counted: nothing of this write is applied, and "y" and "z" stay unclaimed.
    assert await store.record_many(ns, ["y", "x", "z"], second) == ["x"]
    assert (await records_of(store, ns), await tokens(store, ns)) == before
    assert await store.record_many(ns, ["y", "z"], second) == []
    # An id twice in one write is claimed once.
    assert await store.record_many(ns, ["w", "w"], third) == []
    assert await store.record_many(ns, ["w"], third) == ["w"]
    assert_token_stats_are_the_sum(
        await tokens(store, ns), [first.tokens, second.tokens, third.tokens]
    )


async def records_of(store: StatsStore, namespace: str) -> list[bytes | None] | None:
    return await store.read_records(namespace, [(SPACE, p) for p in PROMPTS])
