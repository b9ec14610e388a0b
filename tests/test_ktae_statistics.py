"""The per-token KTAE statistics diagnostics (``ktae_a`` ... ``ktae_tf``): each token's
contingency table and statistics, as tests/oracle.py computes them from ESTIMATORS.md."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from advantage_service.api import compute
from advantage_service.estimators.ktae import STATISTICS
from advantage_service.estimators.pipeline import all_diagnostics
from oracle import ktae_group_statistics, random_request, resolve_estimator

RETURNS = ["ktae_score", *STATISTICS]


def oracle_rows(request: dict[str, Any]) -> list[dict[str, np.ndarray]]:
    params = resolve_estimator(request["estimator"])["ktae"]
    ignore = {int(t) for t in request.get("ignore_token_ids") or []}
    rows = []
    for group in request["groups"]:
        rollouts = group["rollouts"]
        rows += ktae_group_statistics(
            [list(r["tokens"]) for r in rollouts],
            [float(r["reward"]) for r in rollouts],
            params,
            ignore,
        )
    return rows


@pytest.mark.parametrize(
    "estimator",
    ["ktae", {"outcome": "rloo", "ktae": {"tf": False}}, {"ktae": {"correct_threshold": 0.5}}],
    ids=["ktae", "tf_off", "threshold"],
)
def test_ktae_statistics_are_the_oracles_per_token(estimator: Any) -> None:
    rng = np.random.default_rng(16)
    for _ in range(12):
        request = random_request(rng, estimator=estimator, return_fields=RETURNS, vocab=8)
        if rng.random() < 0.5:
            request["ignore_token_ids"] = [int(rng.integers(0, 8))]
        got = [r for g in compute(request, device="cpu")["groups"] for r in g["rollouts"]]
        want = oracle_rows(request)
        for row, expected in zip(got, want, strict=True):
            for name in RETURNS:
                np.testing.assert_allclose(
                    np.asarray(row[name], dtype=np.float64),
                    expected[name],
                    rtol=2e-6,
                    atol=2e-6,
                    err_msg=name,
                )


def test_ktae_statistics_explain_the_score() -> None:
    """The score is scale tanh(z / 2) with z from the returned statistics (steps 5-7)."""
    rng = np.random.default_rng(3)
    request = random_request(rng, estimator="ktae", return_fields=RETURNS, n_groups=(3, 3))
    for group in compute(request, device="cpu")["groups"]:
        for row in group["rollouts"]:
            f, ig, h, tf = (np.asarray(row[k], np.float64) for k in STATISTICS[5:])
            z = (f + ig) / 2 * (h + tf)
            np.testing.assert_allclose(row["ktae_score"], np.tanh(z / 2), rtol=1e-5, atol=1e-6)


def test_ktae_statistics_are_listed_and_only_with_ktae() -> None:
    assert set(STATISTICS) <= set(all_diagnostics())
    request = random_request(np.random.default_rng(0), estimator="grpo", return_fields=["scalar"])
    request["return"] = ["ktae_p"]
    from advantage_service.errors import RequestError

    with pytest.raises(RequestError, match="ktae_p"):
        compute(request, device="cpu")


RANDOM_ESTIMATORS = [
    "ktae",
    {"outcome": "rloo", "ktae": {"tf": False, "scale": 2.0}},
    {"ktae": {"correct_threshold": 0.5, "fisher_weight": 0.3, "tf_b": 1.0}},
]
RANDOM_IDS = ["ktae", "tf_off_scaled", "threshold_weights"]


def random_ktae_batches(seed: int) -> Any:
    """30 (trial, batch, ignored ids): 1-5 groups of 1-8 rollouts of 0-39 tokens from 6, 60 or
    2^31 - 1 ids, groups in order or shuffled, rewards 0, 0.25 or 1, an ignored id in a quarter."""
    from advantage_service import RolloutBatch

    rng = np.random.default_rng(seed)
    for trial in range(30):
        groups, size = int(rng.integers(1, 6)), int(rng.integers(1, 9))
        lengths = rng.integers(0, 40, groups * size)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        group_index = np.repeat(np.arange(groups), size)
        batch = RolloutBatch.from_flat(
            tokens=rng.integers(0, [6, 60, 2**31 - 1][trial % 3], offsets[-1]).astype(np.int32),
            offsets=offsets,
            group_ids=[f"p{g}" for g in range(groups)],
            group_index=rng.permutation(group_index) if trial % 2 else group_index,
            rewards=rng.choice([0.0, 0.25, 1.0], groups * size).astype(np.float32),
        )
        ignore = [int(rng.integers(0, 6))] if trial % 4 == 1 else None
        yield trial, batch, ignore


@pytest.mark.parametrize("estimator", RANDOM_ESTIMATORS, ids=RANDOM_IDS)
def test_ktae_score_alone_is_the_score_beside_its_statistics_bit_for_bit(estimator: Any) -> None:
    """Without statistics the score is evaluated per table only for tables of several tokens
    (a single token's once per group and side); with them, on every table. Same bits."""
    from advantage_service import compute_batch

    for _, batch, ignore in random_ktae_batches(11):
        alone = compute_batch(batch, estimator, ignore_token_ids=ignore)
        beside = compute_batch(batch, estimator, diagnostics=RETURNS, ignore_token_ids=ignore)
        assert alone.advantages.numpy().tobytes() == beside.advantages.numpy().tobytes()
        assert len(beside.diagnostics["ktae_score"]) == batch.num_tokens


def every_table_statistics(
    batch: Any, params: dict[str, Any], ignore: list[int] | None
) -> dict[str, np.ndarray]:
    """The score and statistics per token with every table evaluated on its own (the grid
    lookup, tf contrast and score over all tables) and gathered to its tokens by its table."""
    import torch
    from advantage_service.estimators.ktae import (
        association_lookup,
        gather_tables,
        key_token_score,
        tabulate,
        tf_contrast,
    )

    correct = batch.rewards > params["correct_threshold"]
    g = batch.group_index
    n_c = torch.zeros(batch.num_groups, dtype=torch.float64).index_add_(0, g, correct.double())
    n_w = batch.group_sizes.double() - n_c
    lengths = batch.lengths.double()
    len_c = torch.zeros_like(n_c).index_add_(0, g, lengths * correct)
    len_w = torch.zeros_like(n_c).index_add_(0, g, lengths) - len_c
    contrast = (n_c > 0) & (n_w > 0)
    drop = None if bool(contrast.all()) else ~contrast[g]
    ignore_ids = None if ignore is None else torch.tensor(ignore)
    tables = tabulate(batch, correct, drop, ignore_ids)
    group = tables.group
    assoc = association_lookup(n_c, n_w, group, tables.a, tables.b, params, parts=True)
    tf = None
    if params["tf"]:
        tf = tf_contrast(
            tables.occ_c, tables.occ_w, group, len_c, len_w, params["tf_k1"], params["tf_b"]
        )
    score = key_token_score(assoc.strength, assoc.h, tf, params["scale"])
    table = tables.table_of_token()
    zero = torch.zeros_like(score)
    per_table = {
        "ktae_score": score,
        "ktae_a": tables.a,
        "ktae_b": tables.b,
        "ktae_p": assoc.p,
        "ktae_fisher": assoc.fisher,
        "ktae_ig": assoc.ig,
        "ktae_h": assoc.h,
        "ktae_tf": zero if tf is None else tf,
    }
    out = {
        name: gather_tables(values.float(), table, 1.0 if name == "ktae_p" else 0.0).numpy()
        for name, values in per_table.items()
    }
    for name, column in (("ktae_n_correct", n_c), ("ktae_n_wrong", n_w)):
        out[name] = column.float()[batch.per_token(g)].numpy()
    return out


@pytest.mark.parametrize("estimator", RANDOM_ESTIMATORS, ids=RANDOM_IDS)
def test_ktae_statistics_are_every_tables_own_bit_for_bit(estimator: Any) -> None:
    """With statistics, a table of one token takes the values computed once for its group and
    side, and only tables of several tokens are evaluated on their own; evaluating every table
    on its own gives every token the same bits, score and statistics alike."""
    from advantage_service import compute_batch

    params = resolve_estimator(estimator)["ktae"]
    for trial, batch, ignore in random_ktae_batches(23):
        got = compute_batch(batch, estimator, diagnostics=RETURNS, ignore_token_ids=ignore)
        want = every_table_statistics(batch, params, ignore)
        for name in RETURNS:
            row = got.diagnostics[name]
            assert row.dtype.itemsize == 4 and row.is_contiguous(), name
            assert row.numpy().tobytes() == want[name].tobytes(), (trial, name)
