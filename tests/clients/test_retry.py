"""Backoff policy and the clients' retries: on a mock transport, and against real local
servers (an HTTP server and a gRPC servicer in this process) that refuse for overload with a
retry hint, to show the wait follows the hint and the retry succeeds."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from advantage_client import AdvantageError, GrpcClient, HttpClient, RetryPolicy
from advantage_client.grpc_client import from_tensor, to_tensor
from advantage_client.retry import HINT_JITTER, Retryable
from advantage_contract.grpc_gen import advantage_pb2 as pb
from advantage_contract.grpc_gen import advantage_pb2_grpc as pb_grpc
from servicer_support import serve


def test_delays_grow_exponentially_within_their_cap_and_honour_retry_after() -> None:
    policy = RetryPolicy(retries=5, backoff=0.1, max_backoff=1.0)
    for attempt in range(6):
        ceiling = min(1.0, 0.1 * 2**attempt)
        assert ceiling / 2 <= policy.delay(attempt) <= ceiling
    assert policy.delay(0, retry_after=0.7) >= 0.7
    assert policy.delay(0, retry_after=30) == 1.0  # capped by max_backoff


def test_a_millisecond_hint_sets_the_wait_whatever_the_backoff_within_max_backoff() -> None:
    # A long backoff and a Retry-After of 1 s: the 250 ms hint wins over both.
    policy = RetryPolicy(retries=5, backoff=4.0, max_backoff=10.0)
    for attempt in range(4):
        wait = policy.delay(attempt, retry_after=1, retry_after_ms=250)
        assert 0.25 <= wait <= 0.25 * (1 + HINT_JITTER)
    assert policy.delay(0, retry_after=1, retry_after_ms=0) == 0.0
    assert policy.delay(0, retry_after=60, retry_after_ms=60_000) == 10.0  # capped
    # No millisecond hint: Retry-After, then the backoff alone.
    assert 1.0 <= policy.delay(0, retry_after=1) <= 4.0
    assert 2.0 <= policy.delay(0) <= 4.0


def test_run_retries_only_retryable_errors_then_raises_the_last() -> None:
    policy = RetryPolicy(retries=2, backoff=0.01)
    calls: list[int] = []
    slept: list[float] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise Retryable(RuntimeError(f"try {len(calls)}"))
        return "ok"

    assert policy.run(flaky, sleep=slept.append) == "ok"
    assert len(calls) == 3 and len(slept) == 2

    def always() -> str:
        raise Retryable(RuntimeError("still down"))

    with pytest.raises(RuntimeError, match="still down"):
        policy.run(always, sleep=slept.append)

    def fatal() -> str:
        raise ValueError("no")

    with pytest.raises(ValueError):
        policy.run(fatal, sleep=slept.append)


def error_body(code: str, message: str) -> bytes:
    detail = {
        "code": code,
        "message": message,
        "group_id": "g",
        "rollout_index": 1,
        "field": "reward",
    }
    return json.dumps({"error": detail}).encode()


OK_BODY = {
    "request_id": "r",
    "namespace": "default",
    "estimator": {},
    "groups": [{"id": "g", "rollouts": [{"advantages": [0.5, 0.5], "scalar": 0.5}]}],
    "summary": {},
}


def test_http_client_retries_429_and_503_then_succeeds() -> None:
    statuses = iter([429, 503, 200])
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers["content-type"])
        status = next(statuses)
        if status == 200:
            return httpx.Response(200, json=OK_BODY)
        return httpx.Response(
            status, content=error_body("saturated", "busy"), headers={"retry-after": "0"}
        )

    client = HttpClient(
        "http://svc", wire="json", backoff=0.001, transport=httpx.MockTransport(handler)
    )
    out = client.compute({"groups": [{"id": "g", "rollouts": [{"tokens": [1, 2], "reward": 1}]}]})
    assert len(seen) == 3 and seen[0] == "application/json"
    assert out["groups"][0]["rollouts"][0]["advantages"].dtype.name == "float32"


def test_http_client_raises_422_at_once_with_the_location() -> None:
    calls: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return httpx.Response(422, content=error_body("invalid_value", "reward is nan"))

    client = HttpClient("http://svc", transport=httpx.MockTransport(handler))
    with pytest.raises(AdvantageError) as info:
        client.compute({"groups": [{"id": "g", "rollouts": [{"tokens": [1], "reward": 1}]}]})
    assert len(calls) == 1
    error = info.value
    assert (error.status, error.code, error.group_id, error.rollout_index, error.field) == (
        422,
        "invalid_value",
        "g",
        1,
        "reward",
    )


def test_http_client_retries_connection_failures() -> None:
    calls: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        raise httpx.ConnectError("refused", request=request)

    client = HttpClient(
        "http://svc", retries=2, backoff=0.001, transport=httpx.MockTransport(handler)
    )
    with pytest.raises(AdvantageError) as info:
        client.list_estimators()
    assert info.value.code == "unavailable" and len(calls) == 3


# ---- against real local servers: overload refusals with retry hints ---------------------------

OVERLOADED = "the service holds 256 requests (ADV_MAX_QUEUE): retry after 250 ms"


def overloaded_body(retry_after_ms: int | None) -> bytes:
    detail: dict[str, Any] = {
        "code": "overloaded",
        "message": OVERLOADED,
        "group_id": None,
        "rollout_index": None,
        "field": "queue",
    }
    if retry_after_ms is not None:
        detail["retry_after_ms"] = retry_after_ms
    return json.dumps({"error": detail}).encode()


class ScriptedHttp:
    """A real HTTP server on loopback answering ``POST /v1/advantages`` from a script: each
    entry is (status, body, headers); when the script runs out, 200 with OK_BODY. Records
    when each request arrived."""

    def __init__(self, script: list[tuple[int, bytes, dict[str, str]]]) -> None:
        self.script = list(script)
        self.arrivals: list[float] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                outer.arrivals.append(time.monotonic())
                status, body, headers = (
                    outer.script.pop(0) if outer.script else (200, json.dumps(OK_BODY).encode(), {})
                )
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                for key, value in headers.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"

    def __enter__(self) -> ScriptedHttp:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def gaps(self) -> list[float]:
        return gaps(self.arrivals)


def gaps(arrivals: list[float]) -> list[float]:
    """Seconds between successive arrivals."""
    return [b - a for a, b in itertools.pairwise(arrivals)]


REQUEST = {"groups": [{"id": "g", "rollouts": [{"tokens": [1, 2], "reward": 1}]}]}


def test_http_client_waits_the_retry_after_ms_of_an_overload_refusal() -> None:
    # As the service answers: 503, Retry-After the hint's whole seconds rounded up.
    refusal = (503, overloaded_body(250), {"Retry-After": "1"})
    with ScriptedHttp([refusal]) as server:
        client = HttpClient(server.url, wire="json", backoff=0.001)
        out = client.compute(REQUEST)
    assert len(server.arrivals) == 2
    (gap,) = server.gaps()
    # The 250 ms hint (plus jitter), not the second of Retry-After nor the 1 ms backoff.
    assert 0.25 <= gap < 0.9, gap
    assert out["groups"][0]["rollouts"][0]["advantages"].tolist() == [0.5, 0.5]


def test_http_client_falls_back_to_retry_after_seconds_without_a_millisecond_hint() -> None:
    refusal = (503, overloaded_body(None), {"Retry-After": "1"})
    with ScriptedHttp([refusal]) as server:
        HttpClient(server.url, wire="json", backoff=0.001).compute(REQUEST)
    (gap,) = server.gaps()
    assert gap >= 1.0, gap


def test_http_client_bounds_the_hint_by_max_backoff() -> None:
    refusal = (503, overloaded_body(30_000), {"Retry-After": "30"})
    with ScriptedHttp([refusal, refusal]) as server:
        HttpClient(server.url, wire="json", backoff=0.001, max_backoff=0.2).compute(REQUEST)
    assert len(server.arrivals) == 3
    for gap in server.gaps():
        assert 0.2 <= gap < 1.5, gap


def test_http_client_raises_the_overload_once_its_retries_are_spent() -> None:
    refusal = (503, overloaded_body(50), {"Retry-After": "1"})
    with ScriptedHttp([refusal] * 3) as server:
        client = HttpClient(server.url, wire="json", retries=2)
        with pytest.raises(AdvantageError) as info:
            client.compute(REQUEST)
    error = info.value
    assert (error.status, error.code, error.field) == (503, "overloaded", "queue")
    assert (error.retry_after, error.retry_after_ms) == (1.0, 50)
    assert len(server.arrivals) == 3
    for gap in server.gaps():
        assert 0.05 <= gap < 0.6, gap


OVERLOAD_METADATA = (
    ("advantage-error-code", "overloaded"),
    ("advantage-field-bin", b"queue"),
    ("retry-after", "1"),
    ("retry-after-ms", "250"),
)


def compute_response(request: pb.ComputeRequest) -> pb.ComputeResponse:
    """Each rollout's tokens as its advantages."""
    return pb.ComputeResponse(
        request_id="r",
        namespace="default",
        estimator_json="{}",
        group_ids=request.group_ids,
        group_index=request.group_index,
        offsets=request.offsets,
        advantages=to_tensor(from_tensor(request.tokens).astype(np.float32)),
    )


