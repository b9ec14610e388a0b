"""The verl integration where verl trains: inside a Ray actor, as verl's TaskRunner runs ``fit``.

One real Ray session (``ray.init(num_cpus=2)``) started with the package's setup hook
(``adv_verl.runtime_env(...)``: ``worker_process_setup_hook`` plus ``ADVANTAGE_VERL_*``), against
a real service over HTTP. Nothing is registered or patched in this (the driver's) process: the
estimators exist in the actor only because the hook ran there. The actor computes advantages
with the legacy trainer's ``ray_trainer.compute_advantage`` and with the v1 trainer's
``PPOTrainer._compute_advantage`` (a real transfer queue, a synthetic batch put in it the way
the agent loop puts one: nested tensors keyed ``{uid}_{session}_{index}``).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from padded_batches import ATOL, RTOL, padded_case

ray = pytest.importorskip("ray")
pytest.importorskip("transfer_queue")
pytest.importorskip("verl.trainer.ppo.v1.trainer_base")

from advantage_client.integrations import verl as adv_verl  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HISTORY = {"outcome": "grpo", "ktae": {"history": "prompt"}}


class Runner:
    """What verl's TaskRunner does around the advantage step, in a Ray actor."""

    def registered(self) -> list[str]:
        return sorted(adv_verl.REGISTERED)

    def legacy(
        self, tensors: dict[str, np.ndarray], uids: list[str], estimator: str, norm: bool = True
    ) -> np.ndarray:
        import torch
        from verl import DataProto
        from verl.trainer.config import AlgoConfig
        from verl.trainer.ppo import ray_trainer

        data = DataProto.from_dict(
            tensors={k: torch.from_numpy(v) for k, v in tensors.items()},
            non_tensors={"uid": np.asarray(uids, dtype=object)},
        )
        config = AlgoConfig(adv_estimator=estimator, norm_adv_by_std_in_grpo=norm)
        out = ray_trainer.compute_advantage(
            data, adv_estimator=estimator, norm_adv_by_std_in_grpo=norm, config=config
        )
        return out.batch["advantages"].numpy()

    def v1(
        self,
        rows: dict[str, list[np.ndarray]],
        uids: list[str],
        estimator: str,
    ) -> list[np.ndarray]:
        """The v1 trainer's _compute_advantage over a batch in a real transfer queue."""
        import torch
        import transfer_queue as tq
        from omegaconf import OmegaConf
        from tensordict import TensorDict
        from verl.trainer.ppo.v1 import get_trainer_cls

        if not getattr(self, "tq_ready", False):
            tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
            self.tq_ready = True
        b = len(uids)
        # {uid}_{session}_{index}: one session per rollout, as the agent loop names them
        keys = [f"{u}_{i}_0" for i, u in enumerate(uids)]

        def nested(values: list[np.ndarray]) -> Any:
            return torch.nested.as_nested_tensor(
                [torch.from_numpy(v) for v in values], layout=torch.jagged
            )

        fields = TensorDict(
            {
                **{name: nested(values) for name, values in rows.items()},
                "uid": np.asarray(uids, dtype=object),
            },
            batch_size=b,
        )
        meta = tq.kv_batch_put(keys=keys, partition_id="train", fields=fields)
        cls = get_trainer_cls("sync")
        trainer = cls.__new__(cls)  # (the advantage step reads only the config)
        trainer.config = OmegaConf.create(
            {
                "algorithm": {
                    "adv_estimator": estimator,
                    "gamma": 1.0,
                    "lam": 1.0,
                    "norm_adv_by_std_in_grpo": True,
                    "use_kl_in_reward": False,
                    "rollout_correction": None,
                },
                "actor_rollout_ref": {"rollout": {"n": 2}},
            }
        )
        trainer._compute_advantage(meta, {})
        got = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["advantages"])
        return [t.numpy() for t in got["advantages"].unbind(0)]


@pytest.fixture(scope="module")
def runner(service: Any) -> Iterator[Any]:
    # The workers import this module (the actor's class) from the test folders.
    here = Path(__file__).resolve().parent
    path = os.pathsep.join(
        p for p in (os.environ.get("PYTHONPATH"), str(here), str(here.parent)) if p
    )
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        runtime_env=adv_verl.runtime_env(
            "http",
            service.url,
            presets=["grpo", "ktae"],
            estimators={"ktae_history": HISTORY},
            base={"env_vars": {"PYTHONPATH": path}},
        ),
    )
    try:
        yield ray.remote(Runner).remote()
    finally:
        ray.shutdown()


def legacy_tensors(case: Any) -> dict[str, np.ndarray]:
    b, t = case.mask.shape
    rewards = np.zeros((b, t), np.float32)
    last = np.where(case.mask.any(1), (case.mask * np.arange(t)).argmax(1), 0)
    rewards[np.arange(b), last] = case.rewards
    return {
        "responses": case.tokens,
        "response_mask": case.mask.astype(np.int64),
        "token_level_rewards": rewards,
    }


