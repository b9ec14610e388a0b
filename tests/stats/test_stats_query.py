"""``history_query``: the distinct (group, token id) pairs, the same on every path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from advantage_service.request import parse_request
from advantage_service.stats import history_query
from advantage_service.stats.base import _history_query_numpy, _history_query_torch
from stats_helpers import random_groups


def reference_pairs(body: dict, ignore: set[int]) -> list[list[int]]:
    return [
        sorted({t for r in g["rollouts"] for t in r["tokens"]} - ignore) for g in body["groups"]
    ]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("ignore", [None, [0, 3, 151_935]])
@pytest.mark.parametrize("vocab", [14, 151_936, 2**31 - 1])
def test_query_holds_each_groups_distinct_tokens_on_every_path(
    seed: int, ignore: list[int] | None, vocab: int
) -> None:
    rng = np.random.default_rng(seed)
    groups = random_groups(rng, [f"p{i}" for i in range(5)], vocab=14)
    # vocab 14: a dense bitmap; else ids too sparse for one, the sorting path answers.
    for group in groups:
        for rollout in group["rollouts"]:
            rollout["tokens"] = [min(t, vocab - 1) for t in rollout["tokens"]]
    groups[1]["rollouts"][0]["tokens"] += [vocab - 1, 5, vocab - 1]
    body = {"groups": groups}
    batch = parse_request(body).batch
    want = reference_pairs(body, set(ignore or []))
    for fn in (history_query, _history_query_numpy, _history_query_torch):
        query = fn(batch, ignore) if fn is history_query else fn(batch, ignore, ["x"] * 5)
        assert query.offsets.dtype == np.int64 and query.tokens.dtype == np.int64
        got = [query.tokens_of(g).tolist() for g in range(5)]
        assert got == want, fn.__name__


def test_query_of_a_batch_without_tokens() -> None:
    body = {"groups": [{"id": "e", "rollouts": [{"tokens": [], "reward": 1.0}] * 2}]}
    batch = parse_request(body).batch
    for query in (
        history_query(batch),
        _history_query_torch(batch, None, ["e"]),
    ):
        assert query.offsets.tolist() == [0, 0] and query.tokens.size == 0
    assert torch.is_tensor(batch.tokens)
