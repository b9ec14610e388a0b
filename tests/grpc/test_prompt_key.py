"""``prompt_key``: KTAE history keyed by a stable prompt key instead of the group id, on every
wire (JSON, Arrow, gRPC unary and stream) and through both clients' ``compute_padded``.

Trainers name a group by an id that changes every step (verl: a fresh uuid4 per step), so a
prompt's second visit comes under a new group id. With the same ``prompt_key`` the second visit
reads the first visit's history (``summary.history == "applied"``); without it the history is
keyed by the new group id and is empty.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest
from advantage_client import AdvantageError, GrpcClient, HttpClient
from process_support import poll
from service_support import Service

pytestmark = pytest.mark.integration

ESTIMATOR = {"outcome": "grpo", "ktae": {"history": "prompt"}}
REWARDS = [1.0, 0.0, 1.0, 0.0]


def rollouts(seed: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    return [{"tokens": rng.integers(0, 20, size=6).tolist(), "reward": r} for r in REWARDS]


def request(namespace: str, group_id: str, prompt_key: str | None) -> dict[str, Any]:
    group: dict[str, Any] = {"id": group_id, "rollouts": rollouts(1)}
    if prompt_key is not None:
        group["prompt_key"] = prompt_key
    return {"namespace": namespace, "estimator": ESTIMATOR, "groups": [group]}


def counted(service: Service, namespace: str) -> int:
    response = service.http.get("/v1/stats/tokens", params={"namespace": namespace})
    return int(response.json()["rollouts_counted"]) if response.status_code == 200 else -1


def written(service: Service, namespace: str, rollouts: int) -> None:
    """Wait until the first visit's statistics (written after the answer) are stored."""
    poll(lambda: counted(service, namespace) >= rollouts, 30, "the first visit's writes")


def two_visits(
    service: Service, send: Callable[[str, str, str | None], str], key: str | None
) -> tuple[str, str]:
    """History outcomes of two visits of one prompt under two fresh group ids."""
    namespace = f"ns-{uuid.uuid4().hex[:12]}"
    first = send(namespace, f"uid-{uuid.uuid4()}", key)
    written(service, namespace, len(REWARDS))
    second = send(namespace, f"uid-{uuid.uuid4()}", key)
    return first, second


def send_json(service: Service) -> Callable[[str, str, str | None], str]:
    def send(namespace: str, gid: str, key: str | None) -> str:
        response = service.http.post("/v1/advantages", json=request(namespace, gid, key))
        assert response.status_code == 200, response.text
        return str(response.json()["summary"]["history"])

    return send


def send_client(client: Any) -> Callable[[str, str, str | None], str]:
    def send(namespace: str, gid: str, key: str | None) -> str:
        return str(client.compute(request(namespace, gid, key))["summary"]["history"])

    return send


def send_stream(service: Service) -> Callable[[str, str, str | None], str]:
    def send(namespace: str, gid: str, key: str | None) -> str:
        items = [
            {
                "group_id": gid,
                "group_size": len(REWARDS),
                **r,
                **({"prompt_key": key} if key is not None else {}),
            }
            for r in rollouts(1)
        ]
        with GrpcClient(service.target) as client:
            (result,) = list(client.stream(items, estimator=ESTIMATOR, namespace=namespace))
        assert "error" not in result, result
        return str(result["summary"]["history"])

    return send


