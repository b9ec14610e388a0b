"""MaxRL (estimators/maxrl.py): the closed forms the paper's estimator gives for K of N correct,
the cases it leaves open (a group of one, continuous and negative rewards), the oracle, and the
properties of its control variate (hypothesis)."""

from __future__ import annotations

import numpy as np
import oracle
import pytest
import torch
from advantage_service import RequestError, RolloutBatch, compute, compute_batch
from hypothesis import given, settings
from hypothesis import strategies as st

SETTINGS = settings(max_examples=80, deadline=None)


def one_group(rewards: list[float], length: int = 3) -> RolloutBatch:
    n = len(rewards)
    return RolloutBatch.from_flat(
        tokens=np.zeros(n * length, dtype=np.int32),
        offsets=np.arange(n + 1, dtype=np.int64) * length,
        group_ids=["g"],
        group_index=np.zeros(n, dtype=np.int64),
        rewards=np.array(rewards, dtype=np.float32),
    )


@pytest.mark.parametrize("n", range(1, 9))
def test_maxrl_k_of_n_correct_is_n_minus_k_over_k_and_minus_one(n: int) -> None:
    for k in range(n + 1):
        rewards = [1.0] * k + [0.0] * (n - k)
        scalars = compute_batch(one_group(rewards), "maxrl").scalars.tolist()
        # K = 0: no success to learn from; K = N: nothing left to gain
        expected = [0.0] * n if k in (0, n) else [(n - k) / k] * k + [-1.0] * (n - k)
        assert scalars == [float(np.float32(e)) for e in expected], (n, k)


def test_maxrl_group_of_one_gets_zero_whatever_its_reward() -> None:
    for reward in (0.0, 0.25, 1.0, 7.0):
        assert compute_batch(one_group([reward]), "maxrl").scalars.tolist() == [0.0]


def test_maxrl_advantage_is_on_every_token_of_its_rollout() -> None:
    result = compute_batch(one_group([1.0, 0.0, 0.0, 0.0], length=2), "maxrl")
    assert result.advantages.tolist() == [3.0, 3.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0]


def test_maxrl_continuous_rewards_divide_the_centred_reward_by_the_mean() -> None:
    # mean 0.25: (0.5 - 0.25) / 0.25 = 1, (0 - 0.25) / 0.25 = -1, 0 at the mean
    scalars = compute_batch(one_group([0.5, 0.25, 0.0, 0.25]), "maxrl").scalars.tolist()
    assert scalars == [1.0, 0.0, -1.0, 0.0]


def test_maxrl_epsilon_is_added_to_the_success_rate() -> None:
    spec = {"outcome": {"name": "maxrl", "epsilon": 0.25}}
    # K = 1 of 4: (1 - 0.25) / (0.25 + 0.25) = 1.5, (0 - 0.25) / 0.5 = -0.5
    scalars = compute_batch(one_group([1.0, 0.0, 0.0, 0.0]), spec).scalars.tolist()
    assert scalars == [1.5, -0.5, -0.5, -0.5]
    # all wrong: 0 / epsilon = 0
    assert compute_batch(one_group([0.0, 0.0]), spec).scalars.tolist() == [0.0, 0.0]


def test_maxrl_refuses_a_negative_reward_naming_group_rollout_and_field() -> None:
    request = {
        "estimator": "maxrl",
        "groups": [
            {"id": "a", "rollouts": [{"tokens": [1], "reward": 1.0}]},
            {"id": "b", "rollouts": [{"tokens": [1], "reward": 0.0}, {"tokens": [], "reward": -1}]},
        ],
    }
    with pytest.raises(RequestError) as info:
        compute(request, device="cpu")
    err = info.value
    assert (err.code, err.group_id, err.rollout_index, err.field) == (
        "invalid_value",
        "b",
        1,
        "reward",
    )
    assert "maxrl needs rewards >= 0" in err.message
    # Another outcome takes the same rewards.
    request["estimator"] = "grpo"
    compute(request, device="cpu")


