"""AReaL 1.0.4 (``advantage_client.integrations.areal``) on the real package, in its own
environment (``areal_env.py``): AReaL's ``PPOActor.compute_advantages`` patched through
``setup()``, on a synthetic batch (``areal_step.py``), in-process, over HTTP and over gRPC.
Every ``reward_norm`` (``NormConfig``) below mapped onto the service's ``grpo`` equals AReaL's
own normalisation (its overlong penalty, reward bias/scaling/clip, loss-mask shift, KL reward,
``mask_no_eos_with_zero`` and ``adv_norm`` kept); KTAE equals the oracle plus AReaL's KL
reward-to-go."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from areal_env import AREAL_ENV, AREAL_VERSION
from oracle import reference_compute
from trainer_envs import package_version
from trainer_support import run_step

pytestmark = pytest.mark.integration

STEP = Path(__file__).resolve().parent / "areal_step.py"
G = 4  # (areal_step.N_SAMPLES)
GROUP = {"mean_level": "group", "std_level": "group", "group_size": G}
# AReaL's recipes as NormConfigs: GRPO, Dr. GRPO, RLOO, its default (batch, population std), a
# group mean with the batch's std, leave-one-out with the group's std, none, and GRPO followed
# by AReaL's own adv_norm.
COMPARED = [
    {"reward_norm": GROUP},
    {"reward_norm": {"mean_level": "group", "std_level": None, "group_size": G}},
    {
        "reward_norm": {
            "mean_level": "group",
            "mean_leave1out": True,
            "std_level": None,
            "group_size": G,
        }
    },
    {"reward_norm": {"mean_level": "batch", "std_level": "batch", "std_unbiased": False}},
    {"reward_norm": {"mean_level": "group", "std_level": "batch", "group_size": G, "eps": 1e-3}},
    {"reward_norm": {**GROUP, "mean_leave1out": True}},
    {"reward_norm": None},
    {"reward_norm": GROUP, "adv_norm": {"mean_level": "batch", "std_level": "batch"}},
]
CASES = [
    *({"estimator": "grpo", "compare": True, **c} for c in COMPARED),
    {"estimator": "ktae", "reward_norm": GROUP},
]


@pytest.fixture(scope="module")
def areal_run(service: Any) -> dict[str, Any]:
    """One run of the step script in the AReaL environment, every transport in it."""
    return run_step(service, AREAL_ENV, STEP, CASES)


def test_areal_version(areal_run: dict[str, Any]) -> None:
    assert areal_run["version"] == AREAL_VERSION
    assert package_version(areal_run["python"], "areal") == AREAL_VERSION


def test_areal_service_called_once_per_batch(areal_run: dict[str, Any]) -> None:
    for transport, run in areal_run["transports"].items():
        assert [c["calls"] for c in run["cases"]] == [1] * len(CASES), transport
    assert areal_run["service_requests"] == 2 * len(CASES)


@pytest.mark.parametrize("transport", ["inprocess", "http", "grpc"])
def test_areal_norm_config_equals_areal_own(areal_run: dict[str, Any], transport: str) -> None:
    """Each NormConfig mapped onto the service's grpo equals AReaL's own normalisation on every
    loss position."""
    run = areal_run["transports"][transport]
    batch = run["batch"]
    assert any(batch["no_eos"]) and not all(batch["no_eos"])
    for case in run["cases"][: len(COMPARED)]:
        assert len(case["service"]) == len(case["own"]) == len(batch["tokens"])
        for row, (got, own) in enumerate(zip(case["service"], case["own"], strict=True)):
            np.testing.assert_allclose(
                got, own, rtol=1e-5, atol=1e-6, err_msg=f"{case['reward_norm']} row {row}"
            )


@pytest.mark.parametrize("transport", ["inprocess", "http", "grpc"])
def test_areal_ktae_equals_oracle(areal_run: dict[str, Any], transport: str) -> None:
    """KTAE, which AReaL does not have: the oracle's per-token advantages of the rewards AReaL
    made (the estimator the adapter sent: grpo scaled by AReaL's GRPO NormConfig), zero for a
    trajectory without EOS (``mask_no_eos_with_zero``), plus AReaL's KL reward-to-go."""
    run = areal_run["transports"][transport]
    batch = run["batch"]
    case = run["cases"][-1]
    assert case["sent"]["outcome"]["std_center"] == "baseline"
    request = {
        "estimator": case["sent"],
        "groups": [
            {
                "id": f"g{g}",
                "rollouts": [
                    {"tokens": batch["tokens"][r], "reward": batch["rewards"][r]}
                    for r in range(g * G, (g + 1) * G)
                ],
            }
            for g in range(len(batch["tokens"]) // G)
        ],
    }
    reference = [r for g in reference_compute(request)["groups"] for r in g["rollouts"]]
    spread = []
    for row, got in enumerate(case["service"]):
        outcome = np.asarray(reference[row]["advantages"], dtype=np.float64)
        if batch["no_eos"][row]:
            outcome = np.zeros_like(outcome)
        np.testing.assert_allclose(
            got, outcome + np.asarray(batch["kl_to_go"][row]), rtol=1e-5, atol=1e-5, err_msg=row
        )
        spread.append(np.ptp(outcome) if outcome.size else 0.0)
    assert max(spread) > 1e-3  # (KTAE moves advantages within a trajectory)


def test_areal_refuses_at_construction(areal_run: dict[str, Any]) -> None:
    """A misspelt estimator, an outcome with its own baseline under a reward_norm, a discount and
    scaling set in the estimator instead of reward_norm fail when the actor is built."""
    said = areal_run["refusals"]
    assert "unknown estimator 'ktea'" in said[0]
    assert "actor.reward_norm=null" in said[1]
    assert "actor.discount=0.99" in said[2]
    assert "['std_scope']" in said[3]
