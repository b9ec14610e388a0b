"""Saturation over gRPC, on a real engine and server in this process (a busy engine is easy to
make by holding its one admission slot): unary calls are refused with RESOURCE_EXHAUSTED and
retry-after, the client retries, and a completed stream group waits for a slot instead."""

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
from advantage_client.grpc_gen import advantage_pb2_grpc as pb_grpc
from advantage_service.config import Settings
from advantage_service.engine import Engine
from advantage_service.transports.grpc import bound_port, start_grpc_server, stop_grpc_server
from grpc_support import random_request, stream_rollouts
from prometheus_client.parser import text_string_to_metric_families


class InProcess:
    """An engine with one admission slot and its gRPC server on a loop in a thread."""

    def __init__(self) -> None:
        self.settings = Settings(device="cpu", max_inflight=1)
        self.engine = Engine(self.settings)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = self.call(start_grpc_server(self.engine, self.settings, "127.0.0.1", 0))
        self.target = f"127.0.0.1:{bound_port(self.server)}"

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

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


def test_saturated_engine_answers_resource_exhausted_with_retry_after(inprocess: InProcess) -> None:
    with inprocess.engine.admit("test"), grpc.insecure_channel(inprocess.target) as channel:
        stub = pb_grpc.AdvantageServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Compute(compute_request_message(random_request(1)), timeout=10)
    error = info.value
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
    meta = dict(error.trailing_metadata())  # type: ignore[attr-defined]
    assert meta["advantage-error-code"] == "saturated"
    assert int(meta["retry-after"]) >= 1
    assert "ADV_MAX_INFLIGHT" in error.details()  # type: ignore[attr-defined]


def test_client_gives_up_after_its_retries_while_saturated(inprocess: InProcess) -> None:
    client = GrpcClient(inprocess.target, retries=1, backoff=0.01, max_backoff=0.05)
    with inprocess.engine.admit("test"), pytest.raises(AdvantageError) as info:
        client.compute(random_request(2))
    assert info.value.code == "saturated"
    assert info.value.grpc_code == "RESOURCE_EXHAUSTED"


def test_client_retries_until_the_engine_has_a_slot(inprocess: InProcess) -> None:
    slot = inprocess.engine.admit("test")
    threading.Timer(0.3, slot.release).start()
    client = GrpcClient(inprocess.target, retries=8, backoff=0.05, max_backoff=0.2)
    started = time.monotonic()
    response = client.compute(random_request(3))
    assert time.monotonic() - started >= 0.25
    assert response["groups"]


def metric(inprocess: InProcess, name: str, **labels: str) -> float:
    """The sum of the engine's samples ``name`` with ``labels`` (among others), as its /metrics
    exposition shows them (0 when there is none)."""
    text = inprocess.engine.metrics.render().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    )


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.005)


def test_a_completed_stream_group_waits_for_a_slot_instead_of_failing(
    inprocess: InProcess,
) -> None:
    """The server's own gauges show the stream open and its group first pending, then complete;
    while the slot is held the group gets no answer and no refusal, and the stream stays open;
    once the slot is free the group is computed and answered."""
    group = random_request(4)["groups"][1]
    rollouts = stream_rollouts([group])
    last_rollout = threading.Event()

    def held_back() -> Iterator[dict[str, Any]]:
        """Every rollout but the last, then the last when the test says so."""
        yield from rollouts[:-1]
        last_rollout.wait(30)
        yield rollouts[-1]

    results: Future[list[dict[str, Any]]] = Future()

    def consume() -> None:
        try:
            results.set_result(list(GrpcClient(inprocess.target).stream(held_back())))
        except BaseException as exc:
            results.set_exception(exc)

    def answered() -> float:
        return metric(inprocess, "advantage_requests_total", transport="grpc", code="200")

    def refused() -> float:
        return metric(inprocess, "advantage_request_errors_total", transport="grpc")

    def stream_state() -> tuple[float, float]:
        return (
            metric(inprocess, "advantage_stream_open"),
            metric(inprocess, "advantage_stream_pending_groups"),
        )

    slot = inprocess.engine.admit("test")
    try:
        answered_before, refused_before = answered(), refused()
        threading.Thread(target=consume, daemon=True).start()
        # The stream reached the server, and the server holds the group, incomplete.
        wait_until(lambda: stream_state() == (1, 1), "the server has the group pending")
        last_rollout.set()
        # The server read the last rollout: the group is complete (no longer pending).
        wait_until(lambda: stream_state() == (1, 0), "the server has the group complete")
        time.sleep(0.3)
        assert not results.done()  # no answer: the group waits for the slot
        assert stream_state() == (1, 0)  # the stream is still open
        assert (answered(), refused()) == (answered_before, refused_before)
    finally:
        last_rollout.set()
        slot.release()
    (result,) = results.result(30)
    assert result["id"] == group["id"]
    assert len(result["rollouts"]) == len(group["rollouts"])
    assert answered() == answered_before + 1
