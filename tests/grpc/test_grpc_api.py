"""The gRPC API against a real service process: unary parity with HTTP and in-process for every
preset, error statuses with their metadata, ListEstimators, health, reflection, metrics."""

from __future__ import annotations

import json
from typing import Any

import grpc
import numpy as np
import pytest
from advantage_client import AdvantageError, GrpcClient, HttpClient
from advantage_client.grpc_client import compute_request_message
from advantage_contract.grpc_gen import advantage_pb2 as pb
from advantage_contract.grpc_gen import advantage_pb2_grpc as pb_grpc
from advantage_service import compute as compute_in_process
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_support import ALL_PRESETS, random_request
from service_support import Service, health_status

pytestmark = pytest.mark.integration


def rollouts_of(response: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(g["id"], r) for g in response["groups"] for r in g["rollouts"]]


def assert_same_results(a: dict[str, Any], b: dict[str, Any], exact: bool) -> None:
    assert [g["id"] for g in a["groups"]] == [g["id"] for g in b["groups"]]
    for (gid_a, ra), (gid_b, rb) in zip(rollouts_of(a), rollouts_of(b), strict=True):
        assert gid_a == gid_b and set(ra) == set(rb)
        for key in ra:
            x, y = np.asarray(ra[key], dtype=np.float32), np.asarray(rb[key], dtype=np.float32)
            if exact:
                np.testing.assert_array_equal(x, y, err_msg=f"{gid_a} {key}")
            else:
                np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6, err_msg=f"{gid_a} {key}")


@pytest.mark.parametrize("preset", ALL_PRESETS)
def test_unary_results_equal_http_and_in_process_for_every_preset(
    service: Service, preset: str
) -> None:
    request = random_request(seed=ALL_PRESETS.index(preset), estimator=preset)
    via_grpc = GrpcClient(service.target).compute(request)
    via_json = HttpClient(service.url, wire="json").compute(request)
    via_arrow = HttpClient(service.url).compute(request)
    in_process = compute_in_process(request, device="cpu")

    for other in (via_json, via_arrow):
        assert_same_results(via_grpc, other, exact=True)
    assert_same_results(via_grpc, in_process, exact=False)
    assert via_grpc["request_id"] == request["request_id"]
    assert via_grpc["estimator"] == in_process["estimator"] == via_json["estimator"]
    summary = {k: v for k, v in via_grpc["summary"].items() if k != "compute_ms"}
    assert summary == {k: v for k, v in via_json["summary"].items() if k != "compute_ms"}
    assert summary["recorded"] is True  # Summary.recorded: the service took its statistics


def test_estimator_object_travels_as_the_same_json_as_http(service: Service) -> None:
    estimator = {"outcome": {"name": "rloo"}, "ktae": {}, "clip": 1.5}
    request = random_request(seed=41, estimator=estimator)
    via_grpc = GrpcClient(service.target).compute(request)
    via_json = HttpClient(service.url, wire="json").compute(request)
    assert_same_results(via_grpc, via_json, exact=True)
    assert via_grpc["estimator"]["clip"] == 1.5


def test_float64_tokens_and_rewards_in_any_wire_dtype_give_the_same_numbers(
    service: Service,
) -> None:
    request = random_request(seed=7, estimator="ktae")
    message = compute_request_message(request)
    # Re-encode every array in the other width: int64 ids and group index, float64 logprobs.
    tokens = np.frombuffer(message.tokens.data, "<i4").astype("<i8")
    message.tokens.CopyFrom(pb.Tensor(dtype=pb.DTYPE_INT64, data=tokens.tobytes()))
    logprobs = np.frombuffer(message.logprobs.data, "<f4").astype("<f8")
    message.logprobs.CopyFrom(pb.Tensor(dtype=pb.DTYPE_FLOAT64, data=logprobs.tobytes()))
    with grpc.insecure_channel(service.target) as channel:
        wide = pb_grpc.AdvantageServiceStub(channel).Compute(message, timeout=30)
    narrow = GrpcClient(service.target).compute(request)
    adv = np.frombuffer(wide.advantages.data, "<f4")
    np.testing.assert_array_equal(
        adv, np.concatenate([r["advantages"] for _, r in rollouts_of(narrow)])
    )


def call_error(target: str, message: pb.ComputeRequest) -> grpc.RpcError:
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.AdvantageServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Compute(message, timeout=30)
    return info.value


def metadata_of(error: grpc.RpcError) -> dict[str, Any]:
    return dict(error.trailing_metadata())  # type: ignore[attr-defined]


def test_invalid_request_is_invalid_argument_with_http_message_and_location(
    service: Service,
) -> None:
    request = random_request(seed=3)
    request["groups"][1]["rollouts"][1]["tokens"] = [5, -2]
    request["groups"][1]["rollouts"][1]["logprobs"] = [-0.1, -0.2]
    for name in ("pos", "neg"):
        request["groups"][1]["rollouts"][1]["teacher_logprobs"][name] = [-0.1, -0.2]
    error = call_error(service.target, compute_request_message(request))
    http = service.http.post("/v1/advantages", json=request)
    assert http.status_code == 422
    detail = http.json()["error"]

    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert error.details() == detail["message"]  # type: ignore[attr-defined]
    meta = metadata_of(error)
    assert meta["advantage-error-code"] == detail["code"] == "token_out_of_range"
    assert meta["advantage-group-id-bin"].decode() == detail["group_id"] == "prompt-3-1"
    assert int(meta["advantage-rollout-index"]) == detail["rollout_index"] == 1
    assert meta["advantage-field-bin"] == b"tokens"


