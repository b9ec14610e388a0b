"""The wire-bytes check of a unary request (``transports.grpc_wire``) counts what protobuf would
parse: for random messages, and for two messages concatenated (which protobuf merges: a
tensor's last data and dtype win, map entries are replaced, repeated fields add up), a limit
at the parsed message's counts passes and one below is refused on the right field."""

from __future__ import annotations

from typing import Any

import pytest
from advantage_contract.grpc_gen import advantage_pb2 as pb
from advantage_service.errors import LimitExceeded, RequestError
from advantage_service.transports.grpc_wire import MessageLimits, check_compute_request
from hypothesis import given, settings
from hypothesis import strategies as st

ITEM_SIZES = {pb.DTYPE_INT32: 4, pb.DTYPE_INT64: 8, pb.DTYPE_FLOAT32: 4, pb.DTYPE_FLOAT64: 8}
ROOMY = 10**9


@st.composite
def tensors(draw: st.DrawFn) -> pb.Tensor | None:
    if not draw(st.booleans()):
        return None
    tensor = pb.Tensor(data=b"\x00" * draw(st.integers(0, 64)))
    if draw(st.integers(0, 4)):  # (sometimes no dtype: a merge keeps the earlier one)
        tensor.dtype = draw(st.sampled_from([0, 1, 2, 3, 4, 9]))
    return tensor


@st.composite
def messages(draw: st.DrawFn) -> pb.ComputeRequest:
    message = pb.ComputeRequest(group_ids=draw(st.lists(st.sampled_from(["a", "b"]), max_size=3)))
    for name in ("tokens", "offsets", "group_index", "rewards", "logprobs", "entropy"):
        tensor = draw(tensors())
        if tensor is not None:
            getattr(message, name).CopyFrom(tensor)
    for key in draw(st.lists(st.sampled_from(["pos", "neg"]), max_size=2)):
        tensor = draw(tensors())
        message.teacher_logprobs[key].CopyFrom(tensor if tensor is not None else pb.Tensor())
    return message


def count(message: Any, name: str) -> int:
    tensor = getattr(message, name)
    size = ITEM_SIZES.get(tensor.dtype)
    return len(tensor.data) // size if size else 0


@settings(max_examples=300, deadline=None)
@given(first=messages(), second=messages())
def test_the_wire_counts_are_the_parsed_messages(
    first: pb.ComputeRequest, second: pb.ComputeRequest
) -> None:
    data = first.SerializeToString() + second.SerializeToString()
    parsed = pb.ComputeRequest.FromString(data)
    rollouts = max(
        count(parsed, "rewards"), count(parsed, "group_index"), count(parsed, "offsets") - 1
    )
    tokens = count(parsed, "tokens")
    per_token = [count(parsed, "logprobs"), count(parsed, "entropy")]
    per_token += [
        len(t.data) // ITEM_SIZES[t.dtype] if t.dtype in ITEM_SIZES else 0
        for t in parsed.teacher_logprobs.values()
    ]
    groups = len(parsed.group_ids)
    rollout_limit = max(rollouts, groups, 1)
    token_limit = max([tokens, *per_token])
    check_compute_request(data, MessageLimits(token_limit, rollout_limit, ROOMY))
    if rollouts > groups:
        with pytest.raises(LimitExceeded) as info:
            check_compute_request(data, MessageLimits(ROOMY, rollouts - 1, ROOMY))
        assert info.value.field == "rollouts"
    if tokens:
        with pytest.raises(LimitExceeded) as info:
            check_compute_request(data, MessageLimits(tokens - 1, ROOMY, ROOMY))
        assert info.value.field == "tokens"


def test_a_message_cut_short_is_invalid_protobuf_not_a_crash() -> None:
    data = pb.ComputeRequest(
        group_ids=["abc"], tokens=pb.Tensor(dtype=1, data=b"1234")
    ).SerializeToString()
    for end in range(1, len(data)):
        try:
            check_compute_request(data[:end], MessageLimits(ROOMY, ROOMY, ROOMY))
        except RequestError as exc:
            assert (exc.code, exc.field) == ("invalid_protobuf", "message")
