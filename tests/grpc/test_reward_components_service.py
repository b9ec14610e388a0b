"""Named reward components against a real service (HTTP and gRPC on one process): the same
request over raw JSON, both clients (JSON, Arrow, gRPC unary, gRPC stream) and both clients'
``compute_padded`` gets the advantages of the request whose rewards are the oracle's sums, and
the summary's per-component statistics; a bound is refused with the same status and field on
each wire, sent as raw bytes (no client check in the way)."""

from __future__ import annotations

import math
import uuid
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from advantage_client import GrpcClient, HttpClient
from advantage_contract.arrow import request_table, stream_bytes
from advantage_contract.fields import MAX_REWARD_COMPONENTS
from advantage_contract.grpc_gen import advantage_pb2 as pb
from service_support import Service

pytestmark = pytest.mark.integration

COMPUTE = "/advantage.v1.AdvantageService/Compute"
ARROW = "application/vnd.apache.arrow.stream"
NAN = math.nan
ESTIMATOR = {"outcome": "grpo", "ktae": {}}  # (a token-level term: the gathered path too)
# (group, tokens, reward or None: their sum, components with None for no value)
ROLLOUTS = [
    ("g0", [1, 2, 3], None, {"format": 1.0, "accuracy": None}),
    ("g0", [4, 2], 0.25, {"format": 0.0, "accuracy": 1.0}),
    ("g0", [5, 6], None, {"format": 0.5, "accuracy": 0.0}),
    ("g1", [7, 1], None, {"format": None, "accuracy": 2.0}),
    ("g1", [8, 9, 3], -1.0, {"format": 1.0, "accuracy": None}),
]
# Each rollout's reward: given, else the sum of its values (the oracle).
REWARDS = [
    r if r is not None else sum(v for v in c.values() if v is not None) for *_, r, c in ROLLOUTS
]


def request(with_components: bool = True) -> dict[str, Any]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for (gid, tokens, reward, values), total in zip(ROLLOUTS, REWARDS, strict=True):
        rollout: dict[str, Any] = {"tokens": tokens}
        if with_components:
            rollout["reward_components"] = values
            if reward is not None:
                rollout["reward"] = reward
        else:
            rollout["reward"] = total
        groups.setdefault(gid, []).append(rollout)
    return {
        "request_id": f"components-{uuid.uuid4().hex}",
        "estimator": ESTIMATOR,
        "groups": [{"id": g, "rollouts": r} for g, r in groups.items()],
    }


def flat_advantages(response: dict[str, Any]) -> np.ndarray:
    by_group = {g["id"]: g["rollouts"] for g in response["groups"]}
    return np.concatenate(
        [np.asarray(r["advantages"], np.float32) for g in ("g0", "g1") for r in by_group[g]]
    )


def expected_stats() -> dict[str, dict[str, float]]:
    out = {}
    for name in ("format", "accuracy"):
        present = np.array([c[name] for *_, c in ROLLOUTS if c[name] is not None])
        out[name] = {"mean": float(present.mean()), "std": float(present.std(ddof=1))}
    return out


def check_summary(summary: dict[str, Any]) -> None:
    stats = summary["reward_components"]
    for name, want in expected_stats().items():
        assert stats[name] == pytest.approx(want), stats


def test_every_wire_computes_the_components_request_as_the_summed_rewards(
    service: Service,
) -> None:
    plain = service.http.post("/v1/advantages", json=request(with_components=False))
    assert plain.status_code == 200, plain.text
    expected = flat_advantages(plain.json())
    assert np.abs(expected).max() > 0
    assert "reward_components" not in plain.json()["summary"]

    answers: dict[str, dict[str, Any]] = {}
    raw = service.http.post("/v1/advantages", json=request())
    assert raw.status_code == 200, raw.text
    answers["raw json"] = raw.json()
    for wire in ("json", "arrow"):
        with HttpClient(service.url, wire=wire) as client:
            answers[f"http {wire}"] = client.compute(request())
    with GrpcClient(service.target) as client:
        answers["grpc"] = client.compute(request())
    for name, answer in answers.items():
        np.testing.assert_allclose(flat_advantages(answer), expected, rtol=1e-6, err_msg=name)
        check_summary(answer["summary"])


