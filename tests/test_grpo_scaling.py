"""GRPO's scaling parameters (``mean_scope``, ``std_scope``, ``leave_one_out``, ``std_unbiased``,
``std_center``): against the slow oracle (tests/scaling_oracle.py) on every combination, with
requests merged, against AReaL 1.0.4's own ``Normalization`` (a verbatim copy,
tests/areal_normalization.py, checked against the module where ``areal`` imports) and against
TRL 1.16's ``scale_rewards`` group / batch / none."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import scaling_oracle
import torch
from advantage_service import compute
from advantage_service.batch import RolloutBatch
from advantage_service.errors import RequestError
from advantage_service.estimators import OUTCOMES
from advantage_service.wire.request import parse_request
from areal_normalization import Normalization, NormConfig

SCOPES = ("group", "request", "none")
COMBOS = [
    {
        "mean_scope": mean,
        "std_scope": std,
        "leave_one_out": loo,
        "std_unbiased": unbiased,
        "std_center": center,
    }
    for mean, std, loo, unbiased, center in itertools.product(
        SCOPES, SCOPES, (False, True), (True, False), ("mean", "baseline")
    )
]


def combo_id(params: dict[str, Any]) -> str:
    return "-".join(str(v) for v in params.values())


def batch_of(rewards: np.ndarray, group_index: np.ndarray, length: int = 1) -> RolloutBatch:
    """``length`` tokens per rollout: only the rewards and groups matter to an outcome."""
    count = int(group_index.max()) + 1
    return RolloutBatch.from_flat(
        tokens=np.zeros(rewards.size * length, dtype=np.int64),
        offsets=np.arange(rewards.size + 1) * length,
        group_ids=[f"g{g}" for g in range(count)],
        group_index=group_index,
        rewards=rewards.astype(np.float32),
    )


def random_groups(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """float32-exact rewards (ties and groups of one included) and their group of each rollout."""
    sizes = rng.integers(1, 6, size=int(rng.integers(1, 6)))
    group_index = np.repeat(np.arange(sizes.size), sizes)
    rewards = rng.choice([0.0, 1.0, 0.5, -2.0, 3.25], size=group_index.size)
    rewards = np.where(rng.random(group_index.size) < 0.5, rewards, rng.normal(size=rewards.size))
    return rewards.astype(np.float32).astype(np.float64), group_index


def grpo(batch: RolloutBatch, params: dict[str, Any]) -> np.ndarray:
    spec = parse_request(
        {
            "estimator": {"outcome": {"name": "grpo", **params}},
            "groups": [{"id": "a", "rollouts": [{"tokens": [1], "reward": 0.0}]}],
        }
    ).estimator
    return OUTCOMES["grpo"].fn(batch, spec.outcome_params).numpy()


@pytest.mark.parametrize("params", COMBOS, ids=combo_id)
def test_every_scaling_combination_matches_the_oracle(params: dict[str, Any]) -> None:
    for seed in range(4):
        rng = np.random.default_rng(seed)
        rewards, group_index = random_groups(rng)
        for epsilon in (0.0, 1e-5):
            full = {**params, "epsilon": epsilon}
            want = scaling_oracle.grpo_scaled(rewards.tolist(), group_index.tolist(), None, full)
            got = grpo(batch_of(rewards, group_index), full)
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_the_defaults_are_grpo_unchanged() -> None:
    """Default parameters: (r - mean_g) / (std_g + 1e-6), std_g the sample std."""
    rewards = np.array([1.0, 0.0, 0.0, 3.0, 5.0, 2.0])
    group_index = np.array([0, 0, 0, 1, 1, 2])
    got = grpo(batch_of(rewards, group_index), {})
    g0 = (rewards[:3] - rewards[:3].mean()) / (rewards[:3].std(ddof=1) + 1e-6)
    g1 = (rewards[3:5] - 4.0) / (np.std([3.0, 5.0], ddof=1) + 1e-6)
    np.testing.assert_allclose(got, [*g0, *g1, 2.0 / (1 + 1e-6)], rtol=1e-12)


@pytest.mark.parametrize(
    "params", [c for c in COMBOS if "request" in (c["mean_scope"], c["std_scope"])], ids=combo_id
)
def test_merged_requests_each_keep_their_own_scaling(params: dict[str, Any]) -> None:
    rng = np.random.default_rng(7)
    parts = [random_groups(rng) for _ in range(3)]
    alone = [batch_of(r, g) for r, g in parts]
    merged = RolloutBatch.concat(alone)
    whole = grpo(merged, params)
    assert np.array_equal(whole, np.concatenate([grpo(b, params) for b in alone]))
    # ... and the oracle, told which request each rollout came from, agrees
    requests = np.concatenate([np.full(r.size, k) for k, (r, _) in enumerate(parts)])
    offsets = np.cumsum([0] + [int(g.max()) + 1 for _, g in parts])
    groups = np.concatenate([g + offsets[k] for k, (_, g) in enumerate(parts)])
    rewards = np.concatenate([r for r, _ in parts])
    want = scaling_oracle.grpo_scaled(rewards.tolist(), groups.tolist(), requests.tolist(), params)
    np.testing.assert_allclose(whole, want, rtol=1e-12, atol=1e-12)


# ---- AReaL 1.0.4's NormConfig -------------------------------------------------------------------

AREAL_LEVELS = {"batch": "request", "group": "group", None: "none"}


def areal_params(config: NormConfig) -> dict[str, Any]:
    """The grpo parameters an AReaL ``NormConfig`` maps onto (its std about its own baseline)."""
    return {
        "mean_scope": AREAL_LEVELS[config.mean_level],
        "std_scope": AREAL_LEVELS[config.std_level],
        "leave_one_out": config.mean_leave1out,
        "std_unbiased": config.std_unbiased,
        "std_center": "baseline",
        "epsilon": config.eps,
    }


AREAL_CONFIGS = [
    NormConfig(mean, loo, std, unbiased)
    for mean, std, loo, unbiased in itertools.product(
        ("batch", "group", None), ("batch", "group", None), (False, True), (True, False)
    )
]


@pytest.mark.parametrize(
    "config",
    AREAL_CONFIGS,
    ids=lambda c: f"{c.mean_level}-{c.std_level}-loo{c.mean_leave1out}-ub{c.std_unbiased}",
)
def test_areal_reward_norm_is_areals_own_normalization(config: NormConfig) -> None:
    """AReaL's ``PPOActor._compute_advantages`` normalises the (B,) rewards with
    ``reward_norm`` before GAE; with no critic and no KL (gamma = lambda = 1) every token of a
    rollout then has its normalised reward: the outcome's a_i broadcast."""
    for seed in range(5):
        rng = np.random.default_rng(seed)
        size = int(rng.integers(2, 7))  # AReaL's groups: group_size consecutive rows
        groups = int(rng.integers(1, 6))
        rewards = rng.choice([0.0, 1.0, 0.25, -1.0], size=groups * size)
        rewards[:size] = rewards[0]  # a group of equal rewards
        rewards = np.where(rng.random(rewards.size) < 0.5, rewards, rng.normal(size=rewards.size))
        x = torch.as_tensor(rewards, dtype=torch.float32)
        config.group_size = size
        theirs = Normalization(config)(x).numpy()  # float32
        group_index = np.repeat(np.arange(groups), size)
        ours = grpo(batch_of(x.numpy().astype(np.float64), group_index), areal_params(config))
        scale = max(1.0, float(np.abs(ours).max()))
        # (the same float64 arithmetic; AReaL rounds its answer to float32)
        np.testing.assert_allclose(ours.astype(np.float32), theirs, rtol=1e-6, atol=1e-6 * scale)


