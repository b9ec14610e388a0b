"""The per-token inputs' range checks: the batch refuses exactly the values the contract refuses,
and names the first one, whatever the shortcut that skips the search when every value is fine.

The oracle below is written from the contract (ESTIMATORS.md's inputs, the rounding tolerance of
1e-4), one value at a time in float64, independent of the service's tensors."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from advantage_service import RolloutBatch
from advantage_service.batch.validation import all_finite, extremes
from advantage_service.errors import RequestError

TOL = 1e-4
F32_TOL = float(np.float32(TOL))


def refused(name: str, value: float) -> bool:
    """Whether the contract refuses ``value`` (a float32's value) of the input ``name``."""
    if not math.isfinite(value):
        return True
    if name in ("logprobs", "teacher"):
        return value > F32_TOL
    if name == "entropy":
        return value < -F32_TOL
    if name == "sum_pi_squared":
        return value <= 0 or value > float(np.float32(1 + TOL))
    if name == "is_weights":
        return value < 0
    if name == "planning_mask":
        return value not in (0.0, 1.0)
    assert name == "returns"
    return False


# Values at and around each bound (as float32: what travels), the extremes of float32, and the
# ones no range takes.
_BOUNDS = np.array(
    [0.0, -0.0, 1.0, 0.5, -1.0, TOL, -TOL, 1 + TOL, 2e-4, -2e-4, 1e-45, -1e-45, 3e38, -3e38],
    np.float32,
)
EDGES = np.concatenate(
    [
        _BOUNDS,
        np.nextafter(_BOUNDS, np.float32(np.inf)),
        np.array([np.nan, np.inf, -np.inf], np.float32),
    ]
)


def valid_values(name: str, rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` values the contract takes, spread over the whole of ``name``'s range."""
    if name in ("logprobs", "teacher"):
        values = -rng.exponential(2.0, n)
    elif name == "entropy":
        values = rng.exponential(1.0, n)
    elif name == "sum_pi_squared":
        values = rng.uniform(1e-3, 1.0, n)
    elif name == "is_weights":
        values = rng.exponential(1.0, n)
    elif name == "planning_mask":
        values = rng.integers(0, 2, n).astype(np.float64)
    else:
        values = rng.normal(0.0, 10.0, n)
    return values.astype(np.float32)


NAMES = [
    "logprobs",
    "teacher",
    "entropy",
    "sum_pi_squared",
    "is_weights",
    "returns",
    "planning_mask",
]


def batch_offsets(n: int) -> list[int]:
    """Four rollouts' offsets over ``n`` tokens (a rollout may be empty)."""
    return [0, n // 4, n // 2, 3 * n // 4, n]


def batch_with(name: str, values: np.ndarray) -> RolloutBatch:
    """Two groups of two rollouts over ``values``' tokens, ``values`` as input ``name``."""
    n = len(values)
    inputs: dict[str, Any] = {}
    if name == "logprobs":
        inputs["logprobs"] = values
    elif name == "teacher":
        inputs["teacher_logprobs"] = {"pos": values}
    else:
        inputs[name] = values
    return RolloutBatch.from_flat(
        np.arange(n) % 7,
        np.array(batch_offsets(n)),
        ["g0", "g1"],
        np.array([0, 0, 1, 1]),
        np.array([1.0, 0.0, 1.0, 0.0]),
        **inputs,
    )


def field_of(name: str) -> str:
    return "teacher_logprobs.pos" if name == "teacher" else name


@pytest.mark.parametrize("name", NAMES)
def test_each_input_refuses_what_the_contract_refuses_and_names_the_first(name: str) -> None:
    rng = np.random.default_rng(NAMES.index(name))  # (str hashes change per process)
    checked = refusals = 0
    for trial in range(300):
        n = int(rng.integers(1, 40))
        values = valid_values(name, rng, n)
        # Some edges at random places (none in a third of the trials: the values all pass).
        if trial % 3:
            for _ in range(int(rng.integers(1, 4))):
                values[rng.integers(0, n)] = rng.choice(EDGES)
        bad = [i for i, v in enumerate(values.tolist()) if refused(name, v)]
        checked += 1
        if not bad:
            batch = batch_with(name, values)  # (no error)
            assert batch.num_tokens == n
            continue
        refusals += 1
        with pytest.raises(RequestError) as info:
            batch_with(name, values)
        err = info.value
        first = bad[0]
        assert (err.code, err.field) == ("invalid_value", field_of(name))
        # (the first refused token of the flat batch, by its group, rollout and place)
        cuts = batch_offsets(n)
        rollout = int(np.searchsorted(cuts, first, side="right") - 1)
        assert (err.group_id, err.rollout_index) == (f"g{rollout // 2}", rollout % 2)
        assert f" at token {first - cuts[rollout]} " in err.message
        assert ("must be finite" in err.message) == (not math.isfinite(float(values[first])))
    assert refusals > 20 and checked - refusals > 50


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_extremes_show_any_value_that_is_not_finite(dtype: torch.dtype) -> None:
    rng = np.random.default_rng(3)
    for n in (1, 2, 17, 100_000):
        for bad in (math.nan, math.inf, -math.inf):
            values = torch.from_numpy(rng.normal(size=n)).to(dtype)
            assert all_finite(values)
            i = int(rng.integers(0, n))
            values[i] = bad
            assert not all_finite(values)
            low, high = extremes(values)
            assert not (math.isfinite(low) and math.isfinite(high))
    assert all_finite(torch.zeros(0)) and all_finite(torch.tensor([2**40]))
