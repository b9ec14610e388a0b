"""The Tunix integration on the real google-tunix 0.1.7 (JAX on the CPU): a GRPO run of Tunix's
toy transformer through ``AdvantageGRPOLearner`` with the service's KTAE over HTTP and gRPC (the
advantages the loss receives are per token, zero off the mask, and equal the service's answer
for the same ids, mask and rewards; the repeated prompt's history is counted under one key),
``adv_grpo`` through ``register`` equal to Tunix's own ``grpo``, and a preset needing entropy
refused when the learner is built."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest
from advantage_client import GrpcClient, HttpClient
from advantage_service import compute_padded
from jax_support import JAX_ENV, JAX_VERSION, TUNIX_VERSION
from process_support import poll
from trainer_envs import ensure_env, package_version, run_in_env
from trainer_support import TrainerService

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
TRANSPORTS = ("http", "grpc")
KTAE = {"outcome": "grpo", "ktae": {"history": "prompt"}}


def counted(service: TrainerService, namespace: str) -> int:
    response = service.http.get("/v1/stats/tokens", params={"namespace": namespace})
    return int(response.json()["rollouts_counted"]) if response.status_code == 200 else -1


@pytest.fixture(scope="module")
def run(service: TrainerService, tmp_path_factory: pytest.TempPathFactory) -> dict:
    python = ensure_env(JAX_ENV)
    assert package_version(python, "google-tunix") == TUNIX_VERSION
    assert package_version(python, "jax") == JAX_VERSION
    out = tmp_path_factory.mktemp("tunix") / "run.npz"
    namespace = f"tunix-{uuid.uuid4().hex[:8]}"
    run_in_env(
        python,
        HERE / "tunix_script.py",
        service.url,
        service.target,
        namespace,
        str(out),
        service=True,
        extra_env={"JAX_PLATFORMS": "cpu"},
        timeout=500,
    )
    with np.load(out) as data:
        return {**dict(data), "namespace": namespace}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_tunix_grpo_run_takes_per_token_ktae(run: dict, transport: str) -> None:
    at = f"{transport}/"
    assert int(run[at + "steps"]) == 2
    assert int(run[at + "calls"]) == 2  # one call per step
    for step in range(2):
        got = run[f"{at}step{step}/advantages"]
        mask = run[f"{at}step{step}/mask"]
        assert got.shape == mask.shape and got.dtype == np.float32
        assert np.all(got[~mask] == 0)
        assert bool(run[f"{at}step{step}/sharding_ok"])
    # A first visit scores as without history: the library in this process, independently.
    first = {k: run[f"{at}step0/{k}"] for k in ("ids", "mask", "rewards", "groups")}
    expected = compute_padded(
        first["ids"], first["mask"], first["rewards"], first["groups"], estimator=KTAE
    ).advantages
    np.testing.assert_allclose(run[f"{at}step0/advantages"], expected, rtol=1e-5, atol=1e-5)
    varies = [
        np.ptp(row[m]) > 0
        for row, m in zip(run[f"{at}step0/advantages"], first["mask"], strict=True)
        if m.any()
    ]
    assert any(varies), "no row's advantages vary over its tokens"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_tunix_repeated_prompt_history_under_one_key(
    run: dict, transport: str, service: TrainerService
) -> None:
    at = f"{transport}/"
    keys = [run[f"{at}step{s}/prompt_keys"] for s in range(2)]
    np.testing.assert_array_equal(keys[0], keys[1])
    groups = run[f"{at}step0/groups"]
    assert len(set(keys[0].tolist())) == len(set(groups.tolist())) == 2
    assert [str(run[f"{at}step{s}/history"]) for s in range(2)] == ["empty", "applied"]
    # The second step equals the service's answer for the same two calls in a fresh namespace.
    client = HttpClient(service.url) if transport == "http" else GrpcClient(service.target)
    fresh = f"replay-{uuid.uuid4().hex[:8]}"
    for step in range(2):
        result = client.compute_padded(
            run[f"{at}step{step}/ids"],
            run[f"{at}step{step}/mask"],
            run[f"{at}step{step}/rewards"],
            run[f"{at}step{step}/groups"],
            estimator=KTAE,
            namespace=fresh,
            prompt_keys=run[f"{at}step{step}/prompt_keys"],
        )
        # (statistics are stored after the answer: the next call reads them once stored)
        rows = 8 * (step + 1)
        poll(lambda rows=rows: counted(service, fresh) >= rows, 60, "the replay's writes")
    np.testing.assert_allclose(
        run[f"{at}step1/advantages"], result.advantages, rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_tunix_adv_grpo_equals_tunix_grpo(run: dict, transport: str) -> None:
    ours = run[f"{transport}/registry/adv_grpo"]
    theirs = run[f"{transport}/registry/grpo"]
    assert np.any(theirs != 0)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_tunix_entropy_preset_refused_at_construction(run: dict, transport: str) -> None:
    message = str(run[f"{transport}/refused"])
    assert message.startswith("adv_forking needs entropy")
