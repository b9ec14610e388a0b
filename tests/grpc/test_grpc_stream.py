"""StreamCompute against a real service process: group assembly from interleaved rollouts,
per-group errors, incomplete groups at half-close, per-stream limits, cancellation."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from advantage_client import AdvantageError, GrpcClient, to_padded
from advantage_client.grpc_client import options_message, rollout_message
from advantage_contract.grpc_gen import advantage_pb2 as pb
from advantage_contract.grpc_gen import advantage_pb2_grpc as pb_grpc
from advantage_service import RequestError
from advantage_service import compute as compute_in_process
from grpc_support import diagnostics_for, random_groups, stream_rollouts
from process_support import poll
from service_support import Service

pytestmark = pytest.mark.integration

PENDING = "advantage_stream_pending_groups"
OPEN = "advantage_stream_open"


def alone(group_id: str, rollouts: list[dict[str, Any]], estimator: str) -> dict[str, Any]:
    """The group computed by itself in-process, rollouts in the order given."""
    request = {
        "estimator": estimator,
        "return": diagnostics_for(estimator),
        "groups": [
            {
                "id": group_id,
                "rollouts": [
                    {k: r[k] for k in ("tokens", "reward", "logprobs", "teacher_logprobs")}
                    for r in rollouts
                ],
            }
        ],
    }
    return compute_in_process(request, device="cpu")["groups"][0]


@pytest.mark.parametrize("estimator", ["grpo", "ktae", "cscr", "opsd", "rloo"])
def test_interleaved_stream_returns_each_group_once_complete_and_as_computed_alone(
    service: Service, estimator: str
) -> None:
    groups = random_groups(seed=len(estimator), groups=6, prefix=f"s-{estimator}")
    rollouts = stream_rollouts(groups)
    random.Random(estimator).shuffle(rollouts)

    results = list(
        GrpcClient(service.target).stream(
            rollouts, estimator=estimator, returns=diagnostics_for(estimator)
        )
    )

    assert sorted(r["id"] for r in results) == sorted(g["id"] for g in groups)
    for result in results:
        assert "error" not in result, result
        arrived = [r for r in rollouts if r["group_id"] == result["id"]]
        assert [r["rollout_id"] for r in result["rollouts"]] == [r["rollout_id"] for r in arrived]
        assert [r["rollout_index"] for r in result["rollouts"]] == list(range(len(arrived)))
        expected = alone(result["id"], arrived, estimator)
        for got, want in zip(result["rollouts"], expected["rollouts"], strict=True):
            for key, value in want.items():
                np.testing.assert_allclose(got[key], value, rtol=1e-6, atol=1e-6, err_msg=key)
        assert result["summary"]["rollouts"] == len(arrived)

    # The padded layout in the trainer's row order (the order the rollouts were sent in).
    order = [r["rollout_id"] for r in rollouts]
    values, mask = to_padded(results, order=order, max_len=64)
    assert values.shape == (len(rollouts), 64)
    np.testing.assert_array_equal(mask.sum(axis=1), [len(r["tokens"]) for r in rollouts])


def test_group_errors_mid_stream_leave_the_other_groups_and_the_stream_alive(
    service: Service,
) -> None:
    groups = random_groups(seed=21, groups=4, prefix="mid")
    good = stream_rollouts(groups)
    bad_logprobs = [r for r in good if r["group_id"] == "mid-21-1"]
    bad_logprobs[1]["logprobs"] = [*bad_logprobs[1]["logprobs"], -0.5]  # one too many
    bad_reward = [r for r in good if r["group_id"] == "mid-21-2"]
    bad_reward[0]["reward"] = float("inf")
    rollouts = good + [
        {
            "group_id": "short",
            "group_size": 3,
            "rollout_id": f"short/{i}",
            "tokens": [1, 2],
            "reward": 1.0,
        }
        for i in range(2)
    ]
    random.Random(5).shuffle(rollouts)

    results = {r["id"]: r for r in GrpcClient(service.target).stream(rollouts, estimator="grpo")}

    assert set(results) == {g["id"] for g in groups} | {"short"}
    assert "rollouts" in results["mid-21-0"] and "rollouts" in results["mid-21-3"]
    arrival = [r["rollout_id"] for r in rollouts if r["group_id"] == "mid-21-1"]
    mismatch = results["mid-21-1"]["error"]
    assert mismatch["code"] == "length_mismatch"
    assert mismatch["field"] == "logprobs" and mismatch["group_id"] == "mid-21-1"
    assert mismatch["rollout_index"] == arrival.index("mid-21-1/1")
    not_finite = results["mid-21-2"]["error"]
    assert (not_finite["code"], not_finite["field"]) == ("invalid_value", "reward")
    assert not_finite["rollout_index"] == [
        r["rollout_id"] for r in rollouts if r["group_id"] == "mid-21-2"
    ].index("mid-21-2/0")
    incomplete = results["short"]
    assert incomplete["error"]["code"] == "incomplete_group"
    assert "'short'" in incomplete["error"]["message"]
    assert sorted(incomplete["rollout_ids"]) == ["short/0", "short/1"]
    assert service.gauge(PENDING) == 0


def raw_stream(target: str, messages: list[pb.StreamRequest]) -> list[pb.StreamResponse]:
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.AdvantageServiceStub(channel)
        return list(stub.StreamCompute(iter(messages), timeout=30))


def rollout(
    group: str, size: int, n: int = 2, reward: float = 1.0, **extra: Any
) -> pb.StreamRequest:
    return pb.StreamRequest(
        rollout=rollout_message(
            {
                "group_id": group,
                "group_size": size,
                "tokens": list(range(1, n + 1)),
                "reward": reward,
                **extra,
            }
        )
    )


def test_later_rollouts_of_a_failed_group_are_dropped_without_a_second_answer(
    service: Service,
) -> None:
    bad = rollout("g", 3, rollout_id="a")
    bad.rollout.tokens.data = b"\x01"  # not a whole int32
    responses = raw_stream(
        service.target,
        [
            bad,
            rollout("g", 3, rollout_id="b"),
            rollout("g", 3, rollout_id="c"),
            # the failed group's three rollouts are used up: "g" starts afresh
            rollout("g", 2, reward=0.0),
            rollout("g", 2, reward=1.0),
        ],
    )
    assert [r.WhichOneof("kind") for r in responses] == ["error", "result"]
    assert responses[0].error.error.code == "invalid_shape"
    assert list(responses[0].error.rollout_ids) == ["a"]
    assert len(responses[1].result.rollouts) == 2


def test_rollouts_disagreeing_on_group_size_fail_the_group(service: Service) -> None:
    responses = raw_stream(service.target, [rollout("g", 2), rollout("g", 3)])
    assert len(responses) == 1
    error = responses[0].error.error
    assert (error.code, error.field, error.rollout_index) == ("invalid_value", "group_size", 1)


def test_a_group_with_logprobs_on_some_rollouts_fails_as_the_same_json_group_does(
    service: Service,
) -> None:
    # Stream groups are built by the JSON request's builder: the same check, the same error.
    given = {"tokens": [1, 2], "reward": 1.0, "logprobs": [-0.5, -0.25]}
    missing = {"tokens": [3], "reward": 0.0}
    responses = raw_stream(
        service.target,
        [rollout("g", 2, rollout_id="a", **given), rollout("g", 2, rollout_id="b", **missing)],
    )
    assert [r.WhichOneof("kind") for r in responses] == ["error"]
    with pytest.raises(RequestError) as info:
        compute_in_process({"groups": [{"id": "g", "rollouts": [given, missing]}]}, device="cpu")
    error = responses[0].error
    assert list(error.rollout_ids) == ["a", "b"]
    assert (error.error.code, error.error.message, error.error.field) == (
        info.value.code,
        info.value.message,
        info.value.field,
    )
    assert (
        (error.error.group_id, error.error.rollout_index)
        == ("g", 1)
        == (
            info.value.group_id,
            info.value.rollout_index,
        )
    )


def test_stream_options_errors_end_the_call_with_invalid_argument(service: Service) -> None:
    with pytest.raises(grpc.RpcError) as info:
        raw_stream(
            service.target,
            [pb.StreamRequest(options=options_message(estimator="no-such-preset"))],
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    meta = dict(info.value.trailing_metadata())  # type: ignore[attr-defined]
    assert meta["advantage-error-code"] == "unknown_estimator"

    with pytest.raises(grpc.RpcError) as info:
        raw_stream(
            service.target,
            [rollout("g", 2), pb.StreamRequest(options=options_message(estimator="grpo"))],
        )
    meta = dict(info.value.trailing_metadata())  # type: ignore[attr-defined]
    assert meta["advantage-error-code"] == "invalid_stream"

    with pytest.raises(AdvantageError) as error:
        list(GrpcClient(service.target).stream([], estimator={"outcome": "nope"}))
    assert error.value.grpc_code == "INVALID_ARGUMENT"


def test_pending_group_and_token_limits_answer_the_group_not_the_stream(
    limited_service: Service,
) -> None:
    # ADV_STREAM_MAX_PENDING_GROUPS=3, ADV_STREAM_MAX_PENDING_TOKENS=100, ADV_MAX_GROUP_SIZE=8
    responses = raw_stream(
        limited_service.target,
        [
            rollout("a", 2),
            rollout("b", 2),
            rollout("c", 2),
            rollout("d", 2),  # a fourth incomplete group: over the limit
            rollout("a", 2, reward=0.0),  # completes a
            rollout("e", 2, n=60),
            rollout("e", 2, n=60),  # 120 tokens held: over the limit
            rollout("big", 9),  # over ADV_MAX_GROUP_SIZE
            rollout("b", 2, reward=0.0),
            rollout("c", 2, reward=0.0),
        ],
    )
    by_group = {
        (r.error.group_id if r.WhichOneof("kind") == "error" else r.result.group_id): r
        for r in responses
    }
    assert len(by_group) == len(responses) == 6
    for group in ("d", "e", "big"):
        error = by_group[group].error.error
        assert error.code == "limit_exceeded", group
    assert "ADV_STREAM_MAX_PENDING_GROUPS" in by_group["d"].error.error.message
    assert "ADV_STREAM_MAX_PENDING_TOKENS" in by_group["e"].error.error.message
    assert by_group["e"].error.error.field == "tokens"
    assert "ADV_MAX_GROUP_SIZE" in by_group["big"].error.error.message
    for group in ("a", "b", "c"):
        assert by_group[group].WhichOneof("kind") == "result"
    assert limited_service.gauge(PENDING) == 0


class Blocking:
    """A request iterator that sends ``messages`` and then waits (a trainer mid-generation)."""

    def __init__(self, messages: list[pb.StreamRequest]) -> None:
        self.messages = messages
        self.release = threading.Event()

    def __iter__(self) -> Iterator[pb.StreamRequest]:
        yield from self.messages
        self.release.wait(60)


def test_cancelling_a_stream_frees_its_pending_groups(service: Service) -> None:
    assert service.gauge(PENDING) == 0
    messages = [rollout(f"pending-{g}", 4) for g in range(5)]
    requests = Blocking(messages)
    with grpc.insecure_channel(service.target) as channel:
        call = pb_grpc.AdvantageServiceStub(channel).StreamCompute(iter(requests), timeout=60)
        try:
            poll(lambda: service.gauge(PENDING) == 5, 20, "5 pending groups")
            assert service.gauge(OPEN) == 1
            call.cancel()
            poll(lambda: service.gauge(PENDING) == 0, 20, "pending groups back to 0")
            poll(lambda: service.gauge(OPEN) == 0, 20, "no open stream")
        finally:
            requests.release.set()
    # The service is fine afterwards.
    results = list(GrpcClient(service.target).stream(stream_rollouts(random_groups(3, 2))))
    assert all("rollouts" in r for r in results)


def test_closing_the_client_generator_cancels_the_call(service: Service) -> None:
    release = threading.Event()

    def rollouts() -> Iterator[dict[str, Any]]:
        yield {"group_id": "done", "group_size": 1, "tokens": [1], "reward": 1.0}
        for g in range(3):
            yield {"group_id": f"open-{g}", "group_size": 2, "tokens": [1], "reward": 1.0}
        release.wait(60)

    stream = GrpcClient(service.target).stream(rollouts())
    try:
        first = next(stream)
        assert first["id"] == "done"
        poll(lambda: service.gauge(PENDING) == 3, 20, "3 pending groups")
        stream.close()
        poll(lambda: service.gauge(PENDING) == 0, 20, "pending groups back to 0")
        poll(lambda: service.gauge(OPEN) == 0, 20, "no open stream")
    finally:
        release.set()


def test_a_message_that_ends_the_stream_is_answered_after_the_groups_before_it(
    service: Service,
) -> None:
    """A complete group computing and an incomplete one, then a message that ends the stream
    (no options, no rollout): the complete group's result and the incomplete one's
    incomplete_group come first, then INVALID_ARGUMENT. Before, the stream ended at once and
    neither group was answered."""
    answers: list[pb.StreamResponse] = []
    messages = [rollout("done", 1, n=10_000), rollout("open", 2), pb.StreamRequest()]
    with grpc.insecure_channel(service.target) as channel:
        call = pb_grpc.AdvantageServiceStub(channel).StreamCompute(iter(messages), timeout=30)
        with pytest.raises(grpc.RpcError) as info:
            answers.extend(call)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    meta = dict(info.value.trailing_metadata())  # type: ignore[attr-defined]
    assert meta["advantage-error-code"] == "invalid_stream"
    kinds = {
        (a.result.group_id if a.WhichOneof("kind") == "result" else a.error.group_id): (
            a.WhichOneof("kind"),
            a.error.error.code if a.WhichOneof("kind") == "error" else "",
        )
        for a in answers
    }
    assert kinds == {"done": ("result", ""), "open": ("error", "incomplete_group")}, kinds
