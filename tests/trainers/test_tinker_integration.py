"""Tinker (the ``tinker`` SDK 0.38.0, in its own environment, no Tinker server): per-token
advantages filled into ``tinker.Datum``'s ``loss_fn_inputs`` in-process, over HTTP and over gRPC,
equal to the oracle (Dr. GRPO's reward minus the group's mean, the cookbook's
``compute_advantages``; GRPO; KTAE per token), 0 on observation tokens, every other field kept."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from padded_batches import padded_case
from tinker_support import TINKER_ENV, TINKER_VERSION
from trainer_envs import ensure_env, package_version
from trainer_support import run_steps

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
ESTIMATORS = ("dr_grpo", "grpo", "ktae")
TRANSPORTS = ("inprocess", "http", "grpc")
# the datum carries float32, the oracle float64
RTOL, ATOL = 1e-5, 1e-5


@pytest.fixture(scope="session")
def tinker_python() -> Path:
    return ensure_env(TINKER_ENV)


@pytest.fixture(scope="module")
def tinker_results(tinker_python: Path, service: Any, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("tinker")
    rng = np.random.default_rng(50)
    arrays: dict[str, np.ndarray] = {}
    cases = {}
    for seed, name in enumerate(ESTIMATORS, start=51):
        # own tokens right-aligned, left-aligned or with observation tokens between them
        case = padded_case(
            seed,
            name,
            layout="mixed",
            n_groups=(3, 5),
            group_size=(2, 6),
            length=(1, 12),
            empty_prob=0,
        )
        width = case.tokens.shape[1]
        targets = np.where(case.mask, case.tokens, rng.integers(500, 900, size=case.tokens.shape))
        last = np.array([int(np.flatnonzero(row)[-1]) for row in case.mask])
        lengths = np.minimum(last + 1 + rng.integers(0, 3, size=last.size), width)
        arrays |= {
            f"{name}_targets": targets,
            f"{name}_mask": case.mask,
            f"{name}_lengths": lengths,
            f"{name}_rewards": case.rewards,
            f"{name}_groups": case.group_ids.astype(str),
        }
        cases[name] = (case, targets, lengths)
    np.savez(folder / "cases.npz", **arrays)
    return cases, run_steps(tinker_python, HERE / "tinker_steps.py", folder, service)


def test_tinker_environment_has_the_real_sdk(tinker_python: Path) -> None:
    assert package_version(tinker_python, "tinker") == TINKER_VERSION


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_tinker_datums_get_the_oracles_advantages(
    tinker_results: Any, transport: str, estimator: str
) -> None:
    cases, out = tinker_results
    case, targets, lengths = cases[estimator]
    got = out[f"{transport}:{estimator}:advantages"]
    for row, length in enumerate(lengths):
        assert np.all(np.isnan(got[row, length:]))  # the datum's own length
        np.testing.assert_allclose(
            got[row, :length],
            case.advantages[row, :length],
            rtol=RTOL,
            atol=ATOL,
            err_msg=f"{transport} {estimator} datum {row}",
        )
        assert np.all(got[row, :length][~case.mask[row, :length]] == 0.0)
        # every other field as it was
        np.testing.assert_array_equal(
            out[f"{transport}:{estimator}:target_tokens"][row, :length], targets[row, :length]
        )
        np.testing.assert_array_equal(
            out[f"{transport}:{estimator}:mask"][row, :length], case.mask[row, :length]
        )
        assert np.all(out[f"{transport}:{estimator}:logprobs"][row, :length] == -0.5)
    assert np.abs(case.advantages).max() > 0.1  # (a batch whose advantages are not all 0)
