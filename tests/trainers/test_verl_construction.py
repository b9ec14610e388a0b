"""The verl integration fails when the trainer is built, not at the first advantage step after
model load and rollout: an ``adv_*`` name that is not registered, on verl 0.9.1's real legacy
(``RayPPOTrainer``) and v1 (``PPOTrainerSync``) constructors with verl's own default config;
``ADVANTAGE_VERL_OPTIONS``' estimators registered beside every preset; and the error of a batch
without response token ids naming its real cause."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from advantage_client.integrations import verl as adv_verl
from padded_batches import padded_case

pytest.importorskip("verl.trainer.ppo.ray_trainer")
import verl
from omegaconf import OmegaConf
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import core_algos, ray_trainer
from verl.trainer.ppo.utils import Role

CONFIG = Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml"


@pytest.fixture(autouse=True)
def clean() -> Iterator[None]:
    yield
    adv_verl.unpatch()
    for name in list(adv_verl.REGISTERED):
        core_algos.ADV_ESTIMATOR_REGISTRY.pop(name, None)
        del adv_verl.REGISTERED[name]


def verl_config(estimator: str, **trainer: Any) -> Any:
    """verl's own default PPO config (the generated YAML every launch starts from)."""
    config = OmegaConf.load(CONFIG)
    config.algorithm.adv_estimator = estimator
    for key, value in trainer.items():
        config.trainer[key] = value
    return config


def legacy_trainer(config: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    # Stand-in for the dataset loading alone (it reads config.data.train_files): the
    # constructor is verl's own.
    monkeypatch.setattr(ray_trainer.RayPPOTrainer, "_create_dataloader", lambda *a, **k: None)
    return ray_trainer.RayPPOTrainer(
        config,
        tokenizer=None,
        role_worker_mapping={Role.ActorRollout: object},
        resource_pool_manager=None,
        device_name="cpu",
    )


def test_an_unregistered_adv_name_fails_when_the_legacy_trainer_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    adv_verl.register(presets=["grpo", "ktae"])
    adv_verl.patch()
    with pytest.raises(adv_verl.VerlConfigError) as info:
        legacy_trainer(verl_config("adv_ktea"), monkeypatch)
    message = str(info.value)
    assert "algorithm.adv_estimator='adv_ktea' is not registered" in message
    # (the list names every adv_* registered in this process: other tests register more)
    assert "'adv_grpo'" in message and "'adv_ktae'" in message
    # a registered name, and verl's own, build
    assert legacy_trainer(verl_config("adv_ktae"), monkeypatch).config.algorithm.adv_estimator
    assert legacy_trainer(verl_config("grpo"), monkeypatch).use_critic is False


def test_with_nothing_registered_the_error_names_the_setup_hook(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    adv_verl.patch()
    with pytest.raises(adv_verl.VerlConfigError, match="worker_process_setup_hook"):
        legacy_trainer(verl_config("adv_grpo"), monkeypatch)


def test_an_unregistered_adv_name_fails_when_the_v1_trainer_is_built() -> None:
    pytest.importorskip("verl.trainer.ppo.v1.trainer_sync")
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    adv_verl.register(presets=["grpo"])
    adv_verl.patch()
    with pytest.raises(adv_verl.VerlConfigError, match="'adv_rloo' is not registered"):
        PPOTrainerSync(verl_config("adv_rloo", use_v1=True))
    assert PPOTrainerSync(verl_config("adv_grpo", use_v1=True)).use_critic is False


def test_options_with_estimators_keep_every_preset() -> None:
    mine = {"outcome": "rloo", "ktae": {"scale": 0.5}}
    env = adv_verl.runtime_env("inprocess", estimators={"mine": mine}, namespace="n")
    settings = adv_verl.settings_from_env(env["env_vars"])
    made = adv_verl.register(
        settings.pop("transport"), settings.pop("url"), settings.pop("presets"), **settings
    )
    from advantage_contract.backend import inprocess

    presets = {f"adv_{name}" for name in inprocess().list_estimators()["presets"]}
    assert set(made) == presets | {"adv_mine"} and len(presets) > 5
    assert made["adv_mine"].full["outcome"]["name"] == "rloo"
    assert made["adv_mine"].namespace == "n"
    # named presets: those and the objects, as before
    env = adv_verl.runtime_env("inprocess", presets=["grpo"], estimators={"mine": mine})
    settings = adv_verl.settings_from_env(env["env_vars"])
    assert settings["presets"] == {"grpo": "grpo", "mine": mine}


def test_the_missing_responses_error_names_the_real_cause() -> None:
    import numpy as np
    import torch
    from verl import DataProto

    adv_verl.register(presets=["ktae"])
    case = padded_case(61, "ktae")
    mask = torch.from_numpy(case.mask).long()
    rewards = torch.zeros(mask.shape)
    rewards[:, 0] = torch.from_numpy(case.rewards).float()
    uids = np.array([str(g) for g in case.group_ids], dtype=object)

    def step() -> None:
        data = DataProto.from_dict(
            tensors={"response_mask": mask, "token_level_rewards": rewards},
            non_tensors={"uid": uids},
        )
        ray_trainer.compute_advantage(data, adv_estimator="adv_ktae", config=AlgoConfig())

    with pytest.raises(adv_verl.VerlConfigError) as before:
        step()
    assert "patch() has not run in this process" in str(before.value)
    adv_verl.patch()
    with pytest.raises(adv_verl.VerlConfigError) as after:
        step()
    message = str(after.value)
    assert "has no data.batch['responses']" in message and "patch() ran" in message
    assert "has not run" not in message
