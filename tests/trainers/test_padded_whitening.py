"""The padded API's outcome-only path (no token ids gathered: each row's advantage is one value)
whitens over the request's tokens and clips as the flat pipeline does: its answer is
:func:`compute_batch`'s on the same rollouts, for every outcome of rewards and groups alone."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from advantage_service import compute_padded
from advantage_service.batch import RolloutBatch
from advantage_service.estimators import compute_batch

# Outcomes that read rewards and groups alone (the padded API's outcome-only path); OPO also
# reads the lengths, GPG the batch's size.
OUTCOMES = ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "opo", "gpg", "maxrl"]
# Whitening alone, then with a bound that clips some whitened values (|z| reaches ~2 here),
# then clipping alone.
SHAPING: list[dict[str, Any]] = [
    {"whiten": True},
    {"whiten": True, "clip": 0.8},
    {"clip": 0.3},
]


def padded_rows(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mask (B, T) with holes and empty rows, rewards (B,) >= 0, group ids (B,) shuffled)."""
    rng = np.random.default_rng(seed)
    b, t = 24, 30
    mask = rng.random((b, t)) < rng.uniform(0.1, 0.9, size=(b, 1))
    mask[3] = False  # an empty row
    rewards = rng.integers(0, 3, size=b) * rng.random(b)
    group_ids = rng.permutation(np.repeat(np.arange(b // 4), 4))
    return mask, rewards, group_ids


def flat_batch(mask: np.ndarray, rewards: np.ndarray, group_ids: np.ndarray) -> RolloutBatch:
    """The same rollouts as a flat batch (row order kept; a row's tokens are its mask's)."""
    offsets = np.concatenate([[0], np.cumsum(mask.sum(1))])
    return RolloutBatch.from_flat(
        tokens=torch.ones(int(offsets[-1]), dtype=torch.int64),
        offsets=torch.from_numpy(offsets),
        group_ids=[str(g) for g in range(int(group_ids.max()) + 1)],
        group_index=torch.from_numpy(group_ids),
        rewards=torch.from_numpy(rewards),
    )


@pytest.mark.parametrize("shaping", SHAPING, ids=["whiten", "whiten+clip", "clip"])
@pytest.mark.parametrize("outcome", OUTCOMES)
@pytest.mark.parametrize("seed", [0, 1])
def test_outcome_only_padded_whitening_and_clipping_are_compute_batchs(
    outcome: str, shaping: dict[str, Any], seed: int
) -> None:
    mask, rewards, group_ids = padded_rows(seed)
    estimator = {"outcome": outcome, **shaping}
    flat = compute_batch(flat_batch(mask, rewards, group_ids), estimator)
    expected = np.zeros(mask.shape, dtype=np.float32)
    expected[mask] = flat.advantages.numpy()  # (row-major: row by row, as the offsets)
    if "clip" in shaping:  # the case clips something, or it would not test clipping
        assert np.abs(flat.advantages.numpy()).max() == pytest.approx(shaping["clip"])

    for kind in ("numpy", "torch bool", "torch 0/1"):
        given: Any = mask
        if kind != "numpy":
            given = torch.from_numpy(mask if kind == "torch bool" else mask.astype(np.float32))
        got = compute_padded(None, given, rewards, group_ids, estimator=estimator)
        advantages = np.asarray(got.advantages)
        np.testing.assert_allclose(advantages, expected, rtol=2e-6, atol=1e-7, err_msg=kind)
        assert (advantages[~mask] == 0).all(), kind
        np.testing.assert_array_equal(np.asarray(got.scalars), flat.scalars.numpy(), kind)
