"""The ``gdpo`` outcome: each reward component normalised in its group, weighted, summed and
normalised over the request, against verl's own ``compute_gdpo_outcome_advantage``, TRL's
``normalize_then_sum`` lines, and the slow reference (tests/gdpo_oracle.py); missing values,
groups of one, equal rewards, the merge property, refusals, and composition with a term."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from advantage_service.batch import RolloutBatch
from advantage_service.errors import RequestError
from advantage_service.estimators import OUTCOMES, TERMS, TermContext, compute_batch
from advantage_service.estimators.pipeline import check_inputs
from advantage_service.estimators.spec import resolve_estimator
from gdpo_oracle import gdpo_reference

VERL = {"weights": {}, "normalization": "verl"}
TRL = {"weights": {}, "normalization": "trl"}


def make_batch(
    sizes: list[int],
    components: dict[str, np.ndarray],
    lengths: np.ndarray | None = None,
    seed: int = 0,
) -> RolloutBatch:
    """Groups of ``sizes`` rollouts; ``components``: name -> (B,) values, NaN for none."""
    count = sum(sizes)
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 6, count) if lengths is None else lengths
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return RolloutBatch.from_flat(
        tokens=rng.integers(1, 50, int(offsets[-1])),
        offsets=offsets,
        group_ids=[f"g{g}" for g in range(len(sizes))],
        group_index=np.repeat(np.arange(len(sizes)), sizes),
        rewards=np.zeros(count, dtype=np.float32),
        reward_components={k: v.astype(np.float32) for k, v in components.items()},
    )


def as_groups(batch: RolloutBatch) -> list[list[tuple[dict[str, float | None], int]]]:
    """The batch in the reference's shape."""
    groups: list[list[tuple[dict[str, float | None], int]]] = [[] for _ in batch.group_ids]
    for i in range(batch.num_rollouts):
        comps: dict[str, float | None] = {}
        for name, values in batch.reward_components.items():
            v = float(values[i])
            comps[name] = None if np.isnan(v) else v
        groups[int(batch.group_index[i])].append((comps, int(batch.lengths[i])))
    return groups


def random_components(
    rng: np.random.Generator, count: int, names: list[str], missing: float
) -> dict[str, np.ndarray]:
    out = {}
    for name in names:
        kind = rng.integers(0, 3)
        if kind == 0:
            values = rng.integers(0, 2, count).astype(float)  # 0/1 accuracy
        elif kind == 1:
            values = rng.normal(size=count) * rng.choice([0.1, 1.0, 30.0])
        else:
            values = rng.choice([0.0, 0.5, 1.0], count)
        values[rng.random(count) < missing] = np.nan
        out[name] = values
    return out


# ---- verl's own function -----------------------------------------------------------------------


def verl_gdpo(
    batch: RolloutBatch, keys: list[str], weights: list[float] | None
) -> tuple[np.ndarray, torch.Tensor]:
    """verl 0.9.1's ``compute_gdpo_outcome_advantage`` on the same batch as verl's trainer
    hands it over (``ray_trainer.compute_advantage``: the scores of each key in
    ``non_tensor_batch``, the prompts and attention mask in ``batch``): (B, T) advantages and
    the response mask."""
    from verl.trainer.ppo.core_algos import compute_gdpo_outcome_advantage

    lengths = batch.lengths.numpy()
    width = int(lengths.max())
    mask = torch.zeros((batch.num_rollouts, width), dtype=torch.float32)
    for i, t in enumerate(lengths):
        mask[i, :t] = 1.0
    prompt = 3
    attention = torch.cat([torch.ones(batch.num_rollouts, prompt), mask], dim=1).long()
    config: dict[str, Any] = {"gdpo_reward_keys": keys}
    if weights is not None:
        config["gdpo_reward_weights"] = weights
    uids = np.array([batch.group_ids[int(g)] for g in batch.group_index], dtype=object)
    advantages, _ = compute_gdpo_outcome_advantage(
        token_level_rewards=torch.zeros_like(mask),
        response_mask=mask,
        index=uids,
        config=config,
        non_tensor_batch={k: batch.reward_components[k].numpy().tolist() for k in keys},
        batch={"prompts": torch.zeros(batch.num_rollouts, prompt), "attention_mask": attention},
    )
    return advantages.numpy(), mask


