"""A ``gdpo`` request (reward components, a null value, a group of one, weights, both
normalisations) over every transport of a real service: JSON and Arrow over HTTP and gRPC unary
answer what the library answers in process, and a request without components is refused on
each with a 4xx / INVALID_ARGUMENT naming the field."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from advantage_client import AdvantageError, GrpcClient, HttpClient
from advantage_service import compute

pytestmark = pytest.mark.integration


def gdpo_request(normalization: str) -> dict[str, Any]:
    rng = np.random.default_rng(len(normalization))
    groups = []
    for g, size in enumerate([3, 1, 4, 2]):
        rollouts = []
        for r in range(size):
            fmt = None if (g, r) == (2, 1) else float(rng.integers(0, 2))
            rollouts.append(
                {
                    "tokens": rng.integers(1, 400, int(rng.integers(1, 7))).tolist(),
                    "reward_components": {"accuracy": float(rng.integers(0, 2)), "format": fmt},
                }
            )
        groups.append({"id": f"gdpo-{normalization}-{g}", "rollouts": rollouts})
    return {
        "request_id": f"gdpo-clients-{normalization}",
        "estimator": {
            "outcome": {
                "name": "gdpo",
                "weights": {"format": 0.25},
                "normalization": normalization,
            }
        },
        "return": ["scalar"],
        "groups": groups,
    }


def rollouts(response: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for g in response["groups"] for r in g["rollouts"]]


@pytest.mark.parametrize("normalization", ["verl", "trl"])
def test_every_transport_answers_what_the_library_answers(service: Any, normalization: str) -> None:
    request = gdpo_request(normalization)
    want = compute(request, device="cpu")
    answers = {
        "json": HttpClient(service.url, wire="json").compute(request),
        "arrow": HttpClient(service.url).compute(request),
        "grpc": GrpcClient(service.target).compute(request),
    }
    for name, got in answers.items():
        assert got["estimator"]["outcome"] == want["estimator"]["outcome"], name
        for a, b in zip(rollouts(got), rollouts(want), strict=True):
            for key in ("advantages", "scalar"):
                np.testing.assert_allclose(a[key], b[key], rtol=1e-6, atol=1e-7, err_msg=name)
    # (not GRPO on the rewards: a gdpo answer has the components' spread)
    assert any(float(np.abs(r["advantages"]).max()) > 0.1 for r in rollouts(want))


def test_a_request_without_components_is_refused_on_every_transport(service: Any) -> None:
    request = {
        "estimator": "gdpo",
        "groups": [{"id": "a", "rollouts": [{"tokens": [5], "reward": r} for r in (0.0, 1.0)]}],
    }
    clients = {
        "json": HttpClient(service.url, wire="json"),
        "arrow": HttpClient(service.url),
        "grpc": GrpcClient(service.target),
    }
    for name, client in clients.items():
        with pytest.raises(AdvantageError) as caught:
            client.compute(request)
        assert caught.value.field == "reward_components", name
        assert caught.value.code == "missing_input", name
