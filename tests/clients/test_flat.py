"""Request dicts to the flat wire arrays and responses back, without a service."""

from __future__ import annotations

import numpy as np
import pytest
from advantage_client import AdvantageError
from advantage_client.grpc_client import (
    compute_request_message,
    compute_response_dict,
    from_tensor,
    rollout_message,
    to_tensor,
)
from advantage_contract.flat import flatten_groups, nest_rows
from advantage_contract.grpc_gen import advantage_pb2 as pb


def test_groups_flatten_to_the_service_layout() -> None:
    flat = flatten_groups(
        [
            {"id": "a", "rollouts": [{"tokens": [1, 2], "reward": 1}, {"tokens": [], "reward": 0}]},
            {"id": "b", "rollouts": [{"tokens": np.array([7], np.int64), "reward": 0.5}]},
        ]
    ).for_wire()
    assert flat.group_ids == ["a", "b"]
    np.testing.assert_array_equal(flat.offsets, [0, 2, 2, 3])
    np.testing.assert_array_equal(flat.group_index, [0, 0, 1])
    np.testing.assert_array_equal(flat.tokens, [1, 2, 7])
    assert flat.tokens.dtype == np.int32 and flat.rewards.dtype == np.float64
    assert flat.logprobs is None and flat.teacher_logprobs == {}


def test_token_ids_beyond_int32_travel_as_int64() -> None:
    flat = flatten_groups([{"id": "a", "rollouts": [{"tokens": [2**33], "reward": 1}]}])
    assert flat.for_wire().tokens.dtype == np.int64


def test_lists_and_arrays_flatten_to_the_same_values() -> None:
    def group(make) -> list:
        rollouts = [
            {
                "tokens": make([5, 6], np.int32),
                "reward": 1,
                "logprobs": make([-0.5, -1], np.float32),
            },
            {
                "tokens": make([7], np.int64),
                "reward": 0,
                "logprobs": make([-2.0], np.float64),
                "teacher_logprobs": {"p": make([-0.25], np.float32)},
            },
        ]
        rollouts[0]["teacher_logprobs"] = {"p": make([-1, -3], np.int64)}
        return [{"id": "g", "rollouts": rollouts}]

    from_lists = flatten_groups(group(lambda v, dtype: v))
    from_arrays = flatten_groups(group(np.array))
    assert from_lists.tokens.dtype == np.int64 and from_lists.logprobs.dtype == np.float64
    for flat in (from_lists.for_wire(), from_arrays.for_wire()):
        np.testing.assert_array_equal(flat.tokens, [5, 6, 7])
        assert flat.tokens.dtype == np.int32
        np.testing.assert_array_equal(flat.logprobs, np.float32([-0.5, -1, -2]))
        np.testing.assert_array_equal(flat.teacher_logprobs["p"], np.float32([-1, -3, -0.25]))
        assert flat.logprobs.dtype == flat.teacher_logprobs["p"].dtype == np.float32


@pytest.mark.parametrize(
    ("rollouts", "code", "field", "index"),
    [
        (
            [{"tokens": [1], "reward": 1, "logprobs": [-1.0]}, {"tokens": [1], "reward": 0}],
            "missing_input",
            "logprobs",
            1,
        ),
        ([{"tokens": [1, 2], "reward": 1, "logprobs": [-1.0]}], "length_mismatch", "logprobs", 0),
        ([{"tokens": [1.5], "reward": 1}], "invalid_type", "tokens", 0),
        (
            [{"tokens": [1], "reward": 1}, {"tokens": np.array([1.5]), "reward": 1}],
            "invalid_type",
            "tokens",
            1,
        ),
        ([{"tokens": np.zeros((1, 2), np.int32), "reward": 1}], "invalid_shape", "tokens", 0),
        ([{"tokens": [1], "reward": True}], "invalid_type", "reward", 0),
        ([{"tokens": [1], "reward": 10**400}], "invalid_value", "reward", 0),
        ([{"tokens": [1], "reward": 1, "logprob": []}], "unknown_field", "logprob", 0),
        (
            [{"tokens": [1, 2], "reward": 1, "logprobs": [[-1.0], -2]}],
            "invalid_type",
            "logprobs",
            0,
        ),
        ([{"reward": 1}], "invalid_type", "tokens", 0),
    ],
)
def test_what_the_flat_layout_cannot_carry_is_named_before_sending(
    rollouts: list, code: str, field: str, index: int
) -> None:
    with pytest.raises(AdvantageError) as info:
        flatten_groups([{"id": "g", "rollouts": rollouts}])
    assert (info.value.code, info.value.field, info.value.group_id) == (code, field, "g")
    assert info.value.rollout_index == index


