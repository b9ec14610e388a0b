"""Overload over gRPC, on a real engine and server in this process: a full queue answers
UNAVAILABLE with its retry hint in the trailing metadata, the client retries (and gives up after
its retries), and a stream's completed group waits in the queue like any request and is computed
together with the unary requests waiting beside it.

A busy worker is made through the public registry (``holding.Hold``: a term whose computation
blocks until the test releases it), a full queue by taking its places (``engine.admit``)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import grpc
import pytest
from advantage_client import AdvantageError, GrpcClient
from advantage_client.grpc_client import compute_request_message
from advantage_contract.grpc_gen import advantage_pb2_grpc as pb_grpc
from advantage_service.config import Settings
from advantage_service.serving.engine import Engine
from advantage_service.serving.scheduler import Ticket
from advantage_service.transports.grpc import bound_port, start_grpc_server, stop_grpc_server
from grpc_support import random_request, stream_rollouts
from holding import Hold, held_request


class InProcess:
    """An engine with one compute worker and a queue of four, and its gRPC server on a loop in a
    thread (one client, the whole queue its own: tenant shares are not these tests' subject)."""

    def __init__(self) -> None:
        self.settings = Settings(device="cpu", max_inflight=1, max_queue=4, tenant_share=1.0)
        self.engine = Engine(self.settings)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = self.call(start_grpc_server(self.engine, self.settings, "127.0.0.1", 0))
        self.target = f"127.0.0.1:{bound_port(self.server)}"

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def fill_queue(self) -> list[Ticket]:
        """Take every place of the queue (on the engine's loop, as transports do)."""

        async def take() -> list[Ticket]:
            return [self.engine.admit() for _ in range(self.settings.max_queue)]

        return list(self.call(take()))

    def free(self, tickets: list[Ticket]) -> None:
        async def release() -> None:
            for ticket in tickets:
                ticket.release()

        self.call(release())

    def close(self) -> None:
        self.call(stop_grpc_server(self.server, 1.0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.engine.close()


@pytest.fixture(scope="module")
def inprocess() -> Iterator[InProcess]:
    srv = InProcess()
    yield srv
    srv.close()


def test_a_full_queue_answers_unavailable_with_the_retry_hint(inprocess: InProcess) -> None:
    tickets = inprocess.fill_queue()
    try:
        with grpc.insecure_channel(inprocess.target) as channel:
            stub = pb_grpc.AdvantageServiceStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.Compute(compute_request_message(random_request(1)), timeout=10)
    finally:
        inprocess.free(tickets)
    error = info.value
    assert error.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    meta = dict(error.trailing_metadata())  # type: ignore[attr-defined]
    assert meta["advantage-error-code"] == "overloaded"
    retry_ms = int(meta["retry-after-ms"])
    assert 10 <= retry_ms <= 60_000
    assert int(meta["retry-after"]) == max(1, -(-retry_ms // 1000))
    assert "ADV_MAX_QUEUE" in error.details()  # type: ignore[attr-defined]


def test_client_gives_up_after_its_retries_while_overloaded(inprocess: InProcess) -> None:
    client = GrpcClient(inprocess.target, retries=1, backoff=0.01, max_backoff=0.05)
    tickets = inprocess.fill_queue()
    try:
        with pytest.raises(AdvantageError) as info:
            client.compute(random_request(2))
    finally:
        inprocess.free(tickets)
    assert info.value.code == "overloaded"
    assert info.value.grpc_code == "UNAVAILABLE"


def test_client_retries_until_the_queue_has_room(inprocess: InProcess) -> None:
    tickets = inprocess.fill_queue()
    threading.Timer(0.3, inprocess.free, args=(tickets,)).start()
    client = GrpcClient(inprocess.target, retries=8, backoff=0.05, max_backoff=0.2)
    started = time.monotonic()
    response = client.compute(random_request(3))
    assert time.monotonic() - started >= 0.25
    assert response["groups"]


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.005)


def test_a_stream_group_waits_in_the_queue_and_is_merged_with_unary_requests(
    inprocess: InProcess,
) -> None:
    """The one worker is held; a stream's completed group and two unary requests of the same
    computation queue behind it (the queue shows three waiting, the stream gets no error); once
    the worker is free all three are computed in one batch and each is answered."""
    estimator = {"outcome": "grpo", "hold": {}}

    def group(gid: str) -> dict[str, Any]:
        rollouts = [{"tokens": [1, 2, 3], "reward": 1.0}, {"tokens": [4], "reward": 0.0}]
        return {"id": gid, "rollouts": rollouts}

    def unary(gid: str) -> dict[str, Any]:
        return {"estimator": estimator, "return": ["scalar"], "groups": [group(gid)]}

    client = GrpcClient(inprocess.target)
    with Hold() as hold:
        held: Future[Any] = Future()
        threading.Thread(
            target=lambda: held.set_result(client.compute(held_request(**{"return": []}))),
            daemon=True,
        ).start()
        wait_until(hold.blocked.is_set, "the worker is held")

        streamed: Future[list[dict[str, Any]]] = Future()
        threading.Thread(
            target=lambda: streamed.set_result(
                list(
                    client.stream(
                        stream_rollouts([group("streamed")]),
                        estimator=estimator,
                        returns=["scalar"],
                    )
                )
            ),
            daemon=True,
        ).start()
        wait_until(lambda: inprocess.engine.scheduler.depth == 1, "the stream group is queued")
        answers: list[Future[Any]] = []
        for gid in ("unary-a", "unary-b"):
            answer: Future[Any] = Future()
            threading.Thread(
                target=lambda a=answer, g=gid: a.set_result(client.compute(unary(g))),
                daemon=True,
            ).start()
            answers.append(answer)
            queued = len(answers) + 1
            wait_until(lambda q=queued: inprocess.engine.scheduler.depth == q, "unary queued")
        assert not streamed.done()
        hold.release.set()
        (result,) = streamed.result(30)
        unary_answers = [a.result(30) for a in answers]
        held.result(30)
    assert result["id"] == "streamed" and "error" not in result
    assert len(result["rollouts"]) == 2
    assert [a["groups"][0]["id"] for a in unary_answers] == ["unary-a", "unary-b"]
    assert sorted(hold.computed[1]) == ["streamed", "unary-a", "unary-b"]
