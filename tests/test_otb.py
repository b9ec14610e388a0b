"""OTB, the optimal token baseline (estimators/otb.py), against the oracle, its closed forms and
verl 0.9.1's ``compute_optimal_token_baseline_advantage``."""

from __future__ import annotations

import numpy as np
import oracle
import pytest
import torch
from advantage_service.batch import RolloutBatch
from advantage_service.estimators import otb
from token_batches import flat_batch, response_mask, right_padded, unpadded

# verl computes in float32 (w, its cumulative sum, the group sums); this module in float64.
VERL_TOL = 5e-6


def _oracle_flat(groups: list, **options) -> tuple[np.ndarray, np.ndarray]:
    per_rollout = [pair for group in groups for pair in oracle.otb_group(group, **options)]
    if not per_rollout:
        return np.zeros(0), np.zeros(0)
    return (
        np.concatenate([b for b, _ in per_rollout]),
        np.concatenate([a for _, a in per_rollout]),
    )


def _otb(batch, fields, **options) -> otb.TokenBaseline:
    return otb.optimal_token_baseline(
        batch, fields["logprobs"], fields["sum_pi_squared"], fields.get("is_weights"), **options
    )


@pytest.mark.parametrize("handle_zero_tail", [True, False])
@pytest.mark.parametrize("is_weights", [False, True])
def test_otb_matches_oracle_on_random_ragged_batches(is_weights: bool, handle_zero_tail: bool):
    for seed in range(40):
        rng = np.random.default_rng(seed)
        groups = oracle.random_token_groups(
            rng, group_size=(1, 6), length=(0, 30), is_weights=is_weights
        )
        epsilon = float(rng.choice([1e-8, 1e-3, 0.0])) if seed % 4 == 3 else 1e-8
        batch, fields = flat_batch(groups)
        result = _otb(batch, fields, epsilon=epsilon, handle_zero_tail=handle_zero_tail)
        assert result.baseline.dtype == result.advantage.dtype == torch.float64
        baseline, advantage = _oracle_flat(
            groups, epsilon=epsilon, handle_zero_tail=handle_zero_tail
        )
        np.testing.assert_allclose(result.baseline.numpy(), baseline, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(result.advantage.numpy(), advantage, rtol=1e-12, atol=1e-12)


def test_otb_group_with_one_reward_has_no_advantage_outside_the_zero_tail():
    """Equal rewards r: B_t = r sum W / (sum W + eps), so a_t = r eps / (sum W + eps), 0 to
    eps. Two exceptions, both by the contract (verl's): where every W of the position is 0
    (pi = 1 and S = 1 so far) B = 0 and a = r; and with handle_zero_tail the unique longest
    rollout's tail past the second longest length has B = 0, so a = r there."""
    rng = np.random.default_rng(11)
    groups = oracle.random_token_groups(
        rng, n_groups=(8, 8), group_size=(2, 6), length=(1, 30), equal_rewards_prob=1.0
    )
    batch, fields = flat_batch(groups)
    reward = batch.per_token(batch.rewards).double()
    plain = _otb(batch, fields, handle_zero_tail=False)
    tail = _otb(batch, fields, handle_zero_tail=True)
    w = otb.path_variance_proxy(fields["logprobs"], fields["sum_pi_squared"])
    no_weight = otb.segment_cumsum(w, batch.lengths) == 0
    # every W of the position 0 implies this rollout's own W is 0; the converse is what the
    # oracle checks, so here: where the rollout carries weight, no advantage
    assert plain.advantage[~no_weight].abs().max() <= 2e-6 * reward.abs().max()
    zero_tail = tail.baseline == 0
    assert torch.equal(tail.advantage[zero_tail], reward[zero_tail])
    assert torch.equal(tail.advantage[~zero_tail], plain.advantage[~zero_tail])
    assert bool(zero_tail.any())  # some group has a unique longest rollout


def test_otb_with_constant_w_is_the_mean_reward_of_the_rollouts_still_generating():
    """With w_it = c for every token, W_it = c (t + 1) is the same for every rollout at t, so
    B_gt = sum_{i: T_i > t} r_i / n_t with epsilon = 0: the mean reward of the n_t rollouts of
    the group that are still generating at position t. This is the group's length-aware mean
    baseline: B = mean_g at t = 0 (every non-empty rollout), drifting toward the rewards of the
    long rollouts as short ones end; a rollout longer than every other ends with B = its own
    reward (a = 0), unless handle_zero_tail sets B = 0 there."""
    rng = np.random.default_rng(12)
    groups = oracle.random_token_groups(rng, n_groups=(6, 6), group_size=(2, 6), length=(0, 25))
    batch, _ = flat_batch(groups)
    n = batch.num_tokens
    # pi = 1/2, S = 1/2: w = 1 - 1 + 1/2 = 1/2 on every token
    logprobs = torch.full((n,), float(np.log(np.float32(0.5))), dtype=torch.float32)
    result = otb.optimal_token_baseline(
        batch, logprobs, torch.full((n,), 0.5), epsilon=0.0, handle_zero_tail=False
    )
    for g, rollouts in enumerate(groups):
        lengths = [len(r["logprobs"]) for r in rollouts]
        rewards = [r["reward"] for r in rollouts]
        members = [i for i, gi in enumerate(batch.group_index.tolist()) if gi == g]
        for k, i in enumerate(members):
            start = int(batch.offsets[i])
            for t in range(lengths[k]):
                alive = [rewards[j] for j in range(len(rollouts)) if lengths[j] > t]
                expected = sum(alive) / len(alive)
                assert abs(float(result.baseline[start + t]) - expected) <= 1e-12, (g, k, t)


def test_otb_group_of_one_keeps_its_reward():
    rng = np.random.default_rng(13)
    groups = oracle.random_token_groups(rng, n_groups=(5, 5), group_size=(1, 1), length=(0, 20))
    batch, fields = flat_batch(groups)
    result = _otb(batch, fields)
    assert bool((result.baseline == 0).all())
    assert torch.equal(result.advantage, batch.per_token(batch.rewards).double())


def test_otb_empty_batch_and_groups_of_empty_rollouts():
    empty = {"reward": 1.0, "entropy": [], "logprobs": [], "sum_pi_squared": []}
    batch, fields = flat_batch([[empty, empty]])
    result = _otb(batch, fields)
    assert result.baseline.shape == result.advantage.shape == (0,)
    groups = oracle.random_token_groups(np.random.default_rng(14), n_groups=(3, 3))
    groups.insert(1, [empty, empty, empty])
    groups.append([empty, *groups[0]])
    batch, fields = flat_batch(groups)
    _, advantage = _oracle_flat(groups)
    np.testing.assert_allclose(_otb(batch, fields).advantage.numpy(), advantage, atol=1e-12)


def test_otb_cumulative_w_restarts_at_each_rollout():
    """Per-rollout sums, not differences of one running sum: after 300 000 values of order 1,
    tiny ones (1e-13) still add up as they do alone (a difference of the running sum, whose
    float64 step is 6e-11 there, reads 0 for all of them), and zeros stay 0. 300 000 values
    also take three levels of blocks."""
    rng = np.random.default_rng(15)
    big = torch.from_numpy(rng.uniform(0.0, 2.0, size=300_000))
    tiny = torch.tensor([1e-13, 3e-13, 0.0, 2e-13])
    zeros = torch.zeros(5)
    values = torch.cat([big, tiny, zeros, big[:7000]]).double()
    lengths = torch.tensor([300_000, 0, 4, 5, 7000])
    out = otb.segment_cumsum(values, lengths)
    pieces = torch.split(values, lengths.tolist())
    expected = torch.cat([torch.cumsum(p, 0) for p in pieces])
    np.testing.assert_allclose(out.numpy(), expected.numpy(), rtol=1e-13, atol=0)
    assert out[300_000:300_004].tolist() == torch.cumsum(tiny.double(), 0).tolist()
    assert bool((out[300_004:300_009] == 0).all())


# ---------------------------------------------------------------------------------------------
# Parity with verl 0.9.1 (compute_optimal_token_baseline_advantage, right-padded batches)
# ---------------------------------------------------------------------------------------------


def _verl_otb(batch, fields, rng: np.random.Generator, handle_zero_tail: bool) -> torch.Tensor:
    """verl's advantages on the right-padded batch, back in flat order. The reward sits at each
    rollout's last token (verl's token_level_rewards); the padding holds arbitrary values."""
    from verl.trainer.ppo.core_algos import compute_optimal_token_baseline_advantage

    mask = response_mask(batch)
    token_level_rewards = torch.zeros_like(mask)
    rows = torch.nonzero(batch.lengths > 0).flatten()
    token_level_rewards[rows, batch.lengths[rows] - 1] = batch.rewards[rows]
    uid = np.array([batch.group_ids[g] for g in batch.group_index.tolist()], dtype=object)
    is_weights = fields.get("is_weights")
    advantages, returns = compute_optimal_token_baseline_advantage(
        token_level_rewards,
        mask,
        uid,
        right_padded(batch, fields["logprobs"], pad=-float(rng.uniform(0, 3))),
        right_padded(batch, fields["sum_pi_squared"], pad=float(rng.uniform(0, 1))),
        rollout_is_weights=None if is_weights is None else right_padded(batch, is_weights, 2.0),
        handle_zero_tail=handle_zero_tail,
    )
    assert torch.equal(unpadded(batch, returns), batch.per_token(batch.rewards))
    assert bool((advantages[mask == 0] == 0).all())
    return unpadded(batch, advantages)


@pytest.mark.parametrize("handle_zero_tail", [True, False])
@pytest.mark.parametrize("is_weights", [False, True])
def test_otb_matches_verl_compute_optimal_token_baseline_advantage(
    is_weights: bool, handle_zero_tail: bool
):
    for seed in range(25):
        rng = np.random.default_rng(300 + seed)
        groups = oracle.random_token_groups(
            rng, n_groups=(1, 6), group_size=(1, 8), length=(0, 120), is_weights=is_weights
        )
        batch, fields = flat_batch(groups)
        if batch.num_tokens == 0:
            continue
        ours = _otb(batch, fields, handle_zero_tail=handle_zero_tail).advantage
        theirs = _verl_otb(batch, fields, rng, handle_zero_tail).double()
        np.testing.assert_allclose(
            ours.numpy(), theirs.numpy(), rtol=VERL_TOL, atol=VERL_TOL, err_msg=f"seed {seed}"
        )


def test_otb_merged_batch_equals_each_request_alone():
    """RolloutBatch.concat keeps each request's groups its own, so OTB of the merged batch is
    each request's OTB side by side."""
    parts = [
        flat_batch(oracle.random_token_groups(np.random.default_rng(seed), length=(0, 30)))
        for seed in (30, 31)
    ]
    parts.insert(1, flat_batch([]))
    merged = RolloutBatch.concat([batch for batch, _ in parts])
    fields = {k: torch.cat([f[k] for _, f in parts]) for k in ("logprobs", "sum_pi_squared")}
    expected = torch.cat([_otb(b, f).advantage for b, f in parts])
    assert torch.equal(_otb(merged, fields).advantage, expected)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_otb_on_cuda_matches_cpu():
    groups = oracle.random_token_groups(np.random.default_rng(32), length=(0, 200), is_weights=True)
    batch, fields = flat_batch(groups)
    cpu = _otb(batch, fields)
    cuda = _otb(batch.to("cuda"), {k: v.cuda() for k, v in fields.items()})
    np.testing.assert_allclose(cuda.advantage.cpu().numpy(), cpu.advantage.numpy(), atol=1e-12)