class OverloadedService(pb_grpc.AdvantageServiceServicer):
    """Refuses the first ``refusals`` calls of each method as the service refuses for overload
    (UNAVAILABLE with its trailing metadata), then answers; records when each call arrived."""

    def __init__(self, refusals: int = 1) -> None:
        self.refusals = refusals
        self.arrivals: dict[str, list[float]] = {"Compute": [], "StreamCompute": []}
        self.lock = threading.Lock()

    def _refuse(self, method: str, context: grpc.ServicerContext) -> None:
        with self.lock:
            self.arrivals[method].append(time.monotonic())
            refuse = len(self.arrivals[method]) <= self.refusals
        if refuse:
            context.set_trailing_metadata(OVERLOAD_METADATA)
            context.abort(grpc.StatusCode.UNAVAILABLE, OVERLOADED)

    def Compute(
        self, request: pb.ComputeRequest, context: grpc.ServicerContext
    ) -> pb.ComputeResponse:
        self._refuse("Compute", context)
        return compute_response(request)

    def StreamCompute(
        self, request_iterator: Iterator[pb.StreamRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.StreamResponse]:
        self._refuse("StreamCompute", context)
        for message in request_iterator:
            if message.WhichOneof("kind") != "rollout":
                continue
            rollout = message.rollout  # groups of one rollout each
            yield pb.StreamResponse(
                result=pb.GroupResult(
                    group_id=rollout.group_id,
                    rollouts=[
                        pb.RolloutResult(
                            rollout_id=rollout.rollout_id,
                            rollout_index=0,
                            advantages=to_tensor(from_tensor(rollout.tokens).astype(np.float32)),
                        )
                    ],
                )
            )


@pytest.mark.parametrize(
    "call",
    [
        lambda client: client.compute(REQUEST)["groups"][0]["rollouts"][0]["advantages"],
        lambda client: next(
            iter(
                client.stream([{"group_id": "g", "group_size": 1, "tokens": [1, 2], "reward": 1.0}])
            )
        )["rollouts"][0]["advantages"],
    ],
    ids=["Compute", "StreamCompute"],
)
def test_grpc_client_waits_the_retry_after_ms_of_unavailable_then_succeeds(
    call: Callable[[GrpcClient], np.ndarray],
) -> None:
    servicer = OverloadedService()
    server, target = serve(servicer)
    try:
        with GrpcClient(target, backoff=0.001, timeout=10) as client:
            advantages = call(client)
    finally:
        server.stop(None)
    assert advantages.tolist() == [1.0, 2.0]
    (arrivals,) = [a for a in servicer.arrivals.values() if a]
    assert len(arrivals) == 2
    (gap,) = gaps(arrivals)
    # The 250 ms of retry-after-ms (plus jitter), not the second of retry-after.
    assert 0.25 <= gap < 0.9, gap


def test_grpc_client_raises_the_overload_with_its_hints_once_its_retries_are_spent() -> None:
    servicer = OverloadedService(refusals=10)
    server, target = serve(servicer)
    try:
        client = GrpcClient(target, retries=1, max_backoff=0.05, timeout=10)
        with client, pytest.raises(AdvantageError) as info:
            client.compute(REQUEST)
    finally:
        server.stop(None)
    error = info.value
    assert (error.grpc_code, error.code, error.field) == ("UNAVAILABLE", "overloaded", "queue")
    assert (error.retry_after, error.retry_after_ms) == (1.0, 250)
    arrivals = servicer.arrivals["Compute"]
    assert len(arrivals) == 2
    (gap,) = gaps(arrivals)
    assert 0.05 <= gap < 0.6, gap  # the hint, bounded by max_backoff