def test_the_stream_computes_each_group_with_its_summed_rewards(service: Service) -> None:
    items = []
    for gid, tokens, reward, values in ROLLOUTS:
        size = sum(1 for r in ROLLOUTS if r[0] == gid)
        item: dict[str, Any] = {
            "group_id": gid,
            "group_size": size,
            "tokens": tokens,
            "reward_components": values,
        }
        if reward is not None:
            item["reward"] = reward
        items.append(item)
    with GrpcClient(service.target) as client:
        results = {r["id"]: r for r in client.stream(items, estimator=ESTIMATOR)}
    for gid in ("g0", "g1"):
        assert "error" not in results[gid], results[gid]
        rows = [i for i, r in enumerate(ROLLOUTS) if r[0] == gid]
        single = {
            "estimator": ESTIMATOR,
            "groups": [
                {
                    "id": gid,
                    "rollouts": [{"tokens": ROLLOUTS[i][1], "reward": REWARDS[i]} for i in rows],
                }
            ],
        }
        plain = service.http.post("/v1/advantages", json=single).json()
        got = sorted(results[gid]["rollouts"], key=lambda r: r["rollout_index"])
        for rollout, want in zip(got, plain["groups"][0]["rollouts"], strict=True):
            np.testing.assert_allclose(rollout["advantages"], want["advantages"], rtol=1e-6)


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_both_clients_compute_padded_sends_the_components(service: Service, transport: str) -> None:
    import advantage_service

    width = max(len(r[1]) for r in ROLLOUTS)
    tokens = np.zeros((len(ROLLOUTS), width), np.int64)
    mask = np.zeros_like(tokens, dtype=bool)
    for i, (_, ids, _, _) in enumerate(ROLLOUTS):
        tokens[i, : len(ids)], mask[i, : len(ids)] = ids, True
    rewards = np.array([NAN if r[2] is None else r[2] for r in ROLLOUTS])
    components = {
        name: np.array([NAN if c[name] is None else c[name] for *_, c in ROLLOUTS])
        for name in ("format", "accuracy")
    }
    gids = [r[0] for r in ROLLOUTS]
    client = HttpClient(service.url) if transport == "http" else GrpcClient(service.target)
    with client:
        got = client.compute_padded(
            tokens, mask, rewards, gids, estimator=ESTIMATOR, reward_components=components
        )
    local = advantage_service.compute_padded(
        tokens, mask, np.array(REWARDS), gids, estimator=ESTIMATOR
    )
    np.testing.assert_allclose(got.advantages, local.advantages, rtol=1e-6, atol=1e-7)
    check_summary(got.summary)


# ---- a bound on every wire, as raw bytes -------------------------------------------------------

TOO_MANY = {f"c{i}": 1.0 for i in range(MAX_REWARD_COMPONENTS + 1)}
NO_REWARD = {"a": None}
CASES = {
    "more components than the limit": (
        TOO_MANY,
        1.0,
        413,
        "RESOURCE_EXHAUSTED",
        "reward_components",
    ),
    "neither a reward nor a value": (NO_REWARD, None, 422, "INVALID_ARGUMENT", "reward"),
}


def raw_json(components: dict[str, Any], reward: float | None) -> dict[str, Any]:
    rollouts = [
        {"tokens": [1, 2], "reward": 1.0, "reward_components": {k: 0.5 for k in components}}
    ]
    second: dict[str, Any] = {"tokens": [3], "reward_components": components}
    if reward is not None:
        second["reward"] = reward
    return {"groups": [{"id": "g", "rollouts": [*rollouts, second]}]}


def raw_arrow(components: dict[str, Any], reward: float | None) -> bytes:
    def column(last: float | None) -> np.ndarray:
        return np.array([0.5, NAN if last is None else last])

    table = request_table(
        group_ids=["g"],
        group_index=np.zeros(2, np.int64),
        offsets=np.array([0, 2, 3]),
        tokens=np.array([1, 2, 3], np.int32),
        rewards=np.array([1.0, NAN if reward is None else reward]),
        per_token={},
        teacher_logprobs={},
        reward_components={k: column(v) for k, v in components.items()},
    )
    return stream_bytes(table)


def raw_grpc(components: dict[str, Any], reward: float | None) -> bytes:
    def tensor(values: list[Any], wire: str, dtype: int) -> pb.Tensor:
        data = np.array([NAN if v is None else v for v in values], wire).tobytes()
        return pb.Tensor(dtype=dtype, data=data)

    message = pb.ComputeRequest(
        group_ids=["g"],
        group_index=tensor([0, 0], "<i8", pb.DTYPE_INT64),
        offsets=tensor([0, 2, 3], "<i8", pb.DTYPE_INT64),
        tokens=tensor([1, 2, 3], "<i8", pb.DTYPE_INT64),
        rewards=tensor([1.0, reward], "<f8", pb.DTYPE_FLOAT64),
    )
    for name, value in components.items():
        message.reward_components[name].CopyFrom(tensor([0.5, value], "<f8", pb.DTYPE_FLOAT64))
    return message.SerializeToString()


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_wire_of_the_service_refuses_a_bound_naming_the_field(
    service: Service, case: str
) -> None:
    components, reward, status, grpc_status, field = CASES[case]
    answers = [
        service.http.post("/v1/advantages", json=raw_json(components, reward)),
        service.http.post(
            "/v1/advantages",
            content=raw_arrow(components, reward),
            headers={"content-type": ARROW},
        ),
    ]
    for answer in answers:
        assert isinstance(answer, httpx.Response)
        assert answer.status_code == status, answer.text
        assert answer.json()["error"]["field"] == field, answer.text
    with grpc.insecure_channel(service.target) as channel:
        method = channel.unary_unary(COMPUTE, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as info:
            method(raw_grpc(components, reward), timeout=60)
    error: Any = info.value
    meta = dict(error.trailing_metadata())
    assert error.code().name == grpc_status, error
    assert meta["advantage-field-bin"] == field.encode(), meta
    if field == "reward":
        assert meta["advantage-group-id-bin"] == b"g"
        assert meta["advantage-rollout-index"] == "1"
