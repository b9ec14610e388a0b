"""``compute_padded_in_jit``: advantages inside ``jax.jit`` equal the same backend's
``compute_padded`` outside it, in-process, over HTTP and over gRPC, with the pure and the ordered
callback; a client call made directly inside jit fails naming the helper."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from jax_support import JAX_ENV
from trainer_envs import ensure_env, run_in_env
from trainer_support import TrainerService

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def answers(service: TrainerService, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("jax-jit") / "answers.npz"
    run_in_env(
        ensure_env(JAX_ENV),
        HERE / "jax_callback_script.py",
        service.url,
        service.target,
        str(out),
        service=True,
        extra_env={"JAX_PLATFORMS": "cpu"},
        timeout=300,
    )
    with np.load(out) as data:
        return dict(data)


@pytest.mark.parametrize("backend", ["inprocess", "http", "grpc"])
@pytest.mark.parametrize("estimator", ["grpo", "ktae"])
@pytest.mark.parametrize("callback", ["pure", "ordered"])
def test_jax_jit_answers_equal_the_plain_call(
    answers: dict, backend: str, estimator: str, callback: str
) -> None:
    inside = answers[f"{backend}/{estimator}/{callback}"]
    plain = answers[f"{backend}/{estimator}/plain"]
    assert np.any(plain != 0)
    np.testing.assert_array_equal(inside, plain)
    assert np.all(inside[~answers["mask"]] == 0)


def test_jax_jit_direct_client_call_names_the_way_out(answers: dict) -> None:
    error = str(answers["direct_error"])
    assert error.startswith("AdvantageError: invalid_type: mask is a traced JAX array")
    assert "compute_padded_in_jit" in error