@pytest.mark.parametrize("keys", [2, 3])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_verl_normalization_is_verls_compute_gdpo_outcome_advantage(
    keys: int, weighted: bool, seed: int
) -> None:
    pytest.importorskip("verl")
    rng = np.random.default_rng(seed)
    # groups of one and groups of equal values among them
    sizes = [int(s) for s in rng.integers(1, 7, int(rng.integers(2, 7)))]
    names = ["format", "accuracy", "length"][:keys]
    components = random_components(rng, sum(sizes), names, missing=0.0)
    components[names[0]][: sizes[0]] = 1.0  # the first group: equal values of one component
    batch = make_batch(sizes, components, seed=seed)
    weights = [float(w) for w in rng.uniform(0.2, 2.0, keys)] if weighted else None
    theirs, mask = verl_gdpo(batch, names, weights)
    params = {"weights": dict(zip(names, weights, strict=True)) if weights else {}}
    ours = OUTCOMES["gdpo"].fn(batch, {**VERL, **params}).numpy()
    # verl computes in float32: agreement to its rounding, relative to the largest |A|
    scale = max(1.0, float(np.abs(theirs).max()))
    np.testing.assert_allclose(ours[:, None] * mask.numpy(), theirs, rtol=1e-5, atol=2e-6 * scale)


def test_each_component_is_normalised_before_the_sum() -> None:
    """A wide reward does not drown a narrow one: GDPO differs from normalising the sum."""
    comps = {"acc": np.array([1.0, 0.0, 0.0, 1.0]), "len": np.array([30.0, 10.0, 0.0, 20.0])}
    batch = make_batch([4], comps, lengths=np.ones(4, dtype=np.int64))
    summed = make_batch([4], {"sum": comps["acc"] + comps["len"]}, np.ones(4, dtype=np.int64))
    for params in (VERL, TRL):
        ours = OUTCOMES["gdpo"].fn(batch, params).numpy()
        assert not np.allclose(ours, OUTCOMES["gdpo"].fn(summed, params).numpy(), atol=1e-2)


def test_verl_group_of_one_is_its_reward_over_one_plus_eps_before_whitening() -> None:
    """verl's group of one: mean 0, std 1; here one group of one and one of two rollouts,
    one token each: S = [3 / (1 + 1e-6), -1/(1/sqrt2 + 1e-6), +1/(...)] (two keys, one zero)."""
    comps = {"a": np.array([3.0, 0.0, 2.0]), "b": np.array([0.0, 0.0, 0.0])}
    batch = make_batch([1, 2], comps, lengths=np.array([1, 1, 1]))
    std = np.std([0.0, 2.0], ddof=1)
    s = np.array([3.0 / (1 + 1e-6), -1.0 / (std + 1e-6), 1.0 / (std + 1e-6)])
    mean = s.sum() / (3 + 1e-8)
    var = ((s - mean) ** 2).sum() / (3 + 1e-8) * 3 / 2
    want = (s - mean) / np.sqrt(var + 1e-8)
    got = OUTCOMES["gdpo"].fn(batch, VERL).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-12)


# ---- TRL's normalize_then_sum ------------------------------------------------------------------


