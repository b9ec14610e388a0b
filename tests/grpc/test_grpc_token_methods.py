"""Forking tokens and OTB over gRPC against a real service: entropy, sum_pi_squared and
is_weights as raw tensors (unary and stream) give the numbers of HTTP and in-process, and every
request error they add is located as over HTTP (group, rollout, field), on unary calls and on
streams."""

from __future__ import annotations

import json
import random
from typing import Any

import grpc
import numpy as np
import pytest
from advantage_client import AdvantageError, GrpcClient, HttpClient
from advantage_client.grpc_client import compute_request_message
from advantage_client.grpc_gen import advantage_pb2 as pb
from advantage_client.grpc_gen import advantage_pb2_grpc as pb_grpc
from advantage_service import compute as compute_in_process
from grpc_support import Service, diagnostics_for, random_request, stream_rollouts
from token_cases import ERROR_CASES, ERROR_IDS, token_request

pytestmark = pytest.mark.integration

ESTIMATORS = [
    "otb",
    "forking",
    {"outcome": "otb", "ktae": {}},
    {"outcome": "rloo", "cscr": {}, "forking": {"scope": "group"}},
]
IDS = ["otb", "forking", "otb+ktae", "rloo+cscr+forking(group)"]


def flat(response: dict[str, Any], key: str) -> np.ndarray:
    return np.concatenate(
        [
            np.atleast_1d(np.asarray(r[key], np.float32))
            for g in response["groups"]
            for r in g["rollouts"]
        ]
    )


@pytest.mark.parametrize("index", range(len(ESTIMATORS)), ids=IDS)
def test_unary_token_methods_equal_http_and_in_process(service: Service, index: int) -> None:
    estimator = ESTIMATORS[index]
    request = random_request(seed=20 + index, estimator=estimator)
    via_grpc = GrpcClient(service.target).compute(request)
    via_arrow = HttpClient(service.url).compute(request)
    in_process = compute_in_process(request, device="cpu")
    assert via_grpc["estimator"] == in_process["estimator"]
    for key in ["advantages", *request["return"]]:
        np.testing.assert_array_equal(flat(via_grpc, key), flat(via_arrow, key), err_msg=key)
        np.testing.assert_allclose(
            flat(via_grpc, key), flat(in_process, key), rtol=1e-6, atol=1e-6, err_msg=key
        )


def test_stream_carries_the_token_inputs_and_computes_each_group_alone(service: Service) -> None:
    estimator = {"outcome": "otb", "forking": {"rho": 0.5}}
    request = random_request(seed=5, estimator=estimator)
    rollouts = stream_rollouts(request["groups"])
    random.Random(5).shuffle(rollouts)
    returns = diagnostics_for(estimator)
    results = list(
        GrpcClient(service.target).stream(rollouts, estimator=estimator, returns=returns)
    )
    assert sorted(r["id"] for r in results) == sorted(g["id"] for g in request["groups"])
    for result in results:
        group = next(g for g in request["groups"] if g["id"] == result["id"])
        # Rollouts in arrival order: the group alone, in that order (scope request = the group).
        order = [int(r["rollout_id"].rsplit("/", 1)[1]) for r in result["rollouts"]]
        alone = compute_in_process(
            {
                "estimator": estimator,
                "return": returns,
                "groups": [{"id": group["id"], "rollouts": [group["rollouts"][i] for i in order]}],
            },
            device="cpu",
        )["groups"][0]
        for got, want in zip(result["rollouts"], alone["rollouts"], strict=True):
            for key in ("advantages", "forking_mask", "otb_baseline"):
                np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-6)
            assert got["scalar"] == pytest.approx(want["scalar"], rel=1e-6, abs=1e-6)


def located(error: dict[str, Any] | AdvantageError) -> tuple[Any, ...]:
    if isinstance(error, AdvantageError):
        return error.code, error.group_id, error.rollout_index, error.field
    return error["code"], error["group_id"], error["rollout_index"], error["field"]


