"""GrpcClient.stream against a scripted server in this process: reconnecting after UNAVAILABLE
sends again what was not answered, rollouts of a refused group are not sent, and the client's
own errors surface."""

from __future__ import annotations

import socket
import threading
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from advantage_client import AdvantageError, GrpcClient
from advantage_client.grpc_client import from_tensor, to_tensor
from advantage_contract.grpc_gen import advantage_pb2 as pb
from advantage_contract.grpc_gen import advantage_pb2_grpc as pb_grpc
from servicer_support import serve


class ScriptedService(pb_grpc.AdvantageServiceServicer):
    """Assembles groups and answers each with its tokens as advantages. The first call drops
    after ``drop_after`` rollouts (UNAVAILABLE); groups named ``bad-*`` are refused on their
    first rollout."""

    def __init__(self, drop_after: int | None = None) -> None:
        self.drop_after = drop_after
        self.calls: list[list[str]] = []  # rollout ids received, per call
        self.lock = threading.Lock()

    def StreamCompute(
        self, request_iterator: Iterator[pb.StreamRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.StreamResponse]:
        with self.lock:
            received: list[str] = []
            self.calls.append(received)
            first_call = len(self.calls) == 1
        pending: dict[str, list[pb.Rollout]] = defaultdict(list)
        failed: dict[str, int] = {}
        for message in request_iterator:
            if message.WhichOneof("kind") != "rollout":
                continue
            rollout = message.rollout
            received.append(rollout.rollout_id)
            if first_call and self.drop_after is not None and len(received) > self.drop_after:
                context.abort(grpc.StatusCode.UNAVAILABLE, "the server is restarting")
            gid = rollout.group_id
            if gid in failed:
                failed[gid] -= 1
                if not failed[gid]:
                    del failed[gid]
                continue
            if gid.startswith("bad-"):
                failed[gid] = rollout.group_size - 1
                yield pb.StreamResponse(
                    error=pb.GroupError(
                        group_id=gid,
                        error=pb.Error(code="invalid_value", message="bad", group_id=gid),
                        rollout_ids=[rollout.rollout_id],
                    )
                )
                continue
            pending[gid].append(rollout)
            if len(pending[gid]) == rollout.group_size:
                members = pending.pop(gid)
                yield pb.StreamResponse(
                    result=pb.GroupResult(
                        group_id=gid,
                        rollouts=[
                            pb.RolloutResult(
                                rollout_id=r.rollout_id,
                                rollout_index=i,
                                advantages=to_tensor(from_tensor(r.tokens).astype(np.float32)),
                            )
                            for i, r in enumerate(members)
                        ],
                    )
                )


def rollouts(groups: int, size: int, prefix: str = "g") -> list[dict[str, Any]]:
    """Interleaved: rollout 0 of every group, then rollout 1 of every group, ..."""
    return [
        {
            "group_id": f"{prefix}{g}",
            "group_size": size,
            "rollout_id": f"{prefix}{g}/{i}",
            "tokens": [g, i],
            "reward": 1.0,
        }
        for i in range(size)
        for g in range(groups)
    ]


@pytest.mark.parametrize(
    ("groups", "size", "drop_after", "answered_first"),
    [(4, 3, 7, set()), (3, 2, 4, {"g0"})],
)
def test_reconnect_after_unavailable_sends_unanswered_groups_again(
    groups: int, size: int, drop_after: int, answered_first: set[str]
) -> None:
    servicer = ScriptedService(drop_after=drop_after)
    server, target = serve(servicer)
    try:
        sent = rollouts(groups=groups, size=size)
        client = GrpcClient(target, retries=3, backoff=0.01)
        results = list(client.stream(iter(sent)))
    finally:
        server.stop(None)
    assert sorted(r["id"] for r in results) == [f"g{g}" for g in range(groups)]
    for result in results:
        g = int(result["id"][1:])
        assert [r["rollout_id"] for r in result["rollouts"]] == [f"g{g}/{i}" for i in range(size)]
        for i, r in enumerate(result["rollouts"]):
            np.testing.assert_array_equal(r["advantages"], [g, i])
    assert len(servicer.calls) == 2
    first, second = servicer.calls
    assert len(first) == drop_after + 1
    # The second call gets every rollout of the groups the first did not answer, once each.
    expected = [r["rollout_id"] for r in sent if r["group_id"] not in answered_first]
    assert sorted(second) == sorted(expected) and len(second) == len(set(second))


def test_rollouts_of_a_refused_group_are_not_sent() -> None:
    servicer = ScriptedService()
    server, target = serve(servicer)
    events = threading.Event()

    def source() -> Iterator[dict[str, Any]]:
        yield {
            "group_id": "bad-1",
            "group_size": 3,
            "rollout_id": "b0",
            "tokens": [1],
            "reward": 0.0,
        }
        events.wait(5)  # the refusal has arrived
        for i in (1, 2):
            yield {
                "group_id": "bad-1",
                "group_size": 3,
                "rollout_id": f"b{i}",
                "tokens": [1],
                "reward": 0.0,
            }
        yield {"group_id": "ok", "group_size": 1, "rollout_id": "k", "tokens": [5], "reward": 1.0}

    try:
        results = []
        for result in GrpcClient(target).stream(source()):
            results.append(result)
            events.set()
    finally:
        server.stop(None)
    assert [r["id"] for r in results] == ["bad-1", "ok"]
    assert results[0]["error"]["code"] == "invalid_value"
    assert servicer.calls == [["b0", "k"]]


def test_a_bad_rollout_dict_raises_and_ends_the_call() -> None:
    servicer = ScriptedService()
    server, target = serve(servicer)
    try:
        stream = GrpcClient(target).stream(
            [
                {"group_id": "a", "group_size": 1, "tokens": [1], "reward": 1.0},
                {"group_id": "b", "group_size": 1, "tokens": [1], "reward": "high"},
            ]
        )
        with pytest.raises(AdvantageError) as info:
            list(stream)
    finally:
        server.stop(None)
    assert (info.value.code, info.value.field, info.value.group_id) == (
        "invalid_type",
        "reward",
        "b",
    )


def refusing_target() -> str:
    """A loopback address with nothing listening."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def test_an_unreachable_service_fails_after_the_retries() -> None:
    client = GrpcClient(refusing_target(), retries=2, backoff=0.01, timeout=5)
    with pytest.raises(AdvantageError) as info:
        list(client.stream(rollouts(1, 1)))
    assert info.value.grpc_code == "UNAVAILABLE"
    with pytest.raises(AdvantageError) as info:
        client.compute({"groups": [{"id": "a", "rollouts": [{"tokens": [], "reward": 0}]}]})
    assert info.value.grpc_code == "UNAVAILABLE"