def test_maxrl_matches_the_oracle_on_random_requests() -> None:
    for seed in range(30):
        rng = np.random.default_rng(seed)
        epsilon = float(rng.choice([0.0, 1e-6, 0.5]))
        spec = {"outcome": {"name": "maxrl", "epsilon": epsilon}}
        request = oracle.random_request(rng, estimator=spec, group_size=(1, 8), empty_prob=0.2)
        ours = compute(request, device="cpu")
        reference = oracle.reference_compute(request)
        for g_ours, g_ref in zip(ours["groups"], reference["groups"], strict=True):
            for r_ours, r_ref in zip(g_ours["rollouts"], g_ref["rollouts"], strict=True):
                assert r_ours["scalar"] == pytest.approx(r_ref["scalar"], rel=2e-6, abs=1e-6)
                np.testing.assert_allclose(
                    r_ours["advantages"], r_ref["advantages"], rtol=2e-6, atol=1e-6
                )


# ---- properties ---------------------------------------------------------------------------------


@st.composite
def groups_of_rewards(draw, binary: bool, min_size: int = 1):
    """A batch of 1-4 groups of ``min_size``-10 rollouts with rewards >= 0 (0/1, or any)."""
    sizes = [draw(st.integers(min_size, 10)) for _ in range(draw(st.integers(1, 4)))]
    # (no subnormal rewards: float32 outcome scalars cannot hold their differences)
    any_reward = st.one_of(st.just(0.0), st.floats(2**-10, 4, width=32))
    reward = st.sampled_from([0.0, 1.0]) if binary else any_reward
    rewards = [draw(reward) for _ in range(sum(sizes))]
    return RolloutBatch.from_flat(
        tokens=np.zeros(sum(sizes), dtype=np.int32),
        offsets=np.arange(sum(sizes) + 1, dtype=np.int64),
        group_ids=[f"g{i}" for i in range(len(sizes))],
        group_index=np.repeat(np.arange(len(sizes)), sizes),
        rewards=np.array(rewards, dtype=np.float32),
    )


def per_group(batch: RolloutBatch, values: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(batch.num_groups, dtype=torch.float64)
    return out.index_add_(0, batch.group_index, values.double())


@SETTINGS
@given(groups_of_rewards(binary=False))
def test_maxrl_control_variate_sums_to_zero_and_keeps_the_sign_of_r_minus_the_mean(batch) -> None:
    a = compute_batch(batch, "maxrl").scalars.double()
    torch.testing.assert_close(
        per_group(batch, a), torch.zeros(batch.num_groups, dtype=torch.float64), atol=2e-5, rtol=0
    )
    mean = per_group(batch, batch.rewards) / batch.group_sizes
    centred = batch.rewards.double() - mean[batch.group_index]
    assert torch.all(torch.sign(a) == torch.sign(centred.float()).double())


@SETTINGS
@given(groups_of_rewards(binary=False, min_size=2))
def test_maxrl_is_dr_grpo_divided_by_the_success_rate(batch) -> None:
    """The paper's reweighting: the ML gradient is the RL gradient divided by p(x). (Groups of
    two or more: for a group of one dr_grpo takes verl's mean 0, MaxRL the rollout's reward.)"""
    maxrl = compute_batch(batch, "maxrl").scalars.double()
    centred = compute_batch(batch, "dr_grpo").scalars.double()
    rate = (per_group(batch, batch.rewards) / batch.group_sizes)[batch.group_index]
    expected = torch.where(rate > 0, centred / rate.clamp(min=1e-30), 0.0)
    torch.testing.assert_close(maxrl, expected, rtol=1e-5, atol=1e-5)


@SETTINGS
@given(st.integers(2, 16), st.data())
def test_maxrl_a_harder_prompt_weighs_its_successes_more(n, data) -> None:
    """Binary rewards: a correct rollout's advantage (N - K) / K falls as K grows (harder
    prompts, fewer successes, more credit each); a wrong one's stays -1."""
    k1 = data.draw(st.integers(1, n - 1))
    k2 = data.draw(st.integers(k1 + 1, n))
    a1 = compute_batch(one_group([1.0] * k1 + [0.0] * (n - k1)), "maxrl").scalars
    a2 = compute_batch(one_group([1.0] * k2 + [0.0] * (n - k2)), "maxrl").scalars
    assert float(a1[0]) > float(a2[0]) >= 0.0
    assert torch.all(a1[k1:] == -1.0)
