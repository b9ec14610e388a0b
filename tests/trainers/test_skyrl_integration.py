"""SkyRL (skyrl-train 0.3.1, in its own environment): the service's estimators registered in
SkyRL's ``AdvantageEstimatorRegistry`` and run by SkyRL's own ``compute_advantages_and_returns``
(``ppo_utils``'s and the trainer's, patched), in-process, over HTTP and over gRPC: equal to
SkyRL's built-in GRPO (with and without the std division, the latter Dr. GRPO's math) and RLOO,
KTAE equal to the oracle, and KTAE with history moving on a revisit (over HTTP and gRPC)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from padded_batches import padded_case
from skyrl_support import SKYRL_ENV, SKYRL_VERSION
from trainer_envs import ensure_env, package_version
from trainer_support import run_steps

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
# SkyRL computes in float32 (its rewards tensor), the service and the oracle in float64
RTOL, ATOL = 1e-5, 1e-5


@pytest.fixture(scope="session")
def skyrl_python() -> Path:
    return ensure_env(SKYRL_ENV)


@pytest.fixture(scope="module")
def skyrl_results(skyrl_python: Path, service: Any, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("skyrl")
    # groups of 2 or more non-empty responses: SkyRL's grpo gives a lone response
    # reward / (1 + eps) where the service gives 0, and needs a last token for the reward
    outcome = padded_case(
        41, "grpo", layout="right", n_groups=(3, 5), group_size=(2, 6), length=(1, 12), empty_prob=0
    )
    ktae = padded_case(
        46, "ktae", layout="right", n_groups=(3, 5), group_size=(2, 6), length=(1, 12), empty_prob=0
    )
    rng = np.random.default_rng(43)
    prompts = np.zeros((ktae.tokens.shape[0], 6), dtype=np.int64)
    for row in range(prompts.shape[0]):  # left-padded prompts, as SkyRL lays them out
        length = int(rng.integers(1, 7))
        prompts[row, 6 - length :] = rng.integers(1, 1000, size=length)
    np.savez(
        folder / "cases.npz",
        outcome_mask=outcome.mask,
        outcome_rewards=outcome.rewards,
        outcome_uids=outcome.group_ids.astype(str),
        ktae_tokens=ktae.tokens,
        ktae_mask=ktae.mask,
        ktae_rewards=ktae.rewards,
        ktae_uids=ktae.group_ids.astype(str),
        ktae_prompts=prompts,
    )
    return outcome, ktae, run_steps(skyrl_python, HERE / "skyrl_steps.py", folder, service)


def test_skyrl_environment_has_the_real_package(skyrl_python: Path) -> None:
    assert package_version(skyrl_python, "skyrl-train") == SKYRL_VERSION


@pytest.mark.parametrize("transport", ["inprocess", "http", "grpc"])
@pytest.mark.parametrize(
    ("ours", "theirs", "norm"),
    [
        ("adv_grpo", "grpo", True),
        ("adv_grpo", "grpo", False),
        ("adv_dr_grpo", "grpo", False),
        ("adv_rloo", "rloo", True),
    ],
)
def test_skyrl_registered_estimator_equals_skyrls_own(
    skyrl_results: Any, transport: str, ours: str, theirs: str, norm: bool
) -> None:
    outcome, _, out = skyrl_results
    got, expected = out[f"{transport}:{ours}:{norm}"], out[f"skyrl:{theirs}:{norm}"]
    assert np.abs(expected).max() > 0.1  # (a batch whose advantages are not all 0)
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL, err_msg=transport)
    assert np.all(got[~outcome.mask] == 0.0)


@pytest.mark.parametrize("transport", ["inprocess", "http", "grpc"])
def test_skyrl_ktae_from_skyrls_batch_equals_the_oracle(skyrl_results: Any, transport: str) -> None:
    _, ktae, out = skyrl_results
    got = out[f"{transport}:adv_ktae"]
    varying = [np.unique(np.round(got[i][ktae.mask[i]], 6)).size > 1 for i in range(len(got))]
    assert sum(varying) >= 2  # (advantages that vary within a response, not a row's scalar)
    np.testing.assert_allclose(got, ktae.advantages, rtol=RTOL, atol=ATOL, err_msg=transport)


@pytest.mark.parametrize("transport", ["inprocess", "http", "grpc"])
def test_skyrl_trainers_own_advantage_step_patched_equals_the_oracle(
    skyrl_results: Any, transport: str
) -> None:
    # RayPPOTrainer.compute_advantages_and_returns, wrapped by patch_trainer, gives adv_ktae the
    # response tokens from the batch's sequences (a prompt-length offset would move them)
    _, ktae, out = skyrl_results
    got = out[f"{transport}:trainer:adv_ktae"]
    np.testing.assert_allclose(got, ktae.advantages, rtol=RTOL, atol=ATOL, err_msg=transport)
