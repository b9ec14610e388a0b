"""A request's statistics update built from what its computation already has: the vocabulary
counts from KTAE's tables (its one sort of the tokens) equal the ones counted from the batch,
for dense and sparse token ids, and are used only when the tables hold every token and split
the rollouts as the statistics do."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from advantage_service import RolloutBatch, compute_batch
from advantage_service.estimators import TermContext, resolve_estimator
from advantage_service.estimators.ktae import STATE
from advantage_service.estimators.ktae_history import HistoryPrior
from advantage_service.estimators.state import PendingRead, WriteOptions
from advantage_service.serving.term_state import token_statistics
from advantage_service.stats.blobs import TOKEN_COLUMNS


def batch_of(rng: np.random.Generator, id_space: int) -> RolloutBatch:
    groups, size = 5, 6
    lengths = rng.integers(0, 40, size=groups * size)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return RolloutBatch.from_flat(
        tokens=rng.integers(0, 30, size=int(offsets[-1])) * (id_space // 30),
        offsets=offsets,
        group_ids=[f"g{g}" for g in range(groups)],
        group_index=np.repeat(np.arange(groups), size),
        rewards=rng.choice([0.0, 1.0, 0.5, -1.0], size=groups * size).astype(np.float32),
    )


def writes_of(batch: RolloutBatch, ktae: dict[str, Any], ignore: list[int] | None = None) -> Any:
    spec = resolve_estimator({"outcome": "grpo", "ktae": ktae})
    params = spec.terms["ktae"]
    prior = HistoryPrior.from_stored([None] * batch.num_groups)
    ctx = TermContext(reads={"ktae": PendingRead.of(prior)})
    result = compute_batch(batch, spec, context=ctx, ignore_token_ids=ignore)
    return STATE.writes(batch, params, result.state["ktae"], prior, WriteOptions())


@pytest.mark.parametrize("id_space", [300, 2**31 - 30])
def test_ktae_tables_give_the_counts_the_batch_gives(id_space: int) -> None:
    rng = np.random.default_rng(id_space % 97)
    batch = batch_of(rng, id_space)
    writes = writes_of(batch, {"history": "prompt"})
    assert writes.counts is not None
    columns = {name: [pair] for name, pair in writes.columns.items()}
    given = token_statistics(batch, columns, writes.counts)
    counted = token_statistics(batch, columns)
    assert given.rollouts == counted.rollouts
    np.testing.assert_array_equal(given.tokens, counted.tokens)
    for name in TOKEN_COLUMNS:
        np.testing.assert_array_equal(getattr(given, name), getattr(counted, name), err_msg=name)
    assert given.tokens.size > 10 and given.correct.sum() > 0 and given.wrong.sum() > 0


@pytest.mark.parametrize(
    ("ktae", "ignore"),
    [({"correct_threshold": 0.5, "history": "prompt"}, None), ({"history": "prompt"}, [0])],
    ids=["another_threshold", "ignored_ids"],
)
def test_tables_that_miss_tokens_or_split_otherwise_leave_the_counting_to_the_engine(
    ktae: dict[str, Any], ignore: list[int] | None
) -> None:
    batch = batch_of(np.random.default_rng(5), 300)
    assert writes_of(batch, ktae, ignore).counts is None
    # (and without history, groups without contrast are left out of the tables)
    plain = writes_of(batch, {})
    assert plain.counts is None or bool(torch.all(batch.zero_signal == 0))
