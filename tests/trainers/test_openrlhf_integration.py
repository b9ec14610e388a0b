"""OpenRLHF 0.11.2 (``advantage_client.integrations.openrlhf``) on the real package, in its own
environment (``openrlhf_env.py``): OpenRLHF's
``RemoteExperienceMaker.compute_advantages_and_returns`` patched through the Ray setup hook, on
a synthetic batch (``openrlhf_step.py``), in-process, over HTTP and over gRPC. Outcome
estimators equal OpenRLHF's own estimator of the same math (its length penalties, reward clip
and KL-in-reward kept); KTAE equals the oracle plus OpenRLHF's KL reward-to-go."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from advantage_contract.prompt_keys import prompt_key
from openrlhf_env import OPENRLHF_ENV, OPENRLHF_VERSION
from oracle import reference_compute
from trainer_envs import package_version
from trainer_support import run_step

pytestmark = pytest.mark.integration

STEP = Path(__file__).resolve().parent / "openrlhf_step.py"
# (the service's estimator, OpenRLHF's estimator of the same math): OpenRLHF's group_norm adds
# 1e-9 to the group's sample std.
OUTCOME_CASES = [
    [{"outcome": {"name": "grpo", "epsilon": 1e-9}}, "group_norm"],
    ["rloo", "rloo"],
    ["dr_grpo", "dr_grpo"],
]
KTAE_CASE = ["ktae", None]


@pytest.fixture(scope="module")
def openrlhf_run(service: Any) -> dict[str, Any]:
    """One run of the step script in the OpenRLHF environment, every transport in it (importing
    OpenRLHF's experience maker takes most of the run's time)."""
    return run_step(service, OPENRLHF_ENV, STEP, [*OUTCOME_CASES, KTAE_CASE])


def ktae_expected(run: dict[str, Any], batch: dict[str, Any]) -> dict[str, np.ndarray]:
    """The oracle's KTAE advantages of the batch the service saw (OpenRLHF's rewards after its
    length penalties), clipped to OpenRLHF's reward clip, plus OpenRLHF's KL reward-to-go."""
    groups: dict[int, list[str]] = {}
    for index, sample in batch.items():
        groups.setdefault(sample["group"], []).append(index)
    request = {
        "estimator": "ktae",
        "groups": [
            {
                "id": f"g{g}",
                "rollouts": [
                    {"tokens": batch[i]["tokens"], "reward": batch[i]["reward"]} for i in members
                ],
            }
            for g, members in sorted(groups.items())
        ],
    }
    reference = reference_compute(request)
    low, high = run["clip"]
    out = {}
    for (_, members), ref_group in zip(sorted(groups.items()), reference["groups"], strict=True):
        for index, ref in zip(members, ref_group["rollouts"], strict=True):
            advantages = np.clip(np.asarray(ref["advantages"], dtype=np.float64), low, high)
            out[index] = advantages + np.asarray(batch[index]["kl_to_go"])
    return out


def test_openrlhf_version(openrlhf_run: dict[str, Any]) -> None:
    assert openrlhf_run["version"] == OPENRLHF_VERSION
    assert package_version(openrlhf_run["python"], "openrlhf") == OPENRLHF_VERSION


def test_openrlhf_service_called_once_per_batch(openrlhf_run: dict[str, Any]) -> None:
    """Each patched step made one call (HTTP and gRPC: counted by the service)."""
    for transport, run in openrlhf_run["transports"].items():
        assert [c["calls"] for c in run["cases"]] == [1] * len(run["cases"]), transport
    remote = sum(len(openrlhf_run["transports"][t]["cases"]) for t in ("http", "grpc"))
    assert openrlhf_run["service_requests"] == remote


@pytest.mark.parametrize("transport", ["inprocess", "http", "grpc"])
def test_openrlhf_outcomes_equal_openrlhf_own(openrlhf_run: dict[str, Any], transport: str) -> None:
    """grpo, rloo and dr_grpo through the service equal OpenRLHF's group_norm, rloo and dr_grpo
    on every action token: its length penalties, reward clip and KL in the reward kept."""
    run = openrlhf_run["transports"][transport]
    # (the batch exercised the length penalties: rewards moved off their raw values)
    rewards = {round(s["reward"], 6) for s in run["batch"].values()}
    assert rewards - {0.0, 0.25, 1.0, 1.25}, rewards
    for case in run["cases"][: len(OUTCOME_CASES)]:
        assert case["returns_equal"]
        assert case["own"].keys() == case["service"].keys()
        for index, own in case["own"].items():
            np.testing.assert_allclose(
                case["service"][index], own, rtol=1e-5, atol=1e-6, err_msg=f"{case} {index}"
            )


@pytest.mark.parametrize("transport", ["inprocess", "http", "grpc"])
def test_openrlhf_ktae_equals_oracle(openrlhf_run: dict[str, Any], transport: str) -> None:
    """KTAE, which OpenRLHF does not have: the oracle's per-token advantages, clipped by
    OpenRLHF's reward clip, plus OpenRLHF's KL reward-to-go."""
    run = openrlhf_run["transports"][transport]
    got = run["cases"][-1]["service"]
    expected = ktae_expected(openrlhf_run, run["batch"])
    assert got.keys() == expected.keys()
    for index, values in expected.items():
        np.testing.assert_allclose(got[index], values, rtol=1e-5, atol=1e-5, err_msg=index)
    # (KTAE moves advantages within a sample, unlike an outcome estimator)
    spread = [
        np.ptp(np.asarray(got[i]) - np.asarray(run["batch"][i]["kl_to_go"]))
        for i in got
        if len(got[i]) > 1
    ]
    assert max(spread) > 1e-3


def test_openrlhf_refuses_at_construction(openrlhf_run: dict[str, Any]) -> None:
    """A misspelt estimator, OpenRLHF's critic estimator (gae) and a discount fail when the maker
    is built (OpenRLHF's PPOTrainer), naming the setting."""
    said = openrlhf_run["refusals"]
    assert "unknown estimator 'ktea'" in said[0]
    assert "--algo.advantage.estimator gae" in said[1]
    assert "--algo.advantage.gamma 0.99" in said[2]


def test_openrlhf_sends_the_contract_prompt_key(openrlhf_run: dict[str, Any]) -> None:
    """Each sample's prompt key is the contract's key of its prompt's token ids (as made), the
    key every integration sends: history carries across trainers."""
    prompts = openrlhf_run["prompts"]
    n = len(next(iter(openrlhf_run["transports"].values()))["batch"]) // len(prompts)
    for run in openrlhf_run["transports"].values():
        for case in run["cases"]:
            sent = case["prompt_keys"]
            assert len(sent) == len(prompts) * n
            for index, key in sent.items():
                assert key == prompt_key(prompts[int(index) // n]), index
