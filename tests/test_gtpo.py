"""GTPO and GRPO-S (estimators/gtpo.py, estimators/grpo_s.py): against the oracle, hand-worked
shaped rewards, the cases the paper leaves open (entropies of 0, groups without contrast, empty
rollouts), and the properties the paper states (hypothesis): the entropy term hands out exactly
alpha2 per rollout and position (reward conservation), correct rollouts gain and wrong ones
lose, alpha2 = 0 is GRPO, and only entropy ratios matter."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import oracle
import pytest
import torch
from advantage_service import RolloutBatch, compute_batch
from advantage_service.estimators.grpo_s import grpo_s_advantage
from advantage_service.estimators.gtpo import (
    _gtpo,
    _gtpo_compiled,
    gtpo_advantage,
    normalise,
    outcome_rewards,
    split_classes,
)
from advantage_service.estimators.gtpo_statistics import (
    _class_statistics,
    _on,
    _TorchOps,
    request_pools,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from token_batches import flat_batch

SETTINGS = settings(max_examples=60, deadline=None)
# The advantages come from float64 sums and differences scaled by a float32 1 / (std + eps).
TOL = 1e-6


def rollout(reward: float, entropy: list[float]) -> dict[str, Any]:
    return {"reward": reward, "entropy": entropy, "logprobs": [-0.5] * len(entropy)}


def gtpo_flat(groups: list[list[dict[str, Any]]], **params: Any) -> tuple[np.ndarray, np.ndarray]:
    """(shaped rewards, advantages) of the oracle, flat."""
    pairs = [p for g in groups for p in oracle.gtpo_group(g, **params)]
    if not pairs:
        return np.zeros(0), np.zeros(0)
    return np.concatenate([r for r, _ in pairs]), np.concatenate([a for _, a in pairs])


def ours(groups: list[list[dict[str, Any]]], **params: Any) -> Any:
    batch, fields = flat_batch(groups)
    return batch, gtpo_advantage(batch, fields["entropy"], with_reward=True, **params)


PARAMS = [
    {},
    {"alpha1": 0.9, "alpha2": 0.1},
    {"alpha1": 0.5, "alpha2": 2.0, "correct_threshold": 0.5, "epsilon": 0.0},
    {"alpha1": 0.0, "alpha2": 1.0, "correct_threshold": -0.25},
]


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: str(p) or "defaults")
def test_gtpo_matches_the_oracle_on_random_ragged_groups(params: dict[str, Any]) -> None:
    for seed in range(30):
        rng = np.random.default_rng(seed)
        groups = oracle.random_token_groups(rng, group_size=(1, 6), length=(0, 25))
        _batch, result = ours(groups, **params)
        reward, advantage = gtpo_flat(groups, **params)
        np.testing.assert_allclose(result.reward.numpy(), reward, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(result.advantage.numpy(), advantage, rtol=TOL, atol=TOL)
        means = [
            float(np.mean(a)) if a.size else 0.0
            for g in groups
            for _, a in oracle.gtpo_group(g, **params)
        ]
        np.testing.assert_allclose(result.scalars.numpy(), means, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: str(p) or "defaults")
def test_grpo_s_matches_the_oracle_on_random_ragged_groups(params: dict[str, Any]) -> None:
    for seed in range(30):
        rng = np.random.default_rng(100 + seed)
        groups = oracle.random_token_groups(rng, group_size=(1, 8), length=(0, 12))
        batch, fields = flat_batch(groups)
        result = grpo_s_advantage(batch, fields["entropy"], **params)
        expected = [p for g in groups for p in oracle.grpo_s_group(g, **params)]
        np.testing.assert_allclose(result.reward.numpy(), [r for r, _ in expected], rtol=TOL)
        np.testing.assert_allclose(
            result.advantage.numpy(), [a for _, a in expected], rtol=TOL, atol=TOL
        )


@pytest.mark.parametrize("request_scope", [False, True], ids=["scope=group", "scope=request"])
def test_gtpo_compiled_loops_give_the_keyed_path_bits(request_scope: bool) -> None:
    """The compiled CPU loops over rollout slices (per-position sums in batch order, as
    ``index_add_``) give the keyed path's bits, and hand back to it where entropies of 0 need
    equal shares or rewards other than 0/1 need float64; with Eq. 6 over the group or over the
    request."""
    compared = 0
    for seed in range(20):
        rng = np.random.default_rng(seed)
        groups = oracle.random_token_groups(rng, group_size=(2, 6), length=(1, 40))
        for g in groups:
            for r in g:
                r["reward"] = float(r["reward"] > 0.5)
                r["entropy"] = [abs(e) + 0.01 for e in r["entropy"]]
        batch, fields = flat_batch(groups)
        entropy = fields["entropy"]
        args = (1.0, 0.1, 0.0, 1e-6)
        fast = _gtpo_compiled(batch, entropy, *args, request_scope)
        keyed, wide, _ = _gtpo(batch, entropy, torch.float32, *args, False, request_scope)
        if bool(wide.any()):
            assert fast is None
            continue
        assert fast is not None
        assert torch.equal(fast.advantage, keyed.advantage)
        assert torch.equal(fast.scalars, keyed.scalars)
        compared += 1
    assert compared >= 10
    batch, fields = flat_batch([[rollout(1.0, [0.0, 1.0]), rollout(0.0, [0.5])]])
    assert _gtpo_compiled(batch, fields["entropy"], 1.0, 0.1, 0.0, 1e-6) is None
    batch, fields = flat_batch([[rollout(1.0, [1.0, 1.0]), rollout(0.5, [0.5]), rollout(0, [1])]])
    assert _gtpo_compiled(batch, fields["entropy"], 1.0, 0.1, 0.0, 1e-6) is None  # 1 != 0.5


@pytest.mark.parametrize("request_scope", [False, True], ids=["scope=group", "scope=request"])
def test_gtpo_compiled_loops_give_the_keyed_path_bits_in_any_rollout_order(
    request_scope: bool,
) -> None:
    """As above with each group's rollouts scattered over the batch (the group at a time loop
    gathers a group's rollouts, in batch order), empty rollouts, and correct rollouts' entropies
    a trainer rounded just below 0 (taken as 0)."""
    compared = negative = 0
    for seed in range(40):
        rng = np.random.default_rng(1000 + seed)
        groups = oracle.random_token_groups(rng, group_size=(2, 6), length=(1, 40))
        pairs = [(g, r) for g, rs in enumerate(groups) for r in rs]
        pairs = [pairs[i] for i in rng.permutation(len(pairs))]
        entropies = []
        for _, r in pairs:
            r["reward"] = float(r["reward"] > 0.5)
            h = np.abs(np.asarray(r["entropy"], np.float32)) + np.float32(0.01)
            if r["reward"]:  # (a wrong rollout's entropy of 0 is the keyed path's)
                h[rng.random(h.size) < 0.02] = np.float32(-5e-5)
            entropies.append(h)
        negative += sum(int((h < 0).sum()) for h in entropies)
        batch = RolloutBatch.from_flat(
            np.zeros(sum(h.size for h in entropies), dtype=np.int32),
            np.concatenate([[0], np.cumsum([h.size for h in entropies])]).astype(np.int64),
            [f"g{g}" for g in range(len(groups))],
            np.array([g for g, _ in pairs], dtype=np.int64),
            np.array([r["reward"] for _, r in pairs], dtype=np.float32),
        )
        entropy = torch.from_numpy(np.concatenate(entropies))
        args = (1.0, 0.1, 0.0, 1e-6)
        fast = _gtpo_compiled(batch, entropy, *args, request_scope)
        keyed, wide, _ = _gtpo(batch, entropy, torch.float32, *args, False, request_scope)
        if fast is None:
            continue
        assert not bool(wide.any())
        assert torch.equal(fast.advantage, keyed.advantage)
        assert torch.equal(fast.scalars, keyed.scalars)
        compared += 1
    assert compared >= 15 and negative > 0


@pytest.mark.parametrize("request_scope", [False, True], ids=["scope=group", "scope=request"])
def test_the_class_statistics_of_other_devices_agree_with_the_cpu_loop(request_scope: bool) -> None:
    """Eq. 6's statistics in torch (what a batch on a GPU computes: gtpo_statistics's
    ``_class_statistics``), run here on CPU tensors, give the compiled CPU loop's scale, shift
    and wide flags: with rewards other than 0/1, each rollout's sum of y given or not, groups
    without contrast, empty rollouts, a merged batch's requests pooled.

    Bit for bit with a correctly rounded square root (IEEE's, which CUDA's float64 ``sqrt`` is);
    torch's own CPU kernel is not one where it runs on AVX-512 (1 ulp off on about 0.75% of
    inputs), so with it the results agree within one ulp."""

    class CorrectlyRounded(_TorchOps):
        def __init__(self, device: torch.device) -> None:
            super().__init__(device)
            self.sqrt = lambda x: torch.from_numpy(np.sqrt(x.numpy()))

    compared = 0
    for seed in range(20):
        rng = np.random.default_rng(500 + seed)
        groups = oracle.random_token_groups(rng, group_size=(1, 6), length=(0, 30))
        batch, _ = flat_batch(groups)
        if request_scope and batch.num_rollouts > 1:
            half = batch.num_rollouts // 2
            cut = int(batch.group_index[half])  # (a request boundary between groups)
            first = int(torch.searchsorted(batch.group_index, torch.tensor(cut)))
            batch = dataclasses.replace(
                batch, segments=torch.tensor([0, first, batch.num_rollouts])
            )
        classes = split_classes(batch, 0.5)
        b = outcome_rewards(batch, classes, 1.0)
        y2 = torch.from_numpy(rng.gamma(1.0, 1.0, 2 * batch.num_groups))
        pools = request_pools(batch, classes.contrast.numpy()) if request_scope else None
        for rollout_y in (None, torch.from_numpy(rng.normal(size=batch.num_rollouts))):
            cpu = normalise(batch, classes, y2, b, 0.1, 1e-6, rollout_y, pools)
            for ops in (CorrectlyRounded(torch.device("cpu")), _TorchOps(torch.device("cpu"))):
                other = _class_statistics(
                    ops,
                    batch.lengths.double(),
                    (batch.lengths > 0).double(),
                    classes.class_group,
                    classes.contrast,
                    y2,
                    b,
                    0.1,
                    1e-6,
                    rollout_y,
                    None if pools is None else _on(pools, torch.device("cpu")),
                )
                for ours, theirs in zip(cpu, other, strict=True):
                    if isinstance(ops, CorrectlyRounded) or ours.dtype == torch.bool:
                        assert torch.equal(ours, theirs)
                    else:
                        np.testing.assert_array_max_ulp(ours.numpy(), theirs.numpy(), maxulp=1)
            compared += int(bool(cpu.scale.any()))
    assert compared >= 10


def test_gtpo_shaped_rewards_by_hand() -> None:
    """alpha1 = 1, alpha2 = 0.1. Correct: entropies [2, 4, 1] and [3, 1]; wrong: [4, 0.5, 3] and
    [0.5, 4]. t = 0: O+ shares 2/5, 3/5 of d = 2 -> 1 + 0.2 * 0.4 = 1.08, 1.12; O- inverse
    entropies 1/4, 2 (sum 9/4) -> shares 1/9, 8/9 of h = 2 -> -1 - 0.2/9, -1 - 1.6/9.
    t = 1: O+ 4/5, 1/5 -> 1.16, 1.04; O- 1/0.5 = 2, 1/4 -> 8/9, 1/9. t = 2: one rollout of
    each class is left (share 1, d = h = 1): 1.1 and -1.1."""
    groups = [
        [
            rollout(1.0, [2.0, 4.0, 1.0]),
            rollout(1.0, [3.0, 1.0]),
            rollout(0.0, [4.0, 0.5, 3.0]),
            rollout(0.0, [0.5, 4.0]),
        ]
    ]
    _batch, result = ours(groups)
    expected = [1.08, 1.16, 1.1, 1.12, 1.04]
    expected += [-1 - 0.2 / 9, -1 - 1.6 / 9, -1.1, -1 - 1.6 / 9, -1 - 0.2 / 9]
    np.testing.assert_allclose(result.reward.numpy(), expected, rtol=1e-7)


def test_gtpo_normalises_each_class_over_its_own_tokens_by_hand() -> None:
    """Eq. 6 on the group of the test above (eps 0). R~+ = 1.08, 1.16, 1.1, 1.12, 1.04: mean
    1.1 (1 + alpha2: the shares sum to 1 at each position), deviations -0.02, 0.06, 0, 0.02,
    -0.06, sample variance 0.008 / 4, std 0.02 sqrt 5. R~-: deviations from -1.1 of 0.0778,
    -0.0778, 0, -0.0778, 0.0778 (= 0.7/9), std 0.7/9: A- = +-1. The confident tokens of the
    wrong rollouts (entropy 0.5) take A = -1, the hesitant ones (entropy 4) +1."""
    groups = [
        [
            rollout(1.0, [2.0, 4.0, 1.0]),
            rollout(1.0, [3.0, 1.0]),
            rollout(0.0, [4.0, 0.5, 3.0]),
            rollout(0.0, [0.5, 4.0]),
        ]
    ]
    _batch, result = ours(groups, epsilon=0.0)
    root5 = 5**0.5
    expected = [-1 / root5, 3 / root5, 0.0, 1 / root5, -3 / root5, 1.0, -1.0, 0.0, -1.0, 1.0]
    np.testing.assert_allclose(result.advantage.numpy(), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        result.scalars.numpy(), [2 / 3 / root5, -1 / root5, 0.0, 0.0], rtol=1e-5, atol=1e-6
    )


def test_gtpo_one_correct_and_one_wrong_token_get_nothing() -> None:
    """A class of one rollout has all its shaped rewards alike (its share is 1 at every
    position): its standardised advantages are 0 exactly, whatever eps."""
    for epsilon in (0.0, 1e-6):
        _, result = ours([[rollout(1.0, [0.7, 0.2]), rollout(0.0, [1.3])]], epsilon=epsilon)
        assert result.advantage.tolist() == [0.0, 0.0, 0.0]


def test_gtpo_entropies_of_zero_share_as_the_docstring_says() -> None:
    groups = [
        [
            rollout(1.0, [0.0]),
            rollout(1.0, [0.0]),
            rollout(0.0, [0.0]),
            rollout(0.0, [2.0]),
            rollout(0.0, [-1e-5]),  # rounding below 0: an entropy of 0
        ]
    ]
    _batch, result = ours(groups)
    # O+: every entropy 0, equal shares of d = 2: 1 + 0.1 * 2 * 1/2 = 1.1.
    # O-: two entropies of 0 share h = 3, the other gets nothing: -1 - 0.1 * 3 / 2 = -1.15, -1.
    np.testing.assert_allclose(result.reward.numpy(), [1.1, 1.1, -1.15, -1.0, -1.15], rtol=1e-7)
    assert np.all(np.isfinite(result.advantage.numpy()))


def test_gtpo_group_without_contrast_gets_no_advantage() -> None:
    groups = [
        [rollout(1.0, [1.0, 2.0]), rollout(1.0, [3.0])],  # all correct
        [rollout(0.0, [0.5]), rollout(0.0, [2.5, 1.0])],  # all wrong
        [rollout(1.0, [1.0, 2.0, 0.5])],  # a group of one
        [rollout(1.0, [1.0]), rollout(0.0, [])],  # contrast, the wrong rollout empty
    ]
    _, result = ours(groups)
    assert result.advantage[:8].tolist() == [0.0] * 8
    assert result.scalars[:5].tolist() == [0.0] * 5
    # The last group: its only token is the whole pool of R~+: (x - x) / eps.
    assert result.advantage[8].abs() < 1e-6
    assert result.scalars[6] == 0.0  # an empty rollout's mean advantage


def test_grpo_s_by_hand_and_its_empty_rollouts() -> None:
    """Mean entropies 1 and 3 (correct), 0.5 and 2 (wrong), an empty wrong rollout. O+: shares
    1/4, 3/4 of n+ = 2 -> 1.05, 1.15. O-: inverse means 2, 0.5 (sum 2.5) -> 0.8, 0.2 of n- = 2
    -> -1.16, -1.04; the empty rollout takes no share: -1."""
    groups = [
        [
            rollout(1.0, [0.5, 1.5]),
            rollout(1.0, [3.0]),
            rollout(0.0, [0.25, 0.75]),
            rollout(0.0, [2.0]),
            rollout(0.0, []),
        ]
    ]
    batch, fields = flat_batch(groups)
    result = grpo_s_advantage(batch, fields["entropy"])
    np.testing.assert_allclose(result.reward.numpy(), [1.05, 1.15, -1.16, -1.04, -1.0])
    expected = [a for _, a in oracle.grpo_s_group(groups[0])]
    np.testing.assert_allclose(result.advantage.numpy(), expected, rtol=1e-12)
    assert result.advantage[0] < result.advantage[1] and result.advantage[2] < result.advantage[3]


# ---- properties ---------------------------------------------------------------------------------


@st.composite
def entropy_groups(draw, binary: bool = True, min_size: int = 1) -> list[list[dict[str, Any]]]:
    """1-3 groups of ``min_size``-6 rollouts, 0-8 tokens each, entropies on a 1/4 grid (ties,
    zeros), 0/1 rewards (or any in [-1, 2])."""
    groups = []
    for _ in range(draw(st.integers(1, 3))):
        group = []
        for _ in range(draw(st.integers(min_size, 6))):
            n = draw(st.integers(0, 8))
            entropy = draw(st.lists(st.integers(0, 16), min_size=n, max_size=n))
            reward = (
                draw(st.sampled_from([0.0, 1.0])) if binary else draw(st.floats(-1, 2, width=16))
            )
            group.append(rollout(float(reward), [h / 4 for h in entropy]))
        groups.append(group)
    return groups


def positions(batch: RolloutBatch) -> list[tuple[int, int, int]]:
    """(flat index, rollout, position) of every token."""
    offsets = batch.offsets.tolist()
    return [
        (offsets[i] + t, i, t)
        for i in range(batch.num_rollouts)
        for t in range(offsets[i + 1] - offsets[i])
    ]


@SETTINGS
@given(entropy_groups(), st.floats(0.0, 1.0))
def test_gtpo_conserves_the_reward_at_every_position(groups, alpha2) -> None:
    """alpha1 + alpha2 = 1 and 0/1 rewards: the shaped rewards of the correct rollouts at a
    position sum to d_t = their rewards' sum, and the wrong ones' to -h_t (the paper's reward
    conservation: entropy only moves reward between tokens of one position)."""
    batch, result = ours(groups, alpha1=1.0 - alpha2, alpha2=alpha2)
    shaped = result.reward.numpy()
    group = batch.group_index.tolist()
    correct = (batch.rewards > 0).tolist()
    sums: dict[tuple[int, bool, int], list[float]] = {}
    for p, i, t in positions(batch):
        sums.setdefault((group[i], correct[i], t), []).append(shaped[p])
    for (_, is_correct, _), values in sums.items():
        assert sum(values) == pytest.approx((1 if is_correct else -1) * len(values), abs=1e-5)


def class_pools(
    batch: RolloutBatch, values: np.ndarray
) -> dict[tuple[int, bool], list[tuple[int, float]]]:
    """(group, correct) -> [(flat index, value)] of the groups with rollouts (maybe empty) in
    both classes."""
    group = batch.group_index.tolist()
    correct = (batch.rewards > 0).tolist()
    classes = set(zip(group, correct, strict=True))
    pools: dict[tuple[int, bool], list[tuple[int, float]]] = {}
    for p, i, _ in positions(batch):
        pools.setdefault((group[i], correct[i]), []).append((p, float(values[p])))
    return {k: v for k, v in pools.items() if (k[0], not k[1]) in classes}


@SETTINGS
@given(entropy_groups(binary=False), st.floats(0.0, 3.0), st.floats(0.0, 3.0))
def test_gtpo_standardises_each_class_over_its_own_tokens(groups, alpha1, alpha2) -> None:
    """Eq. 6: in a group with tokens in both classes, a class's advantages are its shaped
    rewards standardised over its own tokens: they keep the rewards' order, sum to 0, and have
    the sample std std / (std + eps)."""
    batch, result = ours(groups, alpha1=alpha1, alpha2=alpha2)
    shaped = result.reward.numpy()
    a = result.advantage.numpy()
    for members in class_pools(batch, shaped).values():
        x = np.array([v for _, v in members])
        y = np.array([a[p] for p, _ in members])
        assert abs(y.sum()) <= 1e-4 * len(y)
        for i in range(len(x)):
            for j in range(len(x)):
                if x[i] < x[j] - 1e-9:
                    assert y[i] <= y[j] + 1e-6
        sd = x.std(ddof=1) if len(x) > 1 else 0.0
        if sd > 1e-3 * float(np.abs(x).max()) and sd > 1e-9:
            # (float32 shaped rewards: the std's relative error grows with max|x| / sd, up to
            # 1000 here: a draw with sd 7.6e-3 was off by 1.06e-4)
            rel = max(1e-4, 2e-6 * float(np.abs(x).max()) / sd)
            assert y.std(ddof=1) == pytest.approx(sd / (sd + 1e-6), rel=rel)


@SETTINGS
@given(entropy_groups(binary=False), st.floats(0.1, 3.0))
def test_gtpo_without_the_entropy_term_standardises_rewards_per_class(groups, alpha1) -> None:
    """alpha2 = 0: every token of a correct rollout gets (alpha1 r_i - mean) / (std + eps),
    mean and sample std over the correct rollouts' tokens of its group (the wrong ones' shaped
    rewards are all -alpha1: 0); 0 in a group without contrast, so 0 everywhere with 0/1
    rewards (the outcome term is one value per class)."""
    batch, result = ours(groups, alpha1=alpha1, alpha2=0.0)
    r = batch.rewards.double().numpy()
    base = np.zeros(batch.num_tokens)
    for p, i, _ in positions(batch):
        base[p] = alpha1 * r[i] if r[i] > 0 else -alpha1
    a = result.advantage.numpy()
    seen = set()
    for members in class_pools(batch, base).values():
        x = np.array([v for _, v in members])
        sd = x.std(ddof=1) if len(x) > 1 else 0.0
        for p, v in members:
            seen.add(p)
            expected = 0.0 if sd == 0 else (v - x.mean()) / (sd + 1e-6)
            assert a[p] == pytest.approx(expected, rel=1e-6, abs=1e-6)
    assert all(a[p] == 0.0 for p in range(len(a)) if p not in seen)
    if set(r.tolist()) <= {0.0, 1.0}:
        assert not a.any()


@SETTINGS
@given(entropy_groups(min_size=2))
def test_grpo_s_without_the_entropy_term_is_grpo(groups) -> None:
    batch, _ = flat_batch(groups)
    batch.entropy = torch.tensor([h for g in groups for r in g for h in r["entropy"]])
    grpo_s = compute_batch(batch, {"outcome": {"name": "grpo_s", "alpha2": 0.0}})
    grpo = compute_batch(batch, "grpo")
    torch.testing.assert_close(grpo_s.scalars, grpo.scalars, rtol=1e-6, atol=1e-6)


@SETTINGS
@given(entropy_groups(binary=False), st.sampled_from([0.125, 0.5, 2.0, 8.0]))
def test_gtpo_and_grpo_s_read_only_entropy_ratios(groups, factor) -> None:
    """Scaling every entropy (by a power of 2: exactly) changes no advantage."""
    scaled = [
        [rollout(r["reward"], [h * factor for h in r["entropy"]]) for r in group]
        for group in groups
    ]
    _, a = ours(groups)
    _, b = ours(scaled)
    torch.testing.assert_close(a.advantage, b.advantage, rtol=1e-9, atol=1e-9)
    batch, fields = flat_batch(groups)
    batch2, fields2 = flat_batch(scaled)
    torch.testing.assert_close(
        grpo_s_advantage(batch, fields["entropy"]).advantage,
        grpo_s_advantage(batch2, fields2["entropy"]).advantage,
        rtol=1e-9,
        atol=1e-9,
    )


@SETTINGS
@given(entropy_groups(binary=False))
def test_gtpo_credits_entropy_in_correct_rollouts_and_blames_confidence_in_wrong_ones(groups):
    """At one position of one group: among correct rollouts, the higher the entropy the higher
    the shaped reward; among wrong ones, the lower the entropy the lower (more blame)."""
    batch, result = ours(groups)
    shaped = result.reward.numpy()
    h = torch.tensor([max(0.0, x) for g in groups for r in g for x in r["entropy"]]).numpy()
    group = batch.group_index.tolist()
    correct = (batch.rewards > 0).tolist()
    rewards = batch.rewards.tolist()
    seen: dict[tuple[int, bool, int], list[tuple[float, float, float]]] = {}
    for p, i, t in positions(batch):
        seen.setdefault((group[i], correct[i], t), []).append((h[p], shaped[p], rewards[i]))
    for (_, is_correct, _), tokens in seen.items():
        for h1, s1, r1 in tokens:
            for h2, s2, r2 in tokens:
                if h1 > h2 and (not is_correct or r1 == r2):
                    assert s1 >= s2 - 1e-6