def padded(seed: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    tokens = np.asarray([r["tokens"] for r in rollouts(seed)], dtype=np.int64)
    return tokens, np.ones_like(tokens, dtype=bool), np.asarray(REWARDS)


def send_padded(client: Any) -> Callable[[str, str, str | None], str]:
    """compute_padded has no summary: the history outcome is read off the advantages, against
    the in-process computation (which has no history) of the same batch. Each visit sends other
    rollouts of the prompt."""
    import advantage_service

    visits: dict[str, int] = {}

    def send(namespace: str, gid: str, key: str | None) -> str:
        visits[namespace] = visits.get(namespace, 0) + 1
        tokens, mask, rewards = padded(visits[namespace])
        result = client.compute_padded(
            tokens,
            mask,
            rewards,
            [gid] * len(rewards),
            estimator=ESTIMATOR,
            namespace=namespace,
            prompt_keys=None if key is None else [key] * len(rewards),
        )
        plain = advantage_service.compute_padded(
            tokens, mask, rewards, [gid] * len(rewards), estimator=ESTIMATOR
        )
        same = np.allclose(result.advantages, plain.advantages, rtol=1e-5, atol=1e-6)
        return "none" if same else "applied"

    return send


@pytest.mark.parametrize("wire", ["json", "arrow", "grpc", "stream"])
def test_the_same_prompt_key_under_new_group_ids_applies_history(
    service: Service, wire: str
) -> None:
    if wire == "json":
        send = send_json(service)
    elif wire == "arrow":
        send = send_client(HttpClient(service.url, wire="arrow"))
    elif wire == "grpc":
        send = send_client(GrpcClient(service.target))
    else:
        send = send_stream(service)
    assert two_visits(service, send, "prompt-17") == ("empty", "applied")
    # Without a key, history is keyed by the (new) group id: never applied.
    assert two_visits(service, send, None) == ("empty", "empty")


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_compute_padded_prompt_keys_apply_history(service: Service, transport: str) -> None:
    client = HttpClient(service.url) if transport == "http" else GrpcClient(service.target)
    with client:
        assert two_visits(service, send_padded(client), "prompt-17") == ("none", "applied")
        assert two_visits(service, send_padded(client), None) == ("none", "none")


def test_rows_of_a_group_with_different_keys_are_refused_naming_the_group(
    service: Service,
) -> None:
    tokens, mask, rewards = padded()
    keys = ["a", "a", "b", "a"]
    for client in (HttpClient(service.url), GrpcClient(service.target)):
        with client, pytest.raises(AdvantageError) as caught:
            client.compute_padded(
                tokens, mask, rewards, ["g"] * 4, estimator=ESTIMATOR, prompt_keys=keys
            )
        assert caught.value.group_id == "g" and caught.value.field == "prompt_key"
    # The Arrow column as another client would send it: the service's own 422.
    import pyarrow as pa

    table = pa.table(
        {
            "group_id": ["g"] * 4,
            "reward": REWARDS,
            "tokens": pa.array(tokens.tolist(), type=pa.list_(pa.int32())),
            "prompt_key": keys,
        }
    )
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    response = httpx.post(
        f"{service.url}/v1/advantages",
        content=sink.getvalue().to_pybytes(),
        headers={"content-type": "application/vnd.apache.arrow.stream"},
    )
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["group_id"] == "g" and error["field"] == "prompt_key"


def test_a_stream_rollout_with_another_key_than_its_group_is_refused(service: Service) -> None:
    items = [
        {"group_id": "g", "group_size": 2, "prompt_key": key, **r}
        for key, r in zip(["a", "b"], rollouts(2), strict=False)
    ]
    with GrpcClient(service.target) as client:
        (result,) = list(client.stream(items, estimator=ESTIMATOR))
    assert result["error"]["field"] == "prompt_key" and result["error"]["group_id"] == "g"


def test_bad_prompt_keys_are_request_errors(service: Service) -> None:
    base = request("default", "g", None)
    for key, status in ((17, 422), ("k" * 257, 413)):
        body = {**base, "groups": [{**base["groups"][0], "prompt_key": key}]}
        response = service.http.post("/v1/advantages", json=body)
        assert response.status_code == status, response.text
        assert response.json()["error"]["field"] == "prompt_key"
    with GrpcClient(service.target) as client:
        message_keys = ["a", "b"]  # two keys for one group
        from advantage_client.grpc_client import compute_request_message

        message = compute_request_message(base)
        message.prompt_keys.extend(message_keys)
        with pytest.raises(AdvantageError) as caught:
            client._unary(client.stub.Compute, message)
        assert caught.value.grpc_code == "INVALID_ARGUMENT"
        assert caught.value.field == "prompt_keys"


def test_in_process_compute_padded_checks_prompt_keys() -> None:
    import advantage_service

    tokens, mask, rewards = padded()
    result = advantage_service.compute_padded(
        tokens, mask, rewards, ["g"] * 4, estimator="ktae", prompt_keys=["k"] * 4
    )
    plain = advantage_service.compute_padded(tokens, mask, rewards, ["g"] * 4, estimator="ktae")
    np.testing.assert_array_equal(result.advantages, plain.advantages)
    with pytest.raises(advantage_service.RequestError) as caught:
        advantage_service.compute_padded(
            tokens, mask, rewards, ["g"] * 4, estimator="ktae", prompt_keys=["k", "k", "j", "k"]
        )
    assert caught.value.group_id == "g" and caught.value.field == "prompt_key"
