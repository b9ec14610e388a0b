"""The ``gdpo`` outcome through the JSON API (``compute``) and the padded API
(``compute_padded``, in process), against the slow reference (tests/gdpo_oracle.py), and its
refusals as the client sees them (4xx naming the field)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from advantage_service import compute
from advantage_service.errors import RequestError
from advantage_service.wire.padded import compute_padded
from gdpo_oracle import gdpo_reference

GROUPS: list[list[tuple[dict[str, float | None], int]]] = [
    [({"acc": 1.0, "fmt": 0.5}, 3), ({"acc": 0.0, "fmt": None}, 2), ({"acc": 1.0, "fmt": 1.0}, 4)],
    [({"acc": 0.0, "fmt": 0.2}, 1)],  # a group of one
    [({"acc": 1.0, "fmt": 0.0}, 2), ({"acc": 1.0, "fmt": 1.0}, 5)],  # equal accuracy
    [({"acc": None, "fmt": None}, 2), ({"acc": 0.0, "fmt": 0.7}, 3)],  # one scored nothing
]
WEIGHTS = {"acc": 2.0, "fmt": 0.5}


def json_request(normalization: str) -> dict[str, Any]:
    groups = []
    for g, group in enumerate(GROUPS):
        rollouts = []
        for r, (components, length) in enumerate(group):
            rollout: dict[str, Any] = {
                "tokens": [10 + g + r + t for t in range(length)],
                "reward_components": components,
            }
            if all(v is None for v in components.values()):
                rollout["reward"] = 0.0  # (a rollout needs a reward or a component value)
            rollouts.append(rollout)
        groups.append({"id": f"g{g}", "rollouts": rollouts})
    outcome = {"name": "gdpo", "weights": WEIGHTS, "normalization": normalization}
    return {"estimator": {"outcome": outcome}, "return": ["scalar"], "groups": groups}


@pytest.mark.parametrize("normalization", ["verl", "trl"])
def test_the_json_api_answers_the_reference(normalization: str) -> None:
    response = compute(json_request(normalization))
    want = gdpo_reference(GROUPS, WEIGHTS, normalization)
    got = [r for g in response["groups"] for r in g["rollouts"]]
    assert len(got) == len(want)
    for rollout, (_, length), a in zip(got, [r for g in GROUPS for r in g], want, strict=True):
        np.testing.assert_allclose(rollout["advantages"], [a] * length, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(rollout["scalar"], a, rtol=1e-6, atol=1e-7)
    assert response["estimator"]["outcome"] == {
        "name": "gdpo",
        "weights": WEIGHTS,
        "normalization": normalization,
    }


@pytest.mark.parametrize("normalization", ["verl", "trl"])
def test_the_padded_api_answers_the_reference_with_rows_in_any_order(normalization: str) -> None:
    rows = [(g, comps, length) for g, group in enumerate(GROUPS) for comps, length in group]
    order = np.random.default_rng(0).permutation(len(rows))
    width = 7
    ids = np.full((len(rows), width), 99, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=bool)
    groups = np.zeros(len(rows), dtype=np.int64)
    components = {name: np.full(len(rows), np.nan) for name in WEIGHTS}
    for at, i in enumerate(order):
        g, comps, length = rows[int(i)]
        ids[at, :length] = 5
        mask[at, :length] = True
        groups[at] = g
        for name, value in comps.items():
            components[name][at] = np.nan if value is None else value
    result = compute_padded(
        ids,
        mask,
        np.zeros(len(rows)),
        groups,
        estimator={"outcome": {"name": "gdpo", "weights": WEIGHTS, "normalization": normalization}},
        reward_components=components,
    )
    want = np.asarray(gdpo_reference(GROUPS, WEIGHTS, normalization))[order]
    advantages = np.asarray(result.advantages)
    np.testing.assert_allclose(advantages, np.where(mask, want[:, None], 0.0), atol=1e-6)


def test_a_request_without_components_is_a_client_error_naming_the_field() -> None:
    request = {
        "estimator": "gdpo",
        "groups": [{"id": "a", "rollouts": [{"tokens": [1], "reward": r} for r in (0.0, 1.0)]}],
    }
    with pytest.raises(RequestError) as caught:
        compute(request)
    assert caught.value.field == "reward_components"
    assert 400 <= caught.value.status < 500


def test_weights_of_a_component_the_request_lacks_are_a_client_error() -> None:
    request = json_request("verl")
    request["estimator"]["outcome"]["weights"] = {"acc": 1.0, "length": 3.0}
    with pytest.raises(RequestError) as caught:
        compute(request)
    assert caught.value.field == "estimator.outcome.weights.length"
    assert 400 <= caught.value.status < 500