def test_tensors_are_little_endian_bytes_with_their_dtype() -> None:
    for values, dtype in [
        (np.array([1, -2], np.int32), pb.DTYPE_INT32),
        (np.array([1, 2**40], np.int64), pb.DTYPE_INT64),
        (np.array([0.5], np.float32), pb.DTYPE_FLOAT32),
        (np.array([0.1], np.float64), pb.DTYPE_FLOAT64),
        (np.array([1, 2], ">i4"), pb.DTYPE_INT32),
        (np.array([1, 2], np.int16), pb.DTYPE_INT64),
    ]:
        tensor = to_tensor(values)
        assert tensor.dtype == dtype
        np.testing.assert_array_equal(from_tensor(tensor), values)
    assert to_tensor(np.array([1], np.int32)).data == b"\x01\x00\x00\x00"


def test_request_and_response_round_trip_through_messages() -> None:
    request = {
        "request_id": "r1",
        "namespace": "ns",
        "estimator": {"outcome": "rloo", "ktae": {}},
        "return": ["scalar"],
        "vocab_size": 100,
        "ignore_token_ids": [0],
        "groups": [
            {
                "id": "a",
                "rollouts": [{"tokens": [1, 2], "reward": 1, "teacher_logprobs": {"p": [-1, -2]}}],
            },
        ],
    }
    message = compute_request_message(request)
    assert message.options.estimator_json == '{"outcome": "rloo", "ktae": {}}'
    assert message.options.vocab_size == 100 and list(message.options.returns) == ["scalar"]
    np.testing.assert_array_equal(from_tensor(message.teacher_logprobs["p"]), [-1, -2])
    with pytest.raises(AdvantageError, match="unknown request field"):
        compute_request_message({"groups": [], "retrun": ["scalar"]})

    response = pb.ComputeResponse(
        request_id="r1",
        namespace="ns",
        estimator_json='{"outcome": {"name": "rloo"}}',
        group_ids=["a", "b"],
        group_index=to_tensor(np.array([1, 0, 1])),
        offsets=to_tensor(np.array([0, 1, 3, 4])),
        advantages=to_tensor(np.array([1, 2, 2, 3], np.float32)),
        scalars=to_tensor(np.array([1, 2, 3], np.float32)),
        summary=pb.Summary(tokens=4, rollouts=3, groups=2, device="cpu", history="none"),
    )
    out = compute_response_dict(response)
    assert [g["id"] for g in out["groups"]] == ["a", "b"]
    assert [r["scalar"] for r in out["groups"][1]["rollouts"]] == [1.0, 3.0]
    np.testing.assert_array_equal(out["groups"][0]["rollouts"][0]["advantages"], [2, 2])
    assert out["summary"]["tokens"] == 4


def test_nest_rows_keeps_request_order_within_groups() -> None:
    rows = [{"i": i} for i in range(4)]
    nested = nest_rows(["x", "y"], np.array([1, 0, 1, 0]), rows)
    assert nested == [
        {"id": "x", "rollouts": [{"i": 1}, {"i": 3}]},
        {"id": "y", "rollouts": [{"i": 0}, {"i": 2}]},
    ]


def test_stream_rollout_dicts_are_checked() -> None:
    message = rollout_message(
        {"group_id": "g", "group_size": 2, "rollout_id": 7, "tokens": [1], "reward": 0}
    )
    assert message.rollout_id == "7" and message.HasField("reward")
    for bad, field in [
        ({"group_id": "g", "group_size": 0, "tokens": [1], "reward": 0}, "group_size"),
        ({"group_size": 2, "tokens": [1], "reward": 0}, "group_id"),
        ({"group_id": "g", "group_size": 2, "tokens": [1], "reward": 0, "text": "x"}, "text"),
    ]:
        with pytest.raises(AdvantageError) as info:
            rollout_message(bad)
        assert info.value.field == field