def test_the_setup_hook_registers_and_patches_in_the_actor_where_training_runs(
    runner: Any,
) -> None:
    # Only the hook registers this name (other tests of this process register presets here).
    assert "adv_ktae_history" not in adv_verl.REGISTERED
    assert {"adv_grpo", "adv_ktae", "adv_ktae_history"} <= set(ray.get(runner.registered.remote()))
    case = padded_case(36, "ktae", layout="right", ids="str")
    got = ray.get(
        runner.legacy.remote(legacy_tensors(case), [str(g) for g in case.group_ids], "adv_ktae")
    )
    np.testing.assert_allclose(got, case.advantages, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("estimator", ["adv_ktae", "adv_grpo"])
def test_the_v1_trainers_advantage_step_in_the_actor(runner: Any, estimator: str) -> None:
    """verl 0.9's default trainer: its batch has no responses until patch() makes the
    advantage step fetch them (today: "call ... patch()" although patch() was called)."""
    case = padded_case(
        37, estimator.removeprefix("adv_"), layout="right", ids="str", empty_prob=0, length=(1, 12)
    )
    rows = {
        "responses": [case.tokens[i][case.mask[i]] for i in range(len(case.rewards))],
        "response_mask": [
            np.ones(int(case.mask[i].sum()), np.int64) for i in range(len(case.rewards))
        ],
        "rm_scores": [],
    }
    for i, r in enumerate(case.rewards):
        scores = np.zeros(int(case.mask[i].sum()), np.float32)
        scores[-1] = r
        rows["rm_scores"].append(scores)
    fresh = {str(g): f"{g}-{uuid.uuid4()}" for g in case.group_ids}  # a new uid per group
    uids = [fresh[str(g)] for g in case.group_ids]
    got = ray.get(runner.v1.remote(rows, uids, estimator))
    for i, values in enumerate(got):
        np.testing.assert_allclose(
            values, case.advantages[i][case.mask[i]], rtol=RTOL, atol=ATOL, err_msg=f"row {i}"
        )


def prompt_batch(seed: int) -> tuple[dict[str, np.ndarray], list[str], np.ndarray]:
    """Two prompts x 4 rollouts with left-padded prompts (width varying by step) and fresh uuid
    uids, as verl holds a step."""
    rng = np.random.default_rng(seed)
    prompts = [np.array([3, 4, 5]), np.array([6, 7])]
    width = 4 + seed % 3
    rows, masks = [], []
    for p in prompts:
        for _ in range(4):
            rows.append(np.concatenate([np.zeros(width - p.size, np.int64), p]))
            masks.append(np.concatenate([np.zeros(width - p.size), np.ones(p.size)]))
    tokens = rng.integers(10, 30, size=(8, 6))
    rewards = np.zeros((8, 6), np.float32)
    rewards[:, -1] = [1, 0, 1, 0, 0, 1, 1, 0]
    response_mask = np.ones((8, 6), np.int64)
    uids = [f"{uuid.uuid4()}" for _ in prompts]
    tensors = {
        "prompts": np.stack(rows),
        "attention_mask": np.concatenate([np.stack(masks), response_mask], axis=1).astype(np.int64),
        "responses": tokens,
        "response_mask": response_mask,
        "token_level_rewards": rewards,
    }
    return tensors, [uids[i // 4] for i in range(8)], tokens


def test_history_applies_on_a_prompts_next_visit_under_a_fresh_uid(runner: Any) -> None:
    """verl's uid is a new uuid4 every step: keyed by it, history never applies. The prompt
    key (a hash of the prompt's token ids) makes the second visit read the first's."""
    import advantage_service

    tensors, uids, tokens = prompt_batch(1)
    first = ray.get(runner.legacy.remote(tensors, uids, "adv_ktae_history"))
    rewards = tensors["token_level_rewards"].sum(-1)
    plain = advantage_service.compute_padded(
        tokens, np.ones_like(tokens, bool), rewards, uids, estimator=HISTORY
    ).advantages
    np.testing.assert_allclose(first, plain, rtol=RTOL, atol=ATOL)  # first visit: no history

    import time

    time.sleep(1.0)  # (the service writes history after it answers)
    tensors2, uids2, tokens2 = prompt_batch(2)  # same prompts, other padding, fresh uids
    second = ray.get(runner.legacy.remote(tensors2, uids2, "adv_ktae_history"))
    plain2 = advantage_service.compute_padded(
        tokens2, np.ones_like(tokens2, bool), rewards, uids2, estimator=HISTORY
    ).advantages
    assert not np.allclose(second, plain2, rtol=RTOL, atol=ATOL)  # history applied
