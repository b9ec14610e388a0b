"""The verl integration on real verl 0.9.1 ``DataProto`` batches, through verl's own
``compute_advantage``: equal to verl's estimators for the outcome baselines, and to the oracle
for every preset (token-level ones through the patched ``compute_advantage``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from advantage_client.integrations import verl as adv_verl
from oracle import PRESETS
from padded_batches import ATOL, RTOL, PaddedCase, padded_case

pytest.importorskip("verl.trainer.ppo.ray_trainer")
from verl import DataProto
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import ray_trainer

# Ours -> verl's own, with compute_advantage's norm_adv_by_std_in_grpo.
VERL_EQUIVALENTS = {
    "adv_grpo": ("grpo_vectorized", True),
    "adv_dr_grpo": ("grpo", False),
    "adv_rloo": ("rloo_vectorized", True),
    "adv_opo": ("opo", True),
    "adv_gpg": ("gpg", True),
    "adv_reinforce_pp_baseline": ("reinforce_plus_plus_baseline", True),
    "adv_grpo_passk": ("grpo_passk", True),
}


@pytest.fixture(autouse=True)
def patched() -> Iterator[None]:
    adv_verl.register()
    assert "verl.trainer.ppo.ray_trainer" in adv_verl.patch()
    yield
    adv_verl.unpatch()


def data_proto(case: PaddedCase) -> DataProto:
    """A DataProto as verl's trainer holds it: the reward on each response's last token."""
    mask = torch.from_numpy(case.mask)
    b, t = case.mask.shape
    rewards = torch.zeros(b, t)
    last = torch.where(mask.any(1), (mask * torch.arange(t)).argmax(1), torch.zeros(b).long())
    rewards[torch.arange(b), last] = torch.from_numpy(case.rewards).float()
    tensors: dict[str, torch.Tensor] = {
        "responses": torch.from_numpy(case.tokens),
        "response_mask": mask.long(),
        "token_level_rewards": rewards,
    }
    if case.logprobs is not None:
        tensors["old_log_probs"] = torch.from_numpy(case.logprobs).float()
    for name, values in case.teacher_logprobs.items():
        tensors[f"teacher_log_probs.{name}"] = torch.from_numpy(values).float()
    uids = np.array([str(g) for g in case.group_ids], dtype=object)
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": uids})


def advantages(data: DataProto, estimator: str, norm: bool = True) -> torch.Tensor:
    out = ray_trainer.compute_advantage(
        data, adv_estimator=estimator, norm_adv_by_std_in_grpo=norm, config=AlgoConfig()
    )
    assert torch.equal(out.batch["returns"], out.batch["advantages"]) or estimator in (
        "reinforce_plus_plus_baseline",
    )
    return out.batch["advantages"]


@pytest.mark.parametrize("ours", sorted(VERL_EQUIVALENTS))
@pytest.mark.parametrize("layout", ["right", "holes"])
def test_outcome_estimators_equal_verls_own(ours: str, layout: str) -> None:
    theirs, norm = VERL_EQUIVALENTS[ours]
    case = padded_case(
        31, "grpo", layout=layout, ids="uuid", n_groups=(4, 6), group_size=(2, 6), empty_prob=0
    )
    expected = advantages(data_proto(case), theirs, norm)
    got = advantages(data_proto(case), ours)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_equals_the_oracle_through_compute_advantage(preset: str) -> None:
    case = padded_case(32, preset, layout="mixed", ids="str", n_groups=(3, 5))
    got = advantages(data_proto(case), f"adv_{preset}")
    assert np.all(got.numpy()[~case.mask] == 0.0)
    np.testing.assert_allclose(got.numpy(), case.advantages, rtol=RTOL, atol=ATOL, err_msg=preset)


def test_a_token_level_estimator_without_patch_says_to_patch() -> None:
    adv_verl.unpatch()
    case = padded_case(33, "ktae")
    with pytest.raises(ValueError, match="patch"):
        advantages(data_proto(case), "adv_ktae")
    # an outcome estimator needs nothing patch() adds
    advantages(data_proto(case), "adv_grpo")


def test_named_estimator_objects_and_verls_own_estimators_untouched() -> None:
    adv_verl.register(presets={"my_rloo_ktae": {"outcome": "rloo", "ktae": {"scale": 0.5}}})
    case = padded_case(34, {"outcome": "rloo", "ktae": {"scale": 0.5}}, ids="int")
    got = advantages(data_proto(case), "adv_my_rloo_ktae")
    np.testing.assert_allclose(got.numpy(), case.advantages, rtol=RTOL, atol=ATOL)
    # grpo still takes verl's own branch of compute_advantage
    plain = padded_case(35, "grpo")
    np.testing.assert_allclose(
        advantages(data_proto(plain), "grpo").numpy(), plain.advantages, rtol=RTOL, atol=ATOL
    )


@pytest.mark.integration
@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_over_the_service(service: Any, transport: str) -> None:
    url = service.url if transport == "http" else service.target
    adv_verl.register(transport, url, presets=["ktae", "grpo"], ignore_token_ids=[1])
    before = service.requests(transport=transport)
    case = padded_case(36, "ktae", ignore_token_ids=[1])
    got = advantages(data_proto(case), "adv_ktae")
    np.testing.assert_allclose(got.numpy(), case.advantages, rtol=RTOL, atol=ATOL)
    assert service.requests(transport=transport) == before + 1