def test_the_areal_copy_is_areals_own_code() -> None:
    """The copy in tests/areal_normalization.py against ``areal.utils.data.Normalization``, where
    ``areal`` 1.0.4 and what its module imports are on the path (a scratch environment)."""
    data = pytest.importorskip("areal.utils.data")
    cli_args = pytest.importorskip("areal.api.cli_args")
    rng = np.random.default_rng(0)
    for config in AREAL_CONFIGS:
        for size in (1, 3):
            config.group_size = size
            theirs_config = cli_args.NormConfig(
                mean_level=config.mean_level,
                mean_leave1out=config.mean_leave1out,
                std_level=config.std_level,
                std_unbiased=config.std_unbiased,
                eps=config.eps,
                group_size=size,
            )
            for shape in ((size * 4,), (size * 4, 7)):
                x = torch.as_tensor(rng.normal(size=shape), dtype=torch.float32)
                mask = torch.as_tensor(rng.random(shape) < 0.7) if len(shape) == 2 else None
                ours = Normalization(config)(x, mask)
                theirs = data.Normalization(theirs_config)(x, mask)
                assert torch.equal(ours, theirs)


# ---- TRL 1.16's scale_rewards -------------------------------------------------------------------


def trl_scaled(rewards: torch.Tensor, num_generations: int, scale_rewards: str) -> torch.Tensor:
    """TRL 1.16's ``GRPOTrainer._generate_and_score_completions``, ``sum_then_normalize`` branch
    (trl/trainer/grpo_trainer.py, lines 2761-2790), on the gathered rewards of one reward
    function: each group's NaN-aware mean, the std of the group (``group``; also computed for
    ``none``, for logging only) or of the batch (``batch``), ``+ 1e-4``."""
    from trl.trainer.utils import nanstd

    mean = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    mean = mean.repeat_interleave(num_generations, dim=0)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:
        std = nanstd(rewards.view(-1, num_generations), dim=1)
        std = std.repeat_interleave(num_generations, dim=0)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    return advantages


TRL_SCALING = {"group": {}, "batch": {"std_scope": "request"}, "none": {"std_scope": "none"}}


