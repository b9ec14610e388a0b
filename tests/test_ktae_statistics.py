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


@pytest.mark.parametrize(
    "estimator",
    [
        "ktae",
        {"outcome": "rloo", "ktae": {"tf": False, "scale": 2.0}},
        {"ktae": {"correct_threshold": 0.5, "fisher_weight": 0.3, "tf_b": 1.0}},
    ],
    ids=["ktae", "tf_off_scaled", "threshold_weights"],
)
def test_ktae_score_alone_is_the_score_beside_its_statistics_bit_for_bit(estimator: Any) -> None:
    """Without statistics the score is evaluated per table only for tables of several tokens
    (a single token's once per group and side); with them, on every table. Same bits."""
    from advantage_service import RolloutBatch, compute_batch

    rng = np.random.default_rng(11)
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
        alone = compute_batch(batch, estimator, ignore_token_ids=ignore)
        beside = compute_batch(batch, estimator, diagnostics=RETURNS, ignore_token_ids=ignore)
        assert alone.advantages.numpy().tobytes() == beside.advantages.numpy().tobytes()
        assert len(beside.diagnostics["ktae_score"]) == batch.num_tokens