def test_wire_format_errors_name_the_array(service: Service) -> None:
    message = compute_request_message(random_request(seed=4))
    message.rewards.data = message.rewards.data[:-3]
    error = call_error(service.target, message)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert metadata_of(error)["advantage-field-bin"] == b"rewards"

    message = compute_request_message(random_request(seed=4))
    message.tokens.dtype = pb.DTYPE_FLOAT32
    error = call_error(service.target, message)
    assert metadata_of(error)["advantage-error-code"] == "invalid_type"

    message = compute_request_message(random_request(seed=4))
    message.ClearField("offsets")
    error = call_error(service.target, message)
    assert metadata_of(error)["advantage-error-code"] == "missing_input"

    message = compute_request_message(random_request(seed=4))
    message.options.estimator_json = "{not json"
    error = call_error(service.target, message)
    assert metadata_of(error)["advantage-field-bin"] == b"estimator_json"


def test_client_raises_the_service_error_with_its_location(service: Service) -> None:
    request = random_request(seed=5, estimator="opsd")
    request["groups"][0]["rollouts"][0]["reward"] = float("nan")
    with pytest.raises(AdvantageError) as info:
        GrpcClient(service.target).compute(request)
    error = info.value
    assert (error.code, error.group_id, error.rollout_index, error.field) == (
        "invalid_value",
        "prompt-5-0",
        0,
        "reward",
    )
    assert error.grpc_code == "INVALID_ARGUMENT"


def test_over_the_limits_is_resource_exhausted_with_http_message(
    limited_service: Service,
) -> None:
    groups = [{"id": "big", "rollouts": [{"tokens": list(range(200)), "reward": 1.0}] * 2}]
    request = {"estimator": "grpo", "groups": groups}
    error = call_error(limited_service.target, compute_request_message(request))
    http = limited_service.http.post("/v1/advantages", json=request)
    assert http.status_code == 413
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
    assert error.details() == http.json()["error"]["message"]  # type: ignore[attr-defined]
    assert metadata_of(error)["advantage-error-code"] == "limit_exceeded"

    # Over ADV_MAX_BODY_BYTES: gRPC itself refuses the message, with the same status.
    huge = {"groups": [{"id": "x", "rollouts": [{"tokens": [1] * 60_000, "reward": 1.0}]}]}
    error = call_error(limited_service.target, compute_request_message(huge))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]


def test_list_estimators_is_the_http_listing(service: Service) -> None:
    with grpc.insecure_channel(service.target) as channel:
        listing = pb_grpc.AdvantageServiceStub(channel).ListEstimators(
            pb.ListEstimatorsRequest(), timeout=10
        )
    http = service.http.get("/v1/estimators").json()
    assert json.loads(listing.listing_json) == http
    assert list(listing.presets) == ALL_PRESETS
    assert listing.default_preset == http["default"]
    assert list(listing.diagnostics) == http["diagnostics"]
    assert GrpcClient(service.target).list_estimators() == http


def test_health_reports_serving_for_the_server_and_the_service(service: Service) -> None:
    serving = health_pb2.HealthCheckResponse.SERVING
    assert health_status(service.target) == serving
    assert health_status(service.target, "advantage.v1.AdvantageService") == serving


def test_reflection_lists_the_service_and_serves_its_file(service: Service) -> None:
    with grpc.insecure_channel(service.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        requests = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(
                file_containing_symbol="advantage.v1.AdvantageService"
            ),
        ]
        listed, files = list(stub.ServerReflectionInfo(iter(requests), timeout=10))
    names = {s.name for s in listed.list_services_response.service}
    assert {"advantage.v1.AdvantageService", "grpc.health.v1.Health"} <= names
    assert files.file_descriptor_response.file_descriptor_proto


def test_grpc_requests_are_counted_with_transport_grpc(service: Service) -> None:
    def count(code: str) -> float:
        return sum(
            value
            for (name, labels), value in service.metrics().items()
            if name == "advantage_requests_total"
            and dict(labels).get("transport") == "grpc"
            and dict(labels).get("code") == code
        )

    ok, bad = count("200"), count("422")
    client = GrpcClient(service.target)
    client.compute(random_request(seed=11))
    with pytest.raises(AdvantageError):
        client.compute({"estimator": "no-such-preset", "groups": random_request(1)["groups"]})
    assert count("200") == ok + 1
    assert count("422") == bad + 1
    samples = service.metrics()
    assert any(
        name == "advantage_request_duration_seconds_count" and dict(labels)["transport"] == "grpc"
        for name, labels in samples
    )


def test_deeply_nested_estimator_json_is_invalid_argument_not_internal(service: Service) -> None:
    """A RecursionError in the JSON of the options (Compute and StreamCompute) is the client's
    mistake: INVALID_ARGUMENT invalid_json, never INTERNAL. (Deep enough for json's recursion
    limit, within the 16 KiB an estimator_json may have.)"""
    deep = "[" * 5_000 + "]" * 5_000
    message = compute_request_message(random_request(seed=4))
    message.options.estimator_json = deep
    error = call_error(service.target, message)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert metadata_of(error)["advantage-error-code"] == "invalid_json"
    with grpc.insecure_channel(service.target) as channel:
        stub = pb_grpc.AdvantageServiceStub(channel)
        options = pb.StreamRequest(options=pb.ComputeOptions(estimator_json=deep))
        with pytest.raises(grpc.RpcError) as raw:
            list(stub.StreamCompute(iter([options]), timeout=30))
    assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
