"""Admission and shutdown on a real server: 429 with Retry-After beyond ADV_MAX_INFLIGHT, and a
SIGTERM that stops accepting, finishes the request in flight, and exits 0.

A request is held in flight deterministically by sending its headers and only part of its body
over a raw socket: the service admits a request before reading its body, so the slot stays
taken until the test sends the rest. No timing races, no sleeps.
"""

from __future__ import annotations

import json
import signal
import socket
from collections.abc import Callable
from typing import Any

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


def test_saturated_service_answers_429_with_retry_after(
    server_factory: Callable[..., Server],
) -> None:
    server = server_factory(max_inflight=1)
    held_request = random_request(seed=21)
    held = PartialPost(server, json.dumps(held_request).encode())
    poll(lambda: inflight(server) == 1, 30, "the held request to be admitted")

    refused = server.client.post("/v1/advantages", json=random_request(seed=22))
    assert refused.status_code == 429, refused.text
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["code"] == "saturated"
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
        (("code", "429"), ("estimator", "unknown"), ("transport", "http_json")),
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
