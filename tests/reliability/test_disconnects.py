"""Clients that go away mid-request and mid-stream: the service's state returns to idle (every
gauge to 0) and it goes on serving. Also the access log: one JSON line per request, and a
bounded set of metric label values whatever the traffic."""

from __future__ import annotations

import json
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from advantage_client.grpc_client import compute_request_message, options_message, rollout_message
from advantage_client.http_client import arrow_request_body
from advantage_contract.grpc_gen import advantage_pb2 as pb
from advantage_contract.grpc_gen import advantage_pb2_grpc as pb_grpc
from process_support import poll
from support import Service
from test_deadline import big_request

pytestmark = pytest.mark.integration

ARROW = "application/vnd.apache.arrow.stream"
GAUGES = (
    "advantage_inflight_requests",
    "advantage_stream_open",
    "advantage_stream_pending_groups",
)
SMALL: dict[str, Any] = {
    "estimator": "grpo",
    "groups": [
        {"id": "p", "rollouts": [{"tokens": [1, 2], "reward": 1.0}, {"tokens": [3], "reward": 0.0}]}
    ],
}


def idle(service: Service) -> bool:
    metrics = service.metrics()
    return all(metrics[(name, ())] == 0 for name in GAUGES)


def accounted(service: Service, transport: str) -> int:
    """Requests of ``transport`` accounted (answered, refused, or their client gone)."""
    return int(
        sum(
            value
            for (name, labels), value in service.metrics().items()
            if name == "advantage_requests_total" and ("transport", transport) in labels
        )
    )


def assert_returns_to_idle_and_serves(service: Service) -> None:
    poll(lambda: idle(service), 60, "every gauge back to 0")
    assert service.http.post("/v1/advantages", json=SMALL).status_code == 200
    with grpc.insecure_channel(service.target) as channel:
        pb_grpc.AdvantageServiceStub(channel).Compute(compute_request_message(SMALL), timeout=30)
    assert idle(service)


