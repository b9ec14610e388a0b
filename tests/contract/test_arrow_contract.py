"""One Arrow request encoder (``advantage_contract.arrow``): the client's body and the service's
own table of the same batch are the same table, and the reward is float64 on both (the
service's encoder wrote float32, rounding an integer reward a client sent exactly)."""

from __future__ import annotations

import pyarrow as pa
from advantage_client.http_client import arrow_request_body
from advantage_service.transports import arrow


def request() -> dict:
    return {
        "request_id": "r-1",
        "estimator": "grpo",
        "groups": [
            {
                "id": "g",
                "prompt_key": "p",
                "rollouts": [
                    {"tokens": [1, 2, 3], "reward": 2**53 - 1, "logprobs": [-1.0, -0.5, -0.25]},
                    {"tokens": [4], "reward": 16777217, "logprobs": [-2.0]},
                ],
            }
        ],
    }


def test_the_clients_body_is_the_contracts_table() -> None:
    table = arrow.read_table(arrow_request_body(request()))
    assert table.schema.field("reward").type == pa.float64()
    assert table.column("reward").to_pylist() == [2**53 - 1, 16777217]
    assert table.column("prompt_key").to_pylist() == ["p", "p"]
    assert table.column("logprobs").to_pylist() == [[-1.0, -0.5, -0.25], [-2.0]]


def test_the_services_encoder_writes_the_same_columns_and_types() -> None:
    sent = arrow.read_table(arrow_request_body(request()))
    batch = arrow.batch_from_table(sent)
    again = arrow.request_table(batch, {"request_id": "r-1", "estimator": "grpo"})
    for name in ("group_id", "reward", "tokens", "logprobs"):
        assert again.schema.field(name).type == sent.schema.field(name).type, name
    assert again.column("reward").to_pylist() == [float(r) for r in batch.rewards.tolist()]