def trl_normalize_then_sum(
    rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int
) -> torch.Tensor:
    """TRL 1.16 ``GRPOTrainer._generate_and_score_completions`` with
    ``multi_objective_aggregation="normalize_then_sum"``, line for line: trl/trainer/
    grpo_trainer.py:2759 (the unscorable mask), 2790-2800 (the branch) and 2810 (the NaN
    advantages set to 0), with TRL's own ``nanstd``; it is inline
    code of the trainer, not a function to import (a real trainer step runs it in
    tests/trainers/test_trl_gdpo.py)."""
    from trl.trainer.utils import nanstd

    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    k = rewards_per_func.shape[1]
    grouped = rewards_per_func.view(-1, num_generations, k)
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = (
        nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean_k)
    )
    reward_k = (grouped - mean_k) / (std_k + 1e-4)
    reward_k = reward_k.view(-1, k)
    rewards = (reward_k * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    std_rewards = (
        nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    )
    advantages = (rewards - torch.nanmean(rewards)) / (std_rewards + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


@pytest.mark.parametrize("generations", [1, 2, 4, 7])
@pytest.mark.parametrize("seed", range(5))
def test_trl_normalization_is_trls_normalize_then_sum(generations: int, seed: int) -> None:
    pytest.importorskip("trl")
    rng = np.random.default_rng(seed)
    groups = int(rng.integers(1, 6))
    count = groups * generations
    names = ["acc", "fmt", "len"][: int(rng.integers(2, 4))]
    components = random_components(rng, count, names, missing=0.2)
    # an unscorable row (every function None) and a group with one value of a component
    components = {k: v.copy() for k, v in components.items()}
    for v in components.values():
        v[0] = np.nan
    if generations > 2:
        components[names[1]][generations : 2 * generations - 1] = np.nan
    weights = rng.uniform(0.1, 2.0, len(names))
    stacked = np.stack([components[n] for n in names], axis=1)
    theirs = trl_normalize_then_sum(
        torch.as_tensor(stacked, dtype=torch.float32),
        torch.as_tensor(weights, dtype=torch.float32),
        generations,
    ).numpy()
    # every row sent (the unscorable one with a reward and no component value)
    batch = make_batch([generations] * groups, components, seed=seed)
    params = {"weights": dict(zip(names, map(float, weights), strict=True)), "normalization": "trl"}
    ours = OUTCOMES["gdpo"].fn(batch, params).numpy()
    scale = max(1.0, float(np.abs(theirs).max()))
    np.testing.assert_allclose(ours, theirs, rtol=2e-5, atol=2e-6 * scale)
    assert ours[0] == 0.0


# ---- the reference, edge cases, the merge property --------------------------------------------


@pytest.mark.parametrize("normalization", ["verl", "trl"])
@pytest.mark.parametrize("seed", range(8))
def test_gdpo_equals_the_reference(normalization: str, seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    sizes = [int(s) for s in rng.integers(1, 6, int(rng.integers(1, 6)))]
    count = sum(sizes)
    names = ["a", "b", "c"][: int(rng.integers(1, 4))]
    components = random_components(rng, count, names, missing=0.25)
    lengths = rng.integers(0, 5, count)  # empty rollouts too
    batch = make_batch(sizes, components, lengths=lengths)
    weights = {n: float(rng.uniform(-1, 2)) for n in names if rng.random() < 0.6}
    params = {"weights": weights, "normalization": normalization}
    ours = OUTCOMES["gdpo"].fn(batch, params).numpy()
    want = gdpo_reference(as_groups(batch), weights, normalization)
    np.testing.assert_allclose(ours, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("normalization", ["verl", "trl"])
def test_equal_rewards_everywhere_give_zero(normalization: str) -> None:
    batch = make_batch([3, 2], {"a": np.full(5, 1.0), "b": np.full(5, 0.5)})
    assert (
        OUTCOMES["gdpo"].fn(batch, {**VERL, "normalization": normalization}).tolist() == [0.0] * 5
    )


def test_trl_groups_of_one_add_nothing() -> None:
    """TRL: one value of a component in a group has no std: the group of one sums to 0, then
    the request's normalisation moves it by the mean of the others."""
    comps = {"a": np.array([5.0, 1.0, 0.0, 1.0, 0.0])}
    batch = make_batch([1, 2, 2], comps)
    s = np.array([0.0, 0.5, -0.5, 0.5, -0.5]) / (np.std([1.0, 0.0], ddof=1) + 1e-4)
    want = (s - s.mean()) / (np.std(s, ddof=1) + 1e-4)
    np.testing.assert_allclose(OUTCOMES["gdpo"].fn(batch, TRL).numpy(), want, rtol=1e-12)


@pytest.mark.parametrize("normalization", ["verl", "trl"])
def test_a_rollout_without_any_component_value_gets_zero_and_is_left_out(
    normalization: str,
) -> None:
    comps = {"a": np.array([1.0, 0.0, np.nan, 1.0, 0.0]), "b": np.array([0, 1, np.nan, 1, 0.0])}
    batch = make_batch([3, 2], comps, lengths=np.array([2, 2, 9, 2, 2]))
    got = OUTCOMES["gdpo"].fn(batch, {**VERL, "normalization": normalization}).numpy()
    assert got[2] == 0.0
    kept = make_batch([2, 2], {k: np.delete(v, 2) for k, v in comps.items()}, np.full(4, 2))
    alone = OUTCOMES["gdpo"].fn(kept, {**VERL, "normalization": normalization}).numpy()
    np.testing.assert_allclose(np.delete(got, 2), alone, rtol=1e-12)


@pytest.mark.parametrize("normalization", ["verl", "trl"])
def test_a_merged_batch_answers_each_request_as_alone(normalization: str) -> None:
    rng = np.random.default_rng(7)
    first = make_batch([3, 2], random_components(rng, 5, ["a", "b"], 0.2), seed=1)
    second = make_batch([4, 1, 3], random_components(rng, 8, ["b", "c"], 0.2), seed=2)
    params = {"weights": {"b": 2.0}, "normalization": normalization}
    merged = RolloutBatch.concat([first, second])
    whole = OUTCOMES["gdpo"].fn(merged, params)
    alone = torch.cat([OUTCOMES["gdpo"].fn(b, params) for b in (first, second)])
    assert torch.equal(whole, alone)
    # not the normalisation of the merged batch as one request
    pooled = RolloutBatch.concat([first, second])
    pooled.segments = None
    assert not torch.allclose(OUTCOMES["gdpo"].fn(pooled, params), alone)


# ---- refusals and composition ------------------------------------------------------------------


def test_a_request_without_components_is_refused_naming_the_field() -> None:
    batch = RolloutBatch.from_flat(
        tokens=[1, 2, 3], offsets=[0, 1, 3], group_ids=["g"], group_index=[0, 0], rewards=[1, 0]
    )
    with pytest.raises(RequestError) as caught:
        check_inputs(batch, resolve_estimator("gdpo"), ())
    assert caught.value.field == "reward_components"


def test_weights_naming_an_unknown_component_are_refused() -> None:
    batch = make_batch([2], {"format": np.array([1.0, 0.0])})
    spec = resolve_estimator({"outcome": {"name": "gdpo", "weights": {"accuracy": 2.0}}})
    with pytest.raises(RequestError) as caught:
        check_inputs(batch, spec, ())
    assert caught.value.field == "estimator.outcome.weights.accuracy"


@pytest.mark.parametrize(
    ("weights", "field"),
    [
        ([1.0], "estimator.outcome.weights"),
        ({"a": "x"}, "estimator.outcome.weights.a"),
        ({"a": float("inf")}, "estimator.outcome.weights.a"),
        ({"a": True}, "estimator.outcome.weights.a"),
        ({f"c{i}": 1.0 for i in range(17)}, "estimator.outcome.weights"),
        ({"": 1.0}, "estimator.outcome.weights"),
    ],
)
def test_bad_weights_are_refused(weights: Any, field: str) -> None:
    with pytest.raises(RequestError) as caught:
        resolve_estimator({"outcome": {"name": "gdpo", "weights": weights}})
    assert caught.value.field == field


def test_a_normalization_it_does_not_know_is_refused() -> None:
    with pytest.raises(RequestError, match="normalization"):
        resolve_estimator({"outcome": {"name": "gdpo", "normalization": "batch"}})


def test_gdpo_composes_with_a_term_like_any_outcome() -> None:
    """A_it = a_i w_it + b_it with KTAE's weight and bonus on gdpo's a_i."""
    rng = np.random.default_rng(3)
    comps = {"acc": np.array([1.0, 0, 1, 0, 1, 0]), "fmt": rng.uniform(size=6)}
    batch = make_batch([3, 3], comps, lengths=np.array([4, 3, 5, 2, 6, 3]), seed=3)
    batch.rewards = torch.as_tensor(comps["acc"], dtype=torch.float32)
    spec = resolve_estimator({"outcome": {"name": "gdpo"}, "ktae": {}})
    got = compute_batch(batch, spec).advantages.double()
    a = OUTCOMES["gdpo"].fn(batch, VERL)
    term = TERMS["ktae"].fn(batch, spec.terms["ktae"], TermContext())
    want = batch.per_token(a)
    if term.weight is not None:
        want = want * term.weight.double()
    if term.bonus is not None:
        want = want + term.bonus.double()
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(got, batch.per_token(a).double(), atol=1e-4)