def raw_post(service: Service, body: bytes, send: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", service.http_port), timeout=30)
    head = (
        "POST /v1/advantages HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: {ARROW}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock.sendall(head + body[:send])
    return sock


def test_http_client_gone_mid_body_and_mid_compute_leaves_the_service_idle(
    service_factory: Callable[..., Service],
) -> None:
    service = service_factory(max_inflight=2)
    body = arrow_request_body(big_request(tokens=1_000_000))
    # Mid-body: admitted, half the body sent, then the connection closes.
    sock = raw_post(service, body, len(body) // 2)
    poll(lambda: service.gauge("advantage_inflight_requests") == 1, 30, "the request admitted")
    sock.close()
    # Mid-compute: the whole body sent, the connection closed before the answer.
    for _ in range(3):
        raw_post(service, body, len(body)).close()
    # (each of the four is accounted once it ends; before that, the gauges may read 0 between
    # two of them, while the next connection's headers wait to be read)
    poll(lambda: accounted(service, "http_arrow") == 4, 60, "the four requests accounted for")
    assert_returns_to_idle_and_serves(service)
    errors = service.metrics()
    key = (
        "advantage_request_errors_total",
        (("error", "client_disconnected"), ("transport", "http_arrow")),
    )
    assert errors[key] == 1


def test_grpc_calls_cancelled_mid_compute_leave_the_service_idle(
    service_factory: Callable[..., Service],
) -> None:
    service = service_factory(max_inflight=2)
    message = compute_request_message(big_request(tokens=1_000_000))
    with grpc.insecure_channel(service.target) as channel:
        stub = pb_grpc.AdvantageServiceStub(channel)
        calls = [stub.Compute.future(message, timeout=60) for _ in range(3)]
        poll(lambda: service.gauge("advantage_inflight_requests") > 0, 30, "a call computing")
        for call in calls:
            call.cancel()
    assert_returns_to_idle_and_serves(service)


def test_a_stream_cancelled_with_groups_pending_and_computing_leaves_the_service_idle(
    service_factory: Callable[..., Service],
) -> None:
    service = service_factory(max_inflight=2)
    outgoing: queue.Queue[pb.StreamRequest | None] = queue.Queue()

    def requests() -> Iterator[pb.StreamRequest]:
        while (item := outgoing.get()) is not None:
            yield item

    outgoing.put(pb.StreamRequest(options=options_message(estimator="ktae")))
    big = big_request(tokens=400_000, groups=4)
    for group in big["groups"]:
        for rollout in group["rollouts"]:
            message = rollout_message({"group_id": group["id"], "group_size": 8, **rollout})
            outgoing.put(pb.StreamRequest(rollout=message))
    # Incomplete groups: two of their eight rollouts each.
    for g in range(5):
        for r in range(2):
            message = rollout_message(
                {"group_id": f"open-{g}", "group_size": 8, "tokens": [1, 2, r], "reward": 1.0}
            )
            outgoing.put(pb.StreamRequest(rollout=message))

    with grpc.insecure_channel(service.target) as channel:
        call = pb_grpc.AdvantageServiceStub(channel).StreamCompute(requests(), timeout=60)
        answers: list[Any] = []
        reader = threading.Thread(target=lambda: answers.extend(_drain(call)), daemon=True)
        reader.start()
        poll(
            lambda: service.gauge("advantage_stream_pending_groups") == 5,
            30,
            "the incomplete groups held",
        )
        assert service.gauge("advantage_stream_open") == 1
        call.cancel()
        reader.join(30)
        outgoing.put(None)
    assert_returns_to_idle_and_serves(service)


def _drain(call: Any) -> list[Any]:
    out = []
    try:
        for item in call:
            out.append(item)
    except grpc.RpcError:
        pass
    return out


def test_access_log_has_one_json_line_per_request_with_its_fields(
    service_factory: Callable[..., Service],
) -> None:
    service = service_factory()
    request = {**SMALL, "request_id": "trace-17", "namespace": "team-a"}
    assert service.http.post("/v1/advantages", json=request).status_code == 200
    assert service.http.post("/v1/advantages", json={"groups": 3}).status_code == 422
    with grpc.insecure_channel(service.target) as channel:
        pb_grpc.AdvantageServiceStub(channel).Compute(compute_request_message(request), timeout=30)
    lines = poll(lambda: len(service.access_lines()) >= 3 and service.access_lines(), 30, "lines")
    ok_http, invalid, ok_grpc = lines[:3]
    assert ok_http["request_id"] == "trace-17" and ok_http["namespace"] == "team-a"
    assert ok_http["transport"] == "http_json" and ok_http["estimator"] == "grpo"
    assert (ok_http["groups"], ok_http["rollouts"], ok_http["tokens"]) == (1, 2, 3)
    assert ok_http["status"] == 200 and ok_http["error"] is None
    assert ok_http["compute_ms"] >= 0 and ok_http["total_ms"] >= ok_http["compute_ms"]
    assert invalid["status"] == 422 and invalid["error"] == "invalid_type"
    assert ok_grpc["transport"] == "grpc" and ok_grpc["request_id"] == "trace-17"
    # Every line of the output is one JSON object.
    for line in service.output().splitlines():
        json.loads(line)


def test_metric_labels_stay_bounded_whatever_the_namespaces_and_request_ids(
    service_factory: Callable[..., Service],
) -> None:
    service = service_factory()
    before = len(service.metrics())
    for i in range(30):
        request = {**SMALL, "request_id": f"id-{i}", "namespace": f"team-{i}"}
        assert service.http.post("/v1/advantages", json=request).status_code == 200
    samples = service.metrics()
    for (_, labels), _ in samples.items():
        for _, value in labels:
            assert not value.startswith(("team-", "id-")), labels
    # One more distinct namespace adds no series: the first request may add its own label set.
    service.http.post("/v1/advantages", json={**SMALL, "namespace": "team-new"})
    assert len(service.metrics()) == len(samples) >= before


def test_streams_cancelled_with_their_answers_unread_write_no_error_to_the_log(
    service_factory: Callable[..., Service],
) -> None:
    """A client that cancels a stream before reading its answers is no error of the service's:
    gRPC's core logged one at ERROR with a traceback for each (any client could fill the log
    with them); the service still serves and returns to idle."""
    service = service_factory()
    tokens = list(range(1, 200_000))  # (answers of 800 KB: flow control holds the writes)
    for _ in range(3):
        outgoing: queue.Queue[pb.StreamRequest | None] = queue.Queue()
        for g in range(40):
            message = rollout_message(
                {"group_id": f"g{g}", "group_size": 1, "tokens": tokens, "reward": 1.0}
            )
            outgoing.put(pb.StreamRequest(rollout=message))
        with grpc.insecure_channel(service.target) as channel:
            call = pb_grpc.AdvantageServiceStub(channel).StreamCompute(
                iter(outgoing.get, None), timeout=60
            )
            time.sleep(2)  # (answers computed and being written; none read)
            call.cancel()
            outgoing.put(None)
    assert_returns_to_idle_and_serves(service)
    errors = [line for line in service.output().splitlines() if '"level":"error"' in line]
    assert errors == [], errors[:2]
