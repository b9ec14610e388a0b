"""GRPO's ``std_scope``: the group's mean subtracted, divided by the sample std of the group's
rewards (``group``) or of all the request's (``request``, TRL's ``scale_rewards="batch"``),
against TRL's own formula, on a request of one rollout, and with the request merged."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from advantage_service import compute
from advantage_service.batch import RolloutBatch
from advantage_service.errors import RequestError
from advantage_service.estimators import OUTCOMES
from advantage_service.wire.request import parse_request

REQUEST_SCOPE = {"name": "grpo", "std_scope": "request", "epsilon": 1e-4, "norm_by_std": True}


def batch_of(rewards: np.ndarray, group_index: np.ndarray) -> RolloutBatch:
    """One token per rollout: only the rewards and groups matter to an outcome."""
    count = int(group_index.max()) + 1
    return RolloutBatch.from_flat(
        tokens=np.zeros(rewards.size, dtype=np.int64),
        offsets=np.arange(rewards.size + 1),
        group_ids=[f"g{g}" for g in range(count)],
        group_index=group_index,
        rewards=rewards.astype(np.float32),
    )


def trl_batch_scaled(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """TRL 1.16's ``GRPOTrainer._generate_and_score_completions`` with
    ``scale_rewards="batch"`` (``sum_then_normalize``), on the rewards gathered from every
    process: the mean of each group of ``num_generations`` rows, the std of the whole batch,
    both NaN-aware (a row no reward function scored is NaN), then advantage 0 for NaN rows."""
    from trl.trainer.utils import nanstd

    mean = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    mean = mean.repeat_interleave(num_generations, dim=0)
    std = nanstd(rewards).expand_as(rewards)
    return torch.nan_to_num((rewards - mean) / (std + 1e-4), nan=0.0)


@pytest.mark.parametrize("seed", range(6))
def test_request_scope_is_trls_batch_scaling(seed: int) -> None:
    pytest.importorskip("trl")
    rng = np.random.default_rng(seed)
    generations = int(rng.integers(2, 9))
    groups = int(rng.integers(1, 7))
    rewards = rng.normal(size=groups * generations)
    rewards[rng.random(rewards.size) < 0.15] = np.nan  # unscored rows, at most one per group
    for g in range(groups):
        if np.isnan(rewards[g * generations : (g + 1) * generations]).sum() > 1:
            rewards[g * generations + 1 : (g + 1) * generations] = rng.normal(size=generations - 1)
    # float32 values (the service's rewards are float32), compared in float64
    rewards = rewards.astype(np.float32).astype(np.float64)
    trl = trl_batch_scaled(torch.as_tensor(rewards), generations).numpy()

    # The integration sends the scored rows only (their groups keep their positions).
    kept = ~np.isnan(rewards)
    group_index = np.unique(np.arange(rewards.size)[kept] // generations, return_inverse=True)[1]
    batch = batch_of(rewards[kept], group_index)
    ours = OUTCOMES["grpo"].fn(batch, REQUEST_SCOPE).numpy()
    assert ours.dtype == np.float64
    # TRL's nanstd takes Bessel's factor count / (count - 1) of two integer tensors: a float32
    # quotient (relative error up to 6e-8), the rest in float64.
    np.testing.assert_allclose(ours, trl[kept], rtol=2e-7, atol=1e-12)
    # The same math in float64 throughout: torch's unbiased std of the scored rewards.
    scored = torch.as_tensor(rewards[kept])
    means = np.array(
        [
            np.nanmean(rewards[i // generations * generations :][:generations])
            for i in np.flatnonzero(kept)
        ]
    )
    exact = (rewards[kept] - means) / (float(scored.std()) + 1e-4)
    np.testing.assert_allclose(ours, exact, rtol=1e-12, atol=1e-12)
    assert np.all(trl[~kept] == 0)
    group_scope = OUTCOMES["grpo"].fn(batch, {**REQUEST_SCOPE, "std_scope": "group"}).numpy()
    if groups > 1:  # (one group: its std is the batch's)
        assert not np.allclose(group_scope, trl[kept])


def test_request_scope_pools_the_groups_and_keeps_their_means() -> None:
    response = compute(
        {
            "estimator": {"outcome": {"name": "grpo", "std_scope": "request", "epsilon": 0.0}},
            "groups": [
                {"id": "a", "rollouts": [{"tokens": [1], "reward": r} for r in (1.0, 0.0)]},
                {"id": "b", "rollouts": [{"tokens": [1], "reward": r} for r in (3.0, 0.0)]},
            ],
        }
    )
    std = np.std([1.0, 0.0, 3.0, 0.0], ddof=1)
    got = [float(r["advantages"][0]) for g in response["groups"] for r in g["rollouts"]]
    np.testing.assert_allclose(got, [0.5 / std, -0.5 / std, 1.5 / std, -1.5 / std], rtol=1e-6)


@pytest.mark.parametrize("epsilon", [0.0, 0.5])
def test_a_request_of_one_rollout_gets_what_a_group_of_one_gets(epsilon: float) -> None:
    """No sample std over one reward: std 1, as for a group of one (whose mean is 0)."""
    answers = []
    for scope in ("group", "request"):
        outcome = {"name": "grpo", "std_scope": scope, "epsilon": epsilon}
        response = compute(
            {
                "estimator": {"outcome": outcome},
                "groups": [{"id": "a", "rollouts": [{"tokens": [1, 2], "reward": 3.0}]}],
            }
        )
        answers.append(response["groups"][0]["rollouts"][0]["advantages"].tolist())
    assert answers[0] == answers[1]
    np.testing.assert_allclose(answers[1], [3.0 / (1.0 + epsilon)] * 2, rtol=1e-7)


def test_equal_rewards_over_the_request_with_epsilon_zero_give_zero() -> None:
    batch = batch_of(np.array([2.0, 2.0, 2.0]), np.array([0, 0, 1]))
    out = OUTCOMES["grpo"].fn(batch, {**REQUEST_SCOPE, "epsilon": 0.0})
    # (the group of one keeps its mean 0: 2 / (0 + 0) would be inf; only 0 / 0 is 0)
    assert out[:2].tolist() == [0.0, 0.0]


def test_merged_requests_each_take_their_own_std() -> None:
    small = batch_of(np.array([1.0, 0.0]), np.array([0, 0]))
    large = batch_of(np.array([9.0, 0.0, 0.0, 4.0]), np.array([0, 0, 1, 1]))
    merged = RolloutBatch.concat([small, large])
    whole = OUTCOMES["grpo"].fn(merged, REQUEST_SCOPE)
    alone = torch.cat([OUTCOMES["grpo"].fn(b, REQUEST_SCOPE) for b in (small, large)])
    assert torch.equal(whole, alone)
    pooled = OUTCOMES["grpo"].fn(
        batch_of(np.array([1.0, 0, 9, 0, 0, 4]), np.array([0, 0, 1, 1, 2, 2])), REQUEST_SCOPE
    )
    assert not torch.allclose(whole, pooled)


@pytest.mark.parametrize(
    ("outcome", "says"),
    [
        ({"name": "grpo", "std_scope": "batch"}, "std_scope"),
        # grpo_passk keeps the group's std: the scope is grpo's alone
        ({"name": "grpo_passk", "std_scope": "request"}, "std_scope"),
    ],
)
def test_a_scope_grpo_does_not_know_is_refused(outcome: dict[str, Any], says: str) -> None:
    body = {
        "estimator": {"outcome": outcome},
        "groups": [{"id": "a", "rollouts": [{"tokens": [1], "reward": r} for r in (0.0, 1.0)]}],
    }
    with pytest.raises(RequestError, match=says):
        parse_request(body)
