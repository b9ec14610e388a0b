"""Requests computed over gRPC are kept for the viewer as HTTP's are: a unary Compute and each
group of a StreamCompute are listed and open in the viewer's JSON routes, with the JSON answer
HTTP would have sent."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from advantage_client import GrpcClient
from viewer.conftest import KEEP, TOKENS
from viewer.viewer_support import KTAE_RETURNS, ktae_request

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "grpc"))

from grpc_support import stream_rollouts
from service_support import Service

pytestmark = pytest.mark.integration

TOKEN = "viewer-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
NAMESPACE = {"namespace": "team-a"}


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """A service keeping requests for the viewer, with its gRPC port (its own: the viewer's
    shared server is reached over HTTP only)."""
    directory = tmp_path_factory.mktemp("viewer-grpc")
    tokens_file = directory / "tokens.json"
    tokens_file.write_text(json.dumps({"tokens": TOKENS}))
    srv = Service.start(directory, auth_tokens_file=str(tokens_file), viewer_keep=KEEP)
    yield srv
    srv.stop()


def listed(service: Service) -> list[dict[str, Any]]:
    answer = service.http.get("/viewer/api/recent", params=NAMESPACE, headers=AUTH)
    assert answer.status_code == 200, answer.text
    requests: list[dict[str, Any]] = answer.json()["requests"]
    return requests


def opened(service: Service, request_id: str) -> dict[str, Any]:
    answer = service.http.get(f"/viewer/api/requests/{request_id}", params=NAMESPACE, headers=AUTH)
    assert answer.status_code == 200, answer.text
    kept: dict[str, Any] = answer.json()
    return kept


def tokens_of(groups: list[dict[str, Any]]) -> list[list[int]]:
    return [list(r["tokens"]) for g in groups for r in g["rollouts"]]


def test_a_unary_grpc_request_is_listed_and_opens_with_its_json_answer(service: Service) -> None:
    request = ktae_request("grpc-unary-1", seed=11)
    with GrpcClient(service.target, token=TOKEN) as client:
        via_grpc = client.compute(request)

    entry = next(r for r in listed(service) if r["request_id"] == "grpc-unary-1")
    assert entry["groups"] == 2 and entry["rollouts"] == 8
    kept = opened(service, "grpc-unary-1")
    assert tokens_of(kept["request"]["groups"]) == tokens_of(request["groups"])
    # Kept as the JSON HTTP sends for the same request (gRPC answers in protobuf).
    as_json = service.http.post(
        "/v1/advantages", json={**request, "request_id": "grpc-unary-1-json"}, headers=AUTH
    ).json()
    assert kept["response"]["groups"] == as_json["groups"]
    assert kept["response"]["request_id"] == "grpc-unary-1"
    for got, want in zip(
        (r for g in kept["response"]["groups"] for r in g["rollouts"]),
        (r for g in via_grpc["groups"] for r in g["rollouts"]),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(got["advantages"], np.float32), want["advantages"])


def test_each_group_of_a_grpc_stream_is_listed_and_opens(service: Service) -> None:
    groups = ktae_request("unused", seed=12)["groups"]
    for group in groups:
        group["id"] = f"grpc-stream-{group['id']}"
    with GrpcClient(service.target, token=TOKEN) as client:
        results = list(
            client.stream(
                stream_rollouts(groups),
                estimator="ktae",
                namespace="team-a",
                returns=KTAE_RETURNS,
            )
        )
    assert len(results) == len(groups) and all("error" not in r for r in results)

    ids = {r["request_id"] for r in listed(service)}
    for result in results:
        assert result["request_id"] in ids, result["id"]
        kept = opened(service, result["request_id"])
        sent = next(g for g in groups if g["id"] == result["id"])
        assert [g["id"] for g in kept["request"]["groups"]] == [sent["id"]]
        assert tokens_of(kept["request"]["groups"]) == tokens_of([sent])
        answered = kept["response"]["groups"][0]["rollouts"]
        for got, want in zip(answered, result["rollouts"], strict=True):
            np.testing.assert_array_equal(
                np.asarray(got["advantages"], np.float32), want["advantages"]
            )
