"""JAX arrays on every path, in the environment a JAX trainer has (jax on the CPU, two host
devices): float32, bfloat16, x64 and sharded arrays, 0-d JAX rewards, through nested ``compute``
on JSON, Arrow and gRPC, the gRPC stream, ``compute_padded`` on both clients and in-process.
Each answer equals the same path's answer for numpy float32 of the same (bfloat16-rounded)
values, and those equal the oracle."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from jax_support import JAX_ENV, JAX_VERSION, TWO_CPU_DEVICES
from oracle import reference_compute
from trainer_envs import ensure_env, package_version, run_in_env
from trainer_support import TrainerService

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
VARIANTS = ("float32", "bfloat16", "x64", "sharded")
PATHS = (
    "compute_http_json",
    "compute_http_arrow",
    "compute_grpc",
    "stream_grpc",
    "padded_http",
    "padded_grpc",
    "padded_inprocess",
)
ESTIMATORS = ("ktae", "gtpo")
G = 4


@pytest.fixture(scope="module")
def answers(service: TrainerService, tmp_path_factory: pytest.TempPathFactory) -> dict:
    python = ensure_env(JAX_ENV)
    assert package_version(python, "jax") == JAX_VERSION
    out = tmp_path_factory.mktemp("jax") / "answers.npz"
    run_in_env(
        python,
        HERE / "jax_arrays_script.py",
        service.url,
        service.target,
        str(out),
        service=True,
        extra_env=TWO_CPU_DEVICES,
        timeout=300,
    )
    with np.load(out) as data:
        return dict(data)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("path", PATHS)
def test_jax_arrays_answer_as_numpy_float32(answers: dict, variant: str, path: str) -> None:
    for estimator in ESTIMATORS:
        key = f"{path}/{estimator}"
        np.testing.assert_allclose(
            answers[f"{variant}/{key}"],
            answers[f"numpy-{variant}/{key}"],
            rtol=1e-6,
            atol=1e-6,
            err_msg=f"{variant} {key}",
        )


def _oracle(answers: dict, estimator: str, variant: str) -> np.ndarray:
    """The oracle's advantages for the batch the script sent (rebuilt from its own seed)."""
    base = {k[len("base/") :]: v for k, v in answers.items() if k.startswith("base/")}
    mask = base["mask"]
    rewards, entropy = base["rewards"], base["entropy"]
    if variant == "bfloat16":
        import torch

        def rounded(x: np.ndarray) -> np.ndarray:
            return torch.from_numpy(x).bfloat16().float().numpy()

        rewards, entropy = rounded(rewards), rounded(entropy)
    rollouts = [
        {
            "tokens": base["tokens"][i][mask[i]].tolist(),
            "reward": float(rewards[i]),
            "entropy": entropy[i][mask[i]].astype(np.float64).tolist(),
        }
        for i in range(mask.shape[0])
    ]
    groups = [
        {"id": f"g{g}", "rollouts": rollouts[g * G : (g + 1) * G]}
        for g in range(mask.shape[0] // G)
    ]
    response = reference_compute({"estimator": estimator, "groups": groups})
    out = np.zeros(mask.shape)
    flat = [r["advantages"] for group in response["groups"] for r in group["rollouts"]]
    out[mask] = np.concatenate(flat)
    return out


@pytest.mark.parametrize("variant", ["float32", "bfloat16"])
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_jax_answers_equal_the_oracle(answers: dict, variant: str, estimator: str) -> None:
    expected = _oracle(answers, estimator, variant)
    for path in PATHS:
        np.testing.assert_allclose(
            answers[f"{variant}/{path}/{estimator}"],
            expected,
            rtol=1e-5,
            atol=1e-5,
            err_msg=f"{variant} {path}",
        )
