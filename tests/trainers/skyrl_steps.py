"""Run in SkyRL's environment: SkyRL's own ``ppo_utils.compute_advantages_and_returns`` on the
batches in ``cases.npz``, with the estimators the integration registered (``adv_*``) over each
transport, and with SkyRL's built-in ``grpo`` and ``rloo``; every result into ``out.npz``.

Usage: ``skyrl_steps.py cases.npz out.npz HTTP_URL GRPC_TARGET`` (``-`` skips a transport)
"""

from __future__ import annotations

import sys
import time
import types

import numpy as np
import torch
from advantage_client.integrations import skyrl
from omegaconf import OmegaConf
from skyrl_train.trainer import RayPPOTrainer
from skyrl_train.training_batch import TrainingInputBatch
from skyrl_train.utils import ppo_utils

HISTORY = {"outcome": "grpo", "ktae": {"history": "prompt"}}
# (ours, SkyRL's, grpo_norm_by_std): the same math on both sides
PAIRS = (
    ("adv_grpo", "grpo", True),
    ("adv_grpo", "grpo", False),
    ("adv_dr_grpo", "grpo", False),
    ("adv_rloo", "rloo", True),
)


def token_rewards(rewards: np.ndarray, mask: np.ndarray) -> torch.Tensor:
    """SkyRL's per-token rewards: each response's reward on its last token."""
    out = np.zeros(mask.shape, dtype=np.float32)
    for row, reward in enumerate(rewards):
        out[row, int(np.flatnonzero(mask[row])[-1])] = reward
    return torch.from_numpy(out)


def step(estimator: str, rewards: torch.Tensor, mask: torch.Tensor, uids: list[str], norm: bool):
    advantages, _ = ppo_utils.compute_advantages_and_returns(
        token_level_rewards=rewards.clone(),
        response_mask=mask,
        index=uids,
        adv_estimator=estimator,
        config=None,
        values=None,
        grpo_norm_by_std=norm,
    )
    return advantages.numpy()


def trainer_step(data: TrainingInputBatch, estimator: str) -> np.ndarray:
    """``RayPPOTrainer.compute_advantages_and_returns`` on ``data``; the trainer object holds
    only the settings that method reads (building a whole trainer needs Ray workers)."""
    algorithm = {"advantage_estimator": estimator, "gamma": 1.0, "lambd": 1.0}
    settings = OmegaConf.create(
        {
            "generator": {"step_wise_trajectories": False},
            "trainer": {"algorithm": {**algorithm, "grpo_norm_by_std": True}},
        }
    )
    batch = TrainingInputBatch({**data, "values": None})
    batch.metadata = {**data.metadata, "avg_response_length": 1.0}
    trainer = types.SimpleNamespace(cfg=settings, all_metrics={})
    return RayPPOTrainer.compute_advantages_and_returns(trainer, batch)["advantages"].numpy()


def main(cases_path: str, out_path: str, http_url: str, grpc_target: str) -> None:
    cases = np.load(cases_path)
    out: dict[str, np.ndarray] = {}
    mask = torch.from_numpy(cases["outcome_mask"].astype(np.float32))
    rewards = token_rewards(cases["outcome_rewards"], cases["outcome_mask"])
    uids = [str(u) for u in cases["outcome_uids"]]
    for _, theirs, norm in PAIRS:
        out[f"skyrl:{theirs}:{norm}"] = step(theirs, rewards, mask, uids, norm)

    # KTAE reads the response tokens: from SkyRL's own batch type, prompts left-padded and
    # responses right-padded after them in "sequences", as SkyRL's trainer lays them out
    k_mask = cases["ktae_mask"]
    k_tokens = torch.from_numpy(cases["ktae_tokens"])
    prompts = torch.from_numpy(cases["ktae_prompts"])
    width = k_tokens.shape[1]
    data = TrainingInputBatch(
        {
            "sequences": torch.cat([prompts, k_tokens], dim=1),
            "attention_mask": torch.cat([prompts != 0, torch.from_numpy(k_mask)], dim=1).long(),
            "response_mask": torch.from_numpy(k_mask.astype(np.float32)),
            "rewards": token_rewards(cases["ktae_rewards"], k_mask),
        }
    )
    data.metadata = {"uids": [str(u) for u in cases["ktae_uids"]], "response_length": width}
    skyrl.patch_trainer(RayPPOTrainer)

    for transport, url in (("inprocess", None), ("http", http_url), ("grpc", grpc_target)):
        if url == "-":
            continue
        made = skyrl.register(transport, url, presets=["grpo", "dr_grpo", "rloo", "ktae"])
        assert sorted(made) == ["adv_dr_grpo", "adv_grpo", "adv_ktae", "adv_rloo"], sorted(made)
        for ours, _, norm in PAIRS:
            out[f"{transport}:{ours}:{norm}"] = step(ours, rewards, mask, uids, norm)
        with skyrl.batch_inputs(data):
            out[f"{transport}:adv_ktae"] = step(
                "adv_ktae", data["rewards"], data["response_mask"], data.metadata["uids"], True
            )
        # SkyRL's trainer's own advantage step, patched: the batch's token ids and prompt keys
        out[f"{transport}:trainer:adv_ktae"] = trainer_step(data, "adv_ktae")
        if transport != "inprocess":  # history: a revisit of the same prompts moves the answer
            skyrl.register(transport, url, presets={"ktae_h": HISTORY})
            first = trainer_step(data, "adv_ktae_h")
            # (the service records a request's statistics after answering it: the revisit may
            # come before they are written, so it is tried again for a few seconds)
            for _ in range(50):
                time.sleep(0.1)
                if not np.allclose(first, trainer_step(data, "adv_ktae_h")):
                    break
            else:
                raise AssertionError(f"{transport}: a revisit left KTAE's history unchanged")
        try:  # without the batch, a token-level estimator says what to do
            step("adv_ktae", data["rewards"], data["response_mask"], data.metadata["uids"], True)
        except skyrl.SkyRLConfigError as exc:
            assert "patch_trainer" in str(exc), exc
        else:
            raise AssertionError("adv_ktae ran without the response tokens")
    np.savez(out_path, **out)


if __name__ == "__main__":
    main(*sys.argv[1:5])
