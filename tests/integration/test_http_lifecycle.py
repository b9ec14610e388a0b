"""Admission and shutdown on a real server: 503 with Retry-After and a retry hint beyond
ADV_MAX_QUEUE, a SIGTERM that stops accepting, finishes the request in flight and exits 0, and a
SIGTERM with a full queue that answers or refuses every queued request cleanly (none lost).

A request is held deterministically by sending its headers and only part of its body over a
raw socket: the service admits a request (a place among the bodies being received) before
reading its body, so the place stays taken until the test sends the rest. A full queue is held by
dynamic batching: a request that would run alone waits ADV_MAX_BATCH_DELAY_MS in the queue for
company, and none of the test's requests can share a computation with another. No timing races,
no sleeps.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest
from advantage_service import compute
from http_support import Server, random_request
from process_support import poll

pytestmark = pytest.mark.integration

INFLIGHT = ("advantage_inflight_requests", ())


class PartialPost:
    """A POST /v1/advantages whose body is sent in two parts, on its own connection."""

    def __init__(self, server: Server, body: bytes) -> None:
        self.body = body
        self.half = len(body) // 2
        self.sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
        head = (
            "POST /v1/advantages HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            "Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        self.sock.sendall(head + body[: self.half])

    def finish(self) -> tuple[int, dict[str, str], bytes]:
        """Send the rest of the body; (status, headers, body) of the response."""
        self.sock.sendall(self.body[self.half :])
        data = b""
        while chunk := self.sock.recv(65536):
            data += chunk
        self.sock.close()
        head, _, payload = data.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
        return int(lines[0].split()[1]), headers, payload


def inflight(server: Server) -> float:
    return server.metrics()[INFLIGHT]


def assert_answers(request: dict[str, Any], payload: bytes) -> None:
    got = json.loads(payload)
    want = compute(request, device="cpu")
    for g_got, g_want in zip(got["groups"], want["groups"], strict=True):
        for r_got, r_want in zip(g_got["rollouts"], g_want["rollouts"], strict=True):
            np.testing.assert_array_equal(
                np.asarray(r_got["advantages"], np.float32), r_want["advantages"]
            )


def test_a_full_queue_answers_503_with_retry_after_and_a_retry_hint(
    server_factory: Callable[..., Server],
) -> None:
    # One body being received at once: a second body is refused while the first arrives.
    server = server_factory(max_receiving=1)
    held_request = random_request(seed=21)
    held = PartialPost(server, json.dumps(held_request).encode())
    poll(lambda: inflight(server) == 1, 30, "the held request to be admitted")

    refused = server.client.post("/v1/advantages", json=random_request(seed=22))
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert error["code"] == "overloaded" and "ADV_MAX_RECEIVING" in error["message"]
    assert 10 <= error["retry_after_ms"] <= 60_000
    # Retry-After: the hint in whole seconds, rounded up.
    assert int(refused.headers["retry-after"]) == max(1, -(-error["retry_after_ms"] // 1000))
    # Health, readiness and metrics are not admission-controlled.
    assert server.client.get("/healthz").status_code == 200
    assert server.client.get("/readyz").status_code == 200

    status, _, payload = held.finish()
    assert status == 200, payload
    assert_answers(held_request, payload)
    # The slot is free again: the next request is computed.
    assert server.client.post("/v1/advantages", json=random_request(seed=23)).status_code == 200
    samples = server.metrics()
    assert samples[INFLIGHT] == 0
    key = (
        "advantage_requests_total",
        (("code", "503"), ("estimator", "unknown"), ("transport", "http_json")),
    )
    assert samples[key] == 1


def test_sigterm_stops_accepting_finishes_in_flight_and_exits_zero(
    server_factory: Callable[..., Server],
) -> None:
    server = server_factory(shutdown_timeout_seconds=60)
    held_request = random_request(seed=31, estimator="ktae")
    held = PartialPost(server, json.dumps(held_request).encode())
    poll(lambda: inflight(server) == 1, 30, "the held request to be admitted")

    server.proc.send_signal(signal.SIGTERM)

    def refuses_connections() -> bool:
        try:
            socket.create_connection(("127.0.0.1", server.port), timeout=1).close()
        except ConnectionRefusedError:
            return True
        return False

    poll(refuses_connections, 30, "the listening socket to close")
    assert server.proc.poll() is None, "the process exited with a request in flight"

    status, headers, payload = held.finish()
    assert status == 200, payload
    assert headers["content-type"] == "application/json"
    assert_answers(held_request, payload)
    assert server.proc.wait(30) == 0, server.output()


def test_sigterm_with_a_full_queue_answers_or_refuses_every_queued_request(
    server_factory: Callable[..., Server],
) -> None:
    """More queued work than the shutdown timeout allows: the requests computed in time are
    answered, the rest are refused 503 (retry elsewhere) before the deadline (a shutdown timeout
    of 1 s refuses them at once), and so is a request whose body was still arriving; every
    client gets an HTTP answer, none a dropped connection, and the process exits 0."""
    bodies = [random_request(seed=100 + i, estimator="ktae", groups=16) for i in range(48)]
    tokens = [sum(len(r["tokens"]) for g in b["groups"] for r in g["rollouts"]) for b in bodies]
    # Decoding a body costs about what computing it does, so without a hold whether requests
    # pile up before the single worker (rather than before the decoder, or not at all) would be
    # up to thread scheduling and to how fast the clients send. The hold: each request fits a
    # batch (ADV_MAX_BATCH_TOKENS) alone but no two do, so each waits ADV_MAX_BATCH_DELAY_MS in
    # the queue, from its admission, for company that never comes, whatever the machine's
    # speed; then they are computed one at a time.
    assert 2 * min(tokens) > max(tokens), tokens
    server = server_factory(
        max_inflight=1,
        max_batch_tokens=max(tokens),
        max_batch_delay_ms=2000,
        shutdown_timeout_seconds=1,
        body_rate_grace_seconds=60,  # (the held body below takes seconds to arrive)
    )
    # A request whose body is still arriving at the SIGTERM (half of it sent now).
    held = PartialPost(server, json.dumps(random_request(seed=99, estimator="ktae")).encode())
    poll(lambda: inflight(server) == 1, 30, "the held request to be admitted")
    # One request computed before the SIGTERM (after its wait for company) ...
    first = server.client.post("/v1/advantages", json=bodies[0])
    assert first.status_code == 200, first.text
    outcomes: list[Any] = [first] + [None] * (len(bodies) - 1)

    def send(i: int) -> None:
        try:
            with httpx.Client(base_url=server.url, timeout=60) as client:
                outcomes[i] = client.post("/v1/advantages", json=bodies[i])
        except httpx.HTTPError as exc:
            outcomes[i] = exc

    # ... and the others queued after it: each waits 2 s from its admission, so the last one
    # admitted still waits when the SIGTERM comes right after.
    threads = [threading.Thread(target=send, args=(i,)) for i in range(1, len(bodies))]
    for thread in threads:
        thread.start()
    depth = ("advantage_queue_depth", ())
    started = ("advantage_queue_wait_seconds_count", ())  # (observed as a computation starts)

    def queue_full() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        # Before the SIGTERM every answer is a 200: any other is a request that should have
        # queued.
        early = [o for o in outcomes if o is not None and getattr(o, "status_code", 0) != 200]
        assert not early, [getattr(o, "text", o) for o in early[:3]]
        samples = server.metrics()
        # Every request admitted, decoded and queued or computed (none still arriving or
        # decoding), 4 of them waiting at least.
        queued = samples[depth] + samples[started] == len(bodies)
        return samples if queued and samples[depth] >= 4 else {}

    samples = poll(queue_full, 60, "every request in the queue")
    server.proc.send_signal(signal.SIGTERM)
    poll(lambda: 503 in (getattr(o, "status_code", 0) for o in outcomes), 30, "a refusal")
    # Past the refusal point, the held request's body arrives whole: refused, not decoded.
    status, headers, payload = held.finish()
    assert status == 503, payload
    held_error = json.loads(payload)["error"]
    assert held_error["code"] == "overloaded" and "shutting down" in held_error["message"]
    assert int(headers["retry-after"]) >= 1
    for thread in threads:
        thread.join(60)
    assert server.proc.wait(30) == 0, server.output()
    # Every request was admitted before the SIGTERM: each gets an HTTP answer, none a dropped
    # connection (the service's access log has no line cut off, 499) ...
    accesses = [
        line
        for line in (json.loads(x) for x in server.output().splitlines() if x.startswith("{"))
        if line.get("logger") == "advantage_service.access"
    ]
    cut_off = [a for a in accesses if a.get("status") == 499]
    assert not cut_off, "\n".join(json.dumps(a) for a in cut_off)
    dropped = [o for o in outcomes if not isinstance(o, httpx.Response)]
    assert not dropped, dropped[:3]
    answered: list[httpx.Response] = outcomes
    statuses = sorted(o.status_code for o in answered)
    assert set(statuses) <= {200, 503}, statuses
    # ... the requests whose computation had started are answered (each 200 the service logged
    # reached its client), the rest refused.
    logged = [a for a in accesses if a.get("transport") == "http_json" and a["status"] == 200]
    assert statuses.count(200) == len(logged) >= samples[started] >= 1, statuses
    assert 503 in statuses, statuses
    for o in answered:
        if o.status_code == 503:
            assert o.json()["error"]["code"] == "overloaded", o.text
            assert "shutting down" in o.json()["error"]["message"]