@pytest.mark.parametrize("case", ERROR_CASES, ids=ERROR_IDS)
def test_unary_errors_are_located_as_over_http(service: Service, case: Any) -> None:
    """What the flat message cannot carry (values on some rollouts only, one rollout's values
    of the wrong length) the client refuses before sending, with the service's error; the
    rest the service refuses with INVALID_ARGUMENT and the error's location in metadata."""
    request = case.request()
    # (NaN and infinity are JSON Python reads, which httpx's json= refuses to write)
    http = service.http.post(
        "/v1/advantages",
        content=json.dumps(request),
        headers={"content-type": "application/json"},
    )
    assert http.status_code == 422
    assert located(http.json()["error"]) == case.expected
    try:
        message = compute_request_message(request)
    except AdvantageError as exc:
        assert located(exc) == case.expected
        assert exc.message == http.json()["error"]["message"]
        return
    with grpc.insecure_channel(service.target) as channel, pytest.raises(grpc.RpcError) as info:
        pb_grpc.AdvantageServiceStub(channel).Compute(message, timeout=30)
    error = info.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert error.details() == http.json()["error"]["message"]  # type: ignore[attr-defined]
    meta = dict(error.trailing_metadata())  # type: ignore[attr-defined]
    code, group_id, rollout_index, field = case.expected
    assert meta["advantage-error-code"] == code
    assert meta.get("advantage-group-id-bin", b"").decode() == (group_id or "")
    assert meta.get("advantage-rollout-index") == (
        None if rollout_index is None else str(rollout_index)
    )
    assert meta["advantage-field-bin"].decode() == field


def test_unary_flat_array_of_the_wrong_length_is_refused_by_the_service(service: Service) -> None:
    message = compute_request_message(token_request("forking"))
    entropy = np.frombuffer(message.entropy.data, "<f4")[:-1]
    message.entropy.CopyFrom(pb.Tensor(dtype=pb.DTYPE_FLOAT32, data=entropy.tobytes()))
    with grpc.insecure_channel(service.target) as channel, pytest.raises(grpc.RpcError) as info:
        pb_grpc.AdvantageServiceStub(channel).Compute(message, timeout=30)
    meta = dict(info.value.trailing_metadata())  # type: ignore[attr-defined]
    assert meta["advantage-error-code"] == "length_mismatch"
    assert meta["advantage-field-bin"] == b"entropy"


ROLLOUT_CASES = [c for c in ERROR_CASES if c.expected[1] is not None]


@pytest.mark.parametrize("case", ROLLOUT_CASES, ids=[c.name for c in ROLLOUT_CASES])
def test_stream_answers_a_bad_rollout_with_its_group_error(service: Service, case: Any) -> None:
    request = case.request()
    results = list(
        GrpcClient(service.target).stream(
            stream_rollouts(request["groups"]), estimator=case.estimator, returns=["scalar"]
        )
    )
    group_id = case.expected[1]
    errors = [r for r in results if "error" in r]
    assert [r["id"] for r in errors] == [group_id]
    assert located(errors[0]["error"]) == case.expected
    # The other group is computed as usual.
    assert [r["id"] for r in results if "error" not in r] == [
        g["id"] for g in request["groups"] if g["id"] != group_id
    ]


MISSING_CASES = [c for c in ERROR_CASES if c.expected[0] == "missing_input" and not c.expected[1]]


@pytest.mark.parametrize("case", MISSING_CASES, ids=[c.name for c in MISSING_CASES])
def test_stream_missing_input_is_an_error_of_every_group(service: Service, case: Any) -> None:
    request = case.request()
    results = list(
        GrpcClient(service.target).stream(
            stream_rollouts(request["groups"]), estimator=case.estimator
        )
    )
    assert sorted(r["id"] for r in results) == ["g0", "g1"]
    for result in results:
        assert result["error"]["code"] == case.expected[0] == "missing_input"
        assert result["error"]["field"] == case.expected[3]


def test_list_estimators_names_the_inputs(service: Service) -> None:
    listing = GrpcClient(service.target).list_estimators()
    outcomes = {o["name"]: o for o in listing["outcomes"]}
    terms = {t["name"]: t for t in listing["terms"]}
    assert outcomes["otb"]["inputs"] == ["logprobs", "sum_pi_squared"]
    assert outcomes["otb"]["optional_inputs"] == ["is_weights", "returns"]
    assert terms["forking"]["inputs"] == ["entropy"]
    assert {"otb", "forking"} <= set(listing["presets"])
    assert listing == service.http.get("/v1/estimators").json()
