"""Forking tokens (estimators/forking.py) against the oracle, torch.quantile, numpy's linear
quantile past torch.quantile's 2^24 limit, and TRL's ``GRPOTrainer.get_high_entropy_mask``.

The mask must match to the token: a threshold one float32 step off drops or keeps a token, so
the quantile is compared bit for bit wherever torch.quantile can compute it.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import oracle
import pytest
import torch
from advantage_service.batch import RolloutBatch
from advantage_service.estimators import forking
from token_batches import flat_batch, response_mask, right_padded, unpadded

RHOS = (0.2, 0.1, 0.5, 1.0, 0.05)


def _random_rho(rng: np.random.Generator) -> float:
    return float(rng.choice([*RHOS, float(rng.uniform(0.01, 1.0))]))


def _oracle_flat(groups: list, rho: float, scope: str) -> np.ndarray:
    masks = [m for group in oracle.forking_masks(groups, rho, scope) for m in group]
    return np.concatenate(masks) if masks else np.zeros(0, dtype=bool)


def _one_rollout_batch(n: int) -> RolloutBatch:
    """A batch of one group holding one rollout of n tokens (built without validation: the
    tokens are never read)."""
    return RolloutBatch(
        tokens=torch.zeros(n, dtype=torch.int32),
        offsets=torch.tensor([0, n]),
        group_index=torch.tensor([0]),
        group_ids=["g0"],
        rewards=torch.zeros(1),
    )


def test_forking_quantiles_equal_torch_quantile_bit_for_bit():
    rng = np.random.default_rng(0)
    for case in range(400):
        n = int(rng.integers(1, 300))
        values = torch.from_numpy(rng.exponential(1.0, size=n).astype(np.float32))
        if case % 3 == 0:
            values = torch.round(values * 4) / 4  # ties
        q = float(rng.choice([0.8, 0.9, 0.95, 0.5, 0.0, 1.0, float(rng.random())]))
        expected = torch.quantile(values, q).item()
        assert forking.request_quantile(values, q).item() == expected, (case, n, q)
        # the same values as one segment among others of the group scope's single sort
        other = torch.from_numpy(rng.exponential(1.0, size=7).astype(np.float32))
        joined = torch.cat([other, values, other])
        segment = torch.cat(
            [torch.zeros(7, dtype=torch.long), torch.ones(n, dtype=torch.long), torch.full((7,), 3)]
        )
        tau = forking.segment_quantiles(joined, segment, 4, q)
        assert tau[1].item() == expected, (case, n, q)
        assert tau[0].item() == tau[3].item() == torch.quantile(other, q).item()
        assert math.isinf(tau[2].item())  # an empty segment


def test_forking_oracle_quantile_equals_torch_quantile():
    rng = np.random.default_rng(1)
    for case in range(300):
        n = int(rng.integers(1, 80))
        values = rng.exponential(1.0, size=n).astype(np.float32)
        q = float(rng.choice([0.8, 0.9, 0.95, float(rng.random())]))
        expected = torch.quantile(torch.from_numpy(values), q).item()
        assert oracle.torch_linear_quantile(values, q) == np.float32(expected), (case, n, q)


@pytest.mark.parametrize("scope", forking.SCOPES)
def test_forking_mask_matches_oracle_on_random_ragged_batches(scope: str):
    for seed in range(60):
        rng = np.random.default_rng(seed)
        groups = oracle.random_token_groups(
            rng, group_size=(1, 6), length=(0, 24), entropy_ties=seed % 2 == 0
        )
        batch, fields = flat_batch(groups)
        rho = _random_rho(rng)
        mask = forking.forking_mask(batch, fields["entropy"], rho, scope)
        assert mask.dtype == torch.bool and mask.shape == (batch.num_tokens,)
        expected = _oracle_flat(groups, rho, scope)
        assert np.array_equal(mask.numpy(), expected), (seed, rho, scope)


@pytest.mark.parametrize("scope", forking.SCOPES)
def test_forking_rho_one_keeps_every_token(scope: str):
    rng = np.random.default_rng(2)
    batch, fields = flat_batch(oracle.random_token_groups(rng, n_groups=(4, 4)))
    assert bool(forking.forking_mask(batch, fields["entropy"], 1.0, scope).all())


def test_forking_keeps_about_ceil_rho_n_tokens_without_ties():
    """With distinct entropies the q = 1 - rho quantile lies between the sorted values at
    floor(q (N - 1)) and ceil(q (N - 1)), so ceil(rho (N - 1)) tokens, or one more when the rank
    is whole, are at or above it: never more than ceil(rho N), never fewer than one less."""
    rng = np.random.default_rng(3)
    for _ in range(200):
        n = int(rng.integers(1, 5000))
        entropy = torch.from_numpy(rng.permutation(n).astype(np.float32) / 7)
        rho = _random_rho(rng)
        kept = int(forking.forking_mask(_one_rollout_batch(n), entropy, rho).sum())
        assert math.ceil(rho * n) - 1 <= kept <= math.ceil(rho * n), (n, rho, kept)


def test_forking_group_scope_keeps_about_ceil_rho_n_of_every_group():
    rng = np.random.default_rng(4)
    groups = oracle.random_token_groups(
        rng, n_groups=(6, 6), group_size=(1, 5), length=(0, 300), entropy_ties=False
    )
    batch, fields = flat_batch(groups)
    mask = forking.forking_mask(batch, fields["entropy"], 0.2, "group")
    group_of_token = batch.per_token(batch.group_index)
    for g in range(batch.num_groups):
        n = int((group_of_token == g).sum())
        kept = int(mask[group_of_token == g].sum())
        assert math.ceil(0.2 * n) - 1 <= kept <= math.ceil(0.2 * n), (g, n, kept)


@pytest.mark.parametrize("scope", forking.SCOPES)
def test_forking_empty_request_and_groups_without_tokens(scope: str):
    empty = flat_batch([[{"reward": 1.0, "entropy": [], "logprobs": [], "sum_pi_squared": []}]])
    batch, fields = empty
    assert forking.forking_mask(batch, fields["entropy"], 0.2, scope).shape == (0,)
    assert math.isinf(float(forking.forking_thresholds(batch, fields["entropy"], 0.2, scope)[0]))

    groups = oracle.random_token_groups(np.random.default_rng(5), n_groups=(3, 3))
    groups.insert(1, [{"reward": 0.0, "entropy": [], "logprobs": [], "sum_pi_squared": []}] * 2)
    batch, fields = flat_batch(groups)
    mask = forking.forking_mask(batch, fields["entropy"], 0.3, scope)
    assert np.array_equal(mask.numpy(), _oracle_flat(groups, 0.3, scope))
    tau = forking.forking_thresholds(batch, fields["entropy"], 0.3, scope)
    assert math.isinf(float(tau[1])) == (scope == "group")


def test_forking_rejects_rho_outside_0_1_and_unknown_scopes():
    batch, fields = flat_batch(oracle.random_token_groups(np.random.default_rng(6)))
    for rho in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="rho"):
            forking.forking_mask(batch, fields["entropy"], rho)
    with pytest.raises(ValueError, match="scope"):
        forking.forking_mask(batch, fields["entropy"], 0.2, "batch")


def test_forking_quantile_past_torch_limit_matches_numpy_linear():
    """2^24 + 3 entropies, more than torch.quantile takes: tau and the mask follow numpy's
    linear quantile (float64 rank 0.8 (N - 1), fraction 0.4)."""
    n = 2**24 + 3
    generator = torch.Generator().manual_seed(7)
    entropy = torch.rand(n, generator=generator) * 4
    batch = _one_rollout_batch(n)
    tau = float(forking.request_quantile(entropy, 0.8))
    values = entropy.numpy()
    expected = float(np.quantile(values.astype(np.float64), 0.8))
    assert abs(tau - expected) <= 1e-12 * expected
    mask = forking.forking_mask(batch, entropy, 0.2).numpy()
    assert np.array_equal(mask, values >= expected)


def test_forking_group_scope_float64_ranks_past_the_limit_match_numpy(monkeypatch):
    """The float64 rank path of big groups, with the limit lowered so the groups stay small."""
    monkeypatch.setattr(forking, "FLOAT32_RANK_LIMIT", 50)
    rng = np.random.default_rng(8)
    groups = oracle.random_token_groups(
        rng, n_groups=(5, 5), group_size=(2, 6), length=(0, 40), entropy_ties=False
    )
    batch, fields = flat_batch(groups)
    entropy = fields["entropy"]
    group_of_token = batch.per_token(batch.group_index)
    tau = forking.forking_thresholds(batch, entropy, 0.3, "group")
    mask = forking.forking_mask(batch, entropy, 0.3, "group")
    for g in range(batch.num_groups):
        values = entropy[group_of_token == g].numpy()
        if len(values) <= 50:
            assert float(tau[g]) == torch.quantile(torch.from_numpy(values), 0.7).item()
            continue
        expected = float(np.quantile(values.astype(np.float64), 0.7))
        assert abs(float(tau[g]) - expected) <= 1e-12 * expected, g
        assert np.array_equal(mask[group_of_token == g].numpy(), values >= expected), g


# ---------------------------------------------------------------------------------------------
# Parity with TRL (GRPOTrainer.get_high_entropy_mask, one process)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trl_trainer() -> SimpleNamespace:
    """What ``get_high_entropy_mask`` reads of its trainer: an accelerate ``Accelerator`` (its
    pad_across_processes and gather, identities on one process)."""
    from accelerate import Accelerator

    return SimpleNamespace(accelerator=Accelerator(cpu=True))


def _trl_mask(trainer: SimpleNamespace, entropies: torch.Tensor, mask: torch.Tensor, rho: float):
    from trl.trainer.grpo_trainer import GRPOTrainer

    # TRL passes 1 - top_entropy_quantile as the quantile, with top_entropy_quantile = rho
    return GRPOTrainer.get_high_entropy_mask(trainer, entropies, mask, 1 - rho)


def test_forking_request_scope_matches_trl_get_high_entropy_mask(trl_trainer):
    for seed in range(40):
        rng = np.random.default_rng(100 + seed)
        groups = oracle.random_token_groups(
            rng, group_size=(1, 8), length=(0, 40), entropy_ties=seed % 2 == 0
        )
        batch, fields = flat_batch(groups)
        rho = _random_rho(rng)
        entropies = right_padded(batch, fields["entropy"], pad=float(rng.uniform(0, 3)))
        padding = response_mask(batch)
        theirs = _trl_mask(trl_trainer, entropies, padding, rho)
        assert not bool(theirs[padding == 0].any())
        ours = forking.forking_mask(batch, fields["entropy"], rho, "request")
        assert torch.equal(ours, unpadded(batch, theirs)), (seed, rho)


def test_forking_group_scope_matches_trl_on_each_group(trl_trainer):
    for seed in range(15):
        rng = np.random.default_rng(200 + seed)
        groups = oracle.random_token_groups(rng, group_size=(1, 8), length=(0, 40))
        batch, fields = flat_batch(groups)
        rho = _random_rho(rng)
        ours = forking.forking_mask(batch, fields["entropy"], rho, "group")
        group_of_token = batch.per_token(batch.group_index)
        for g, rollouts in enumerate(groups):
            group_batch, group_fields = flat_batch([rollouts])
            entropies = right_padded(group_batch, group_fields["entropy"])
            theirs = _trl_mask(trl_trainer, entropies, response_mask(group_batch), rho)
            expected = unpadded(group_batch, theirs)
            assert torch.equal(ours[group_of_token == g], expected), (seed, g, rho)


@pytest.mark.parametrize("scope", forking.SCOPES)
def test_forking_merged_batch_takes_each_requests_own_quantile(scope: str):
    """A batch merging requests (RolloutBatch.concat): scope request means each request."""
    parts = [
        flat_batch(oracle.random_token_groups(np.random.default_rng(seed), length=(0, 30)))
        for seed in (20, 21, 22)
    ]
    parts.insert(1, flat_batch([]))  # a request with no rollouts
    merged = RolloutBatch.concat([batch for batch, _ in parts])
    entropy = torch.cat([fields["entropy"] for _, fields in parts])
    expected_mask = torch.cat([forking.forking_mask(b, f["entropy"], 0.3, scope) for b, f in parts])
    assert torch.equal(forking.forking_mask(merged, entropy, 0.3, scope), expected_mask)
    expected_tau = torch.cat(
        [forking.forking_thresholds(b, f["entropy"], 0.3, scope) for b, f in parts]
    )
    assert torch.equal(forking.forking_thresholds(merged, entropy, 0.3, scope), expected_tau)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("scope", forking.SCOPES)
def test_forking_mask_on_cuda_matches_cpu(scope: str):
    groups = oracle.random_token_groups(np.random.default_rng(23), length=(0, 200))
    batch, fields = flat_batch(groups)
    cpu = forking.forking_mask(batch, fields["entropy"], 0.2, scope)
    cuda = forking.forking_mask(batch.to("cuda"), fields["entropy"].cuda(), 0.2, scope)
    assert torch.equal(cuda.cpu(), cpu)
