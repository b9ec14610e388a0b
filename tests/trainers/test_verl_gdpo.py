"""The verl integration's ``adv_gdpo`` on real verl 0.9.1 ``DataProto`` batches, through verl's
own ``compute_advantage``: equal to verl's own ``gdpo`` on the same batch and config (2 and 3
reward keys, weights, groups of one, equal rewards, rows in any order), its settings checked,
and the v1 trainer's fetch bringing the reward keys."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from advantage_client.integrations import verl as adv_verl

pytest.importorskip("verl.trainer.ppo.ray_trainer")
from verl import DataProto
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import ray_trainer

KEYS = ["format_reward", "accuracy_reward", "length_reward"]


@pytest.fixture(autouse=True)
def patched() -> Iterator[None]:
    adv_verl.register(presets=["gdpo", "grpo"])
    adv_verl.patch()
    yield
    adv_verl.unpatch()


def gdpo_batch(seed: int, keys: int) -> DataProto:
    """A batch as verl's legacy trainer holds it at the advantage step: prompts, responses
    (right-padded), the score on each response's last token, and each reward key's values in
    ``non_tensor_batch`` (as the reward manager writes compute_score's dict); rows of a group
    interleaved, a group of one, a group whose first key is all equal."""
    rng = np.random.default_rng(seed)
    sizes = [1, 4] + [int(s) for s in rng.integers(2, 6, int(rng.integers(1, 4)))]
    uids = np.array([f"u{g}" for g, n in enumerate(sizes) for _ in range(n)], dtype=object)
    b = uids.size
    order = rng.permutation(b)
    uids = uids[order]
    prompt, width = 4, 9
    lengths = rng.integers(1, width + 1, b)
    response_mask = (np.arange(width)[None, :] < lengths[:, None]).astype(np.int64)
    values = {
        "format_reward": rng.integers(0, 2, b).astype(float),
        "accuracy_reward": rng.choice([0.0, 0.5, 1.0], b),
        "length_reward": rng.normal(size=b) * 10,
    }
    values["format_reward"][uids == "u1"] = 1.0
    score = sum(values[k] for k in KEYS[:keys])
    rewards = np.zeros((b, width), dtype=np.float32)
    rewards[np.arange(b), lengths - 1] = score
    mask = torch.from_numpy(response_mask)
    return DataProto.from_dict(
        tensors={
            "prompts": torch.from_numpy(rng.integers(1, 50, (b, prompt))),
            "responses": torch.from_numpy(rng.integers(1, 50, (b, width))),
            "response_mask": mask,
            "attention_mask": torch.cat([torch.ones(b, prompt, dtype=torch.int64), mask], 1),
            "token_level_rewards": torch.from_numpy(rewards),
        },
        non_tensors={
            "uid": uids,
            **{k: values[k].astype(np.float32) for k in KEYS[:keys]},
        },
    )


def advantages(data: DataProto, estimator: str, config: AlgoConfig) -> torch.Tensor:
    out = ray_trainer.compute_advantage(data, adv_estimator=estimator, config=config)
    return out.batch["advantages"]


@pytest.mark.parametrize("keys", [2, 3])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_adv_gdpo_equals_verls_own_gdpo(keys: int, weighted: bool, seed: int) -> None:
    weights = [0.5, 2.0, 1.5][:keys] if weighted else None
    config = AlgoConfig(
        adv_estimator="gdpo", gdpo_reward_keys=KEYS[:keys], gdpo_reward_weights=weights
    )
    theirs = advantages(gdpo_batch(seed, keys), "gdpo", config)
    ours = advantages(gdpo_batch(seed, keys), "adv_gdpo", config)
    scale = max(1.0, float(theirs.abs().max()))
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-5, atol=2e-6 * scale)
    # not GRPO on the summed score
    grpo = advantages(gdpo_batch(seed, keys), "adv_grpo", AlgoConfig())
    assert not np.allclose(ours.numpy(), grpo.numpy(), atol=1e-3)


def test_weights_change_the_answer_as_in_verl() -> None:
    plain = AlgoConfig(gdpo_reward_keys=KEYS[:2])
    weighted = AlgoConfig(gdpo_reward_keys=KEYS[:2], gdpo_reward_weights=[3.0, 0.2])
    a = advantages(gdpo_batch(5, 2), "adv_gdpo", plain)
    b = advantages(gdpo_batch(5, 2), "adv_gdpo", weighted)
    assert not np.allclose(a.numpy(), b.numpy(), atol=1e-3)


@pytest.mark.parametrize(
    ("config", "says"),
    [
        (AlgoConfig(), "gdpo_reward_keys"),
        (
            AlgoConfig(gdpo_reward_keys=KEYS[:2], gdpo_reward_weights=[1.0]),
            "one weight per key",
        ),
        (AlgoConfig(gdpo_reward_keys=["missing_reward"]), "'missing_reward' is not in the batch"),
    ],
)
def test_settings_and_batches_it_cannot_use_are_refused(config: AlgoConfig, says: str) -> None:
    with pytest.raises(adv_verl.VerlConfigError, match=says):
        advantages(gdpo_batch(0, 2), "adv_gdpo", config)


def test_the_config_is_checked_when_the_trainer_is_built() -> None:
    fn = adv_verl.REGISTERED["adv_gdpo"]
    config = {
        "algorithm": {"adv_estimator": "adv_gdpo", "gamma": 1.0, "lam": 1.0},
        "trainer": {"use_v1": True},
    }
    with pytest.raises(adv_verl.VerlConfigError, match="gdpo_reward_keys"):
        fn.check_config(config)
    config["algorithm"]["gdpo_reward_keys"] = KEYS[:2]
    fn.check_config(config)


def test_an_estimator_whose_weights_contradict_verls_is_refused() -> None:
    adv_verl.register(
        presets={"mine": {"outcome": {"name": "gdpo", "weights": {"format_reward": 2.0}}}}
    )
    agreeing = AlgoConfig(gdpo_reward_keys=KEYS[:2], gdpo_reward_weights=[2.0, 1.0])
    verl_own = advantages(gdpo_batch(1, 2), "gdpo", agreeing)
    ours = advantages(gdpo_batch(1, 2), "adv_mine", agreeing)
    np.testing.assert_allclose(ours.numpy(), verl_own.numpy(), rtol=1e-5, atol=1e-5)
    contradicting = AlgoConfig(gdpo_reward_keys=KEYS[:2], gdpo_reward_weights=[1.0, 1.0])
    with pytest.raises(adv_verl.VerlConfigError, match="make them agree"):
        advantages(gdpo_batch(1, 2), "adv_mine", contradicting)


class FakeTransferQueue:
    """The v1 trainer's ``transfer_queue`` module as its advantage step calls it: one stored
    row per key, the fields asked for returned (a stand-in for the queue alone)."""

    def __init__(self, fields: dict[str, Any]) -> None:
        self.fields = fields
        self.asked: list[str] = []

    def kv_batch_get(self, keys: Any, partition_id: str, select_fields: Any = None) -> Any:
        self.asked = list(select_fields)
        return {f: self.fields[f] for f in select_fields}


def test_the_v1_fetch_brings_the_reward_keys_with_the_rest() -> None:
    fn = adv_verl.REGISTERED["adv_gdpo"]
    data = gdpo_batch(2, 2)
    stored = {k: list(data.non_tensor_batch[k]) for k in KEYS[:2]}
    queue = FakeTransferQueue({"uid": data.non_tensor_batch["uid"], "rm_scores": 0, **stored})
    fetch = adv_verl._TransferQueueFetch(queue)
    step = {"estimator": fn, "reward_keys": KEYS[:2]}
    token = adv_verl._V1_STEP.set(step)
    try:
        got = fetch.kv_batch_get(keys=[], partition_id="train", select_fields=["uid", "rm_scores"])
        assert queue.asked == ["uid", "rm_scores", *KEYS[:2]]
        assert set(got) == {"uid", "rm_scores"}  # (the components are the step's, per row)
        # the v1 step's DataProto has no reward keys in non_tensor_batch: they come from the fetch
        for key in KEYS[:2]:
            data.non_tensor_batch.pop(key)
        config = AlgoConfig(gdpo_reward_keys=KEYS[:2])
        ours = advantages(data, "adv_gdpo", config)
    finally:
        adv_verl._V1_STEP.reset(token)
    theirs = advantages(gdpo_batch(2, 2), "gdpo", config)
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.integration
@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_adv_gdpo_over_the_service_equals_verls_own(service: Any, transport: str) -> None:
    url = service.url if transport == "http" else service.target
    adv_verl.register(transport, url, presets=["gdpo"])
    before = service.requests(transport=transport)
    config = AlgoConfig(gdpo_reward_keys=KEYS, gdpo_reward_weights=[1.0, 0.5, 2.0])
    ours = advantages(gdpo_batch(9, 3), "adv_gdpo", config)
    theirs = advantages(gdpo_batch(9, 3), "gdpo", config)
    scale = max(1.0, float(theirs.abs().max()))
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-5, atol=2e-6 * scale)
    assert service.requests(transport=transport) == before + 1