@pytest.mark.parametrize("scale_rewards", list(TRL_SCALING))
def test_trl_scale_rewards_is_trls_own_formula(scale_rewards: str) -> None:
    pytest.importorskip("trl")
    for seed in range(6):
        rng = np.random.default_rng(seed)
        generations = int(rng.integers(3, 9))
        groups = int(rng.integers(1, 6))
        rewards = rng.normal(size=groups * generations)
        rewards[:generations] = 1.0  # a group of equal rewards
        for g in range(groups):  # one unscored row (NaN) in some groups
            if rng.random() < 0.4:
                rewards[g * generations + int(rng.integers(generations))] = np.nan
        rewards = rewards.astype(np.float32).astype(np.float64)
        trl = trl_scaled(torch.as_tensor(rewards), generations, scale_rewards).numpy()
        # The TRL integration sends the scored rows only.
        kept = ~np.isnan(rewards)
        group_index = np.arange(rewards.size)[kept] // generations
        params = {**TRL_SCALING[scale_rewards], "epsilon": 1e-4}
        ours = grpo(batch_of(rewards[kept], group_index), params)
        # (TRL's nanstd takes Bessel's factor as a float32 quotient: relative error 6e-8)
        np.testing.assert_allclose(ours, trl[kept], rtol=2e-7, atol=1e-12)


# ---- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("outcome", "field"),
    [
        ({"name": "grpo", "mean_scope": "batch"}, "estimator.outcome.mean_scope"),
        ({"name": "grpo", "std_center": "zero"}, "estimator.outcome.std_center"),
        ({"name": "grpo", "leave_one_out": 1}, "estimator.outcome.leave_one_out"),
        ({"name": "grpo", "zero_signal": "drop"}, "estimator.outcome.zero_signal"),
        ({"name": "rloo", "mean_scope": "group"}, "estimator.outcome.mean_scope"),
    ],
)
def test_a_scaling_value_grpo_does_not_know_is_refused(outcome: dict[str, Any], field: str) -> None:
    body = {
        "estimator": {"outcome": outcome},
        "groups": [{"id": "a", "rollouts": [{"tokens": [1], "reward": r} for r in (0.0, 1.0)]}],
    }
    with pytest.raises(RequestError) as info:
        parse_request(body)
    assert info.value.field == field


def test_request_mean_gives_a_group_of_equal_rewards_credit_by_its_distance_to_the_request() -> (
    None
):
    """AReaL's default NormConfig (batch mean, batch std): a group whose rollouts all scored 1
    is credited when the rest of the batch scored less."""
    response = compute(
        {
            "estimator": {
                "outcome": {
                    "name": "grpo",
                    "mean_scope": "request",
                    "std_scope": "request",
                    "std_center": "baseline",
                    "epsilon": 1e-5,
                }
            },
            "groups": [
                {"id": "easy", "rollouts": [{"tokens": [1, 2], "reward": 1.0}] * 2},
                {"id": "hard", "rollouts": [{"tokens": [3], "reward": r} for r in (0.0, 1.0)]},
            ],
        }
    )
    std = np.std([1.0, 1.0, 0.0, 1.0], ddof=1)
    easy = response["groups"][0]["rollouts"][0]["advantages"]
    np.testing.assert_allclose(easy, [0.25 / (std + 1e-5)] * 2, rtol=1e-6)
    assert response["summary"]["zero_signal_groups"] == 1


# ---- a request-scoped request is never split ----------------------------------------------------


def test_a_request_scoped_request_past_the_limits_is_refused_whole() -> None:
    """The scheduler merges requests (each keeps its own statistics) and never splits one: a
    request whose scaling spans the request and exceeds ADV_MAX_REQUEST_TOKENS is a 413 for the
    whole of it, nothing computed for any part."""
    import asyncio

    from advantage_service import LimitExceeded
    from advantage_service.config import Settings
    from advantage_service.observability.metrics import Metrics
    from advantage_service.serving.engine import Engine

    body = {
        "estimator": {"outcome": {"name": "grpo", "mean_scope": "request", "std_scope": "request"}},
        "groups": [
            {
                "id": f"g{g}",
                "rollouts": [{"tokens": [1, 2, 3], "reward": float(i)} for i in range(2)],
            }
            for g in range(4)
        ],
    }
    computed: list[Any] = []

    async def keep(done: Any) -> None:
        computed.append(done)

    engine = Engine(Settings(device="cpu", max_request_tokens=23), Metrics(process=False))
    engine.add_computed_hook(keep)
    with pytest.raises(LimitExceeded) as info:
        asyncio.run(engine.compute(parse_request(body), "t"))
    assert (info.value.status, info.value.field) == (413, "tokens")
    assert "24 tokens" in str(info.value) and computed == []
    # at the limit, it is computed whole: each group's mean, the std of all eight rewards
    engine = Engine(Settings(device="cpu", max_request_tokens=24), Metrics(process=False))
    engine.add_computed_hook(keep)
    asyncio.run(engine.compute(parse_request(body), "t"))
    assert len(computed) == 1 and computed[0].request.batch.num_rollouts == 8
