"""The JSON answer lists each group's own rollouts, in the order they came, also when the rows
of a group were not adjacent in the request (an Arrow table's rows may interleave groups)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from advantage_service import compute
from advantage_service.serving.compute import compute_request
from advantage_service.transports import arrow
from advantage_service.wire.response import build_response


def interleaved_body() -> bytes:
    table = pa.table(
        {
            "group_id": ["ga", "gb", "ga", "gb", "ga"],
            "reward": [1.0, 0.0, 0.0, 1.0, 0.5],
            "tokens": [[1, 2], [3], [4, 5, 6], [7, 8], [9]],
        },
        schema=pa.schema(
            [("group_id", pa.string()), ("reward", pa.float64()), ("tokens", pa.list_(pa.int32()))],
            metadata={b"advantage.request": b'{"estimator": "ktae", "return": ["scalar"]}'},
        ),
    )
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def test_interleaved_groups_come_back_each_with_its_own_rollouts() -> None:
    req = arrow.decode_request(interleaved_body())
    got = build_response(req, compute_request(req, "cpu"), {})
    expected = compute(
        {
            "estimator": "ktae",
            "return": ["scalar"],
            "groups": [
                {
                    "id": "ga",
                    "rollouts": [
                        {"tokens": [1, 2], "reward": 1.0},
                        {"tokens": [4, 5, 6], "reward": 0.0},
                        {"tokens": [9], "reward": 0.5},
                    ],
                },
                {
                    "id": "gb",
                    "rollouts": [
                        {"tokens": [3], "reward": 0.0},
                        {"tokens": [7, 8], "reward": 1.0},
                    ],
                },
            ],
        },
        device="cpu",
    )
    assert [g["id"] for g in got["groups"]] == ["ga", "gb"]
    for g_got, g_exp in zip(got["groups"], expected["groups"], strict=True):
        assert len(g_got["rollouts"]) == len(g_exp["rollouts"])
        for r_got, r_exp in zip(g_got["rollouts"], g_exp["rollouts"], strict=True):
            np.testing.assert_array_equal(r_got["advantages"], r_exp["advantages"])
            assert r_got["scalar"] == r_exp["scalar"]
