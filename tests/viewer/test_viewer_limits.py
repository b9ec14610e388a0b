"""The viewer's POST routes take the API's body limit and admission, on a real service: a body
over the limit is a 413 before it is read (from Content-Length) or as soon as it passes the
limit (chunked), without the service's peak RSS growing by the body; a viewer call being
received holds a place in the API's queue, and a full queue is a 503 with Retry-After for
both."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest
from advantage_service.viewer.routes import MAX_TEXT_IDS, MAX_VIEWER_BODY_BYTES
from body_support import MiB, peak_rss, post_body, reset_peak_rss
from integration.http_support import Server, start_server
from process_support import poll

pytestmark = pytest.mark.integration

TOKEN = "viewer-limits-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# What the viewer's POST routes take at most (viewer/routes.py: MAX_VIEWER_BODY_BYTES).
VIEWER_LIMIT = 2 * MiB


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One place in the queue (ADV_MAX_QUEUE=1), so that one call being received fills it."""
    directory = tmp_path_factory.mktemp("viewer-limits")
    tokens = directory / "tokens.json"
    tokens.write_text(json.dumps({"tokens": {TOKEN: ["team-a"]}}))
    srv = start_server(directory, auth_tokens_file=str(tokens), max_queue=1, max_receiving=1)
    yield srv
    srv.stop()


def head(path: str, framing: str) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Type: application/json\r\n{framing}\r\n\r\n"
    ).encode()


@pytest.mark.parametrize(
    ("path", "chunked"),
    [
        ("/viewer/api/diagnostics", False),
        ("/viewer/api/diagnostics", True),
        ("/viewer/api/token-text", False),
        ("/viewer/api/token-text", True),
    ],
)
def test_a_body_over_the_limit_is_413_without_growing_the_service(
    server: Server, path: str, chunked: bool
) -> None:
    """64 MiB: under ADV_MAX_BODY_BYTES (256 MiB here), over what the viewer's routes take.
    By Content-Length it is refused before a byte is read; chunked, once 2 MiB have come.
    Either way the service's peak RSS grows by far less than the body (before: the whole body
    was read, then parsed, then refused 422)."""
    pid = server.proc.pid
    before = reset_peak_rss(pid)
    status, headers, body = post_body(server.port, path, 64 * MiB, chunked=chunked, headers=AUTH)
    growth = peak_rss(pid) - before
    assert status == 413, body
    error = json.loads(body)["error"]
    assert error["code"] == "limit_exceeded" and error["field"] == "body"
    assert str(VIEWER_LIMIT) in error["message"]
    assert headers.get("connection") == "close"  # the rest was read and dropped, then closed
    assert growth < 16 * MiB, growth
    # The routes still answer a body within the limit.
    ok = server.client.post("/viewer/api/token-text", json={"ids": [1, 2]}, headers=AUTH)
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("path", ["/viewer/api/diagnostics", "/viewer/api/token-text"])
def test_a_body_that_would_parse_into_too_many_values_is_413_before_parsing(
    server: Server, path: str
) -> None:
    """Under 2 MiB, but 690,000 empty lists: parsed, 63 MiB of objects. Refused from its
    commas before it is parsed."""
    body = b"[" + b"[]," * 689_999 + b"[]]"
    assert len(body) < VIEWER_LIMIT
    pid = server.proc.pid
    before = reset_peak_rss(pid)
    answer = server.client.post(
        path, content=body, headers={**AUTH, "Content-Type": "application/json"}
    )
    growth = peak_rss(pid) - before
    assert answer.status_code == 413, answer.text
    assert answer.json()["error"]["field"] == "body"
    assert growth < 16 * MiB, growth


def test_token_text_takes_as_many_ids_as_it_answers(server: Server) -> None:
    """The bound on values refuses nothing the route would answer: 100,000 ids are answered,
    100,001 refused by the route itself, naming ids."""
    at = server.client.post(
        "/viewer/api/token-text", json={"ids": [7] * MAX_TEXT_IDS}, headers=AUTH
    )
    assert at.status_code == 200, at.text
    over = server.client.post(
        "/viewer/api/token-text", json={"ids": [7] * (MAX_TEXT_IDS + 1)}, headers=AUTH
    )
    assert over.status_code == 413 and over.json()["error"]["field"] == "ids", over.text


def hold_the_queue(server: Server, path: str) -> socket.socket:
    """A POST whose body is half sent: admitted, it holds the one place until it is closed."""
    body = json.dumps({"ids": list(range(100))}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(head(path, f"Content-Length: {len(body)}") + body[: len(body) // 2])
    poll(lambda: server.gauge("advantage_inflight_requests") == 1, 30, "the call admitted")
    return sock


def test_the_viewers_routes_and_the_api_share_one_queue(server: Server) -> None:
    """A viewer call is admitted before its body is read, in the API's queue: while an API
    call holds the only place the viewer's routes answer 503 with Retry-After, and while a
    viewer call does, the API does."""
    request = {
        "namespace": "team-a",
        "groups": [
            {"id": "g", "rollouts": [{"tokens": [1, 2], "reward": 1}, {"tokens": [3], "reward": 0}]}
        ],
    }
    for holder, path, body in (
        ("/v1/advantages", "/viewer/api/token-text", {"ids": [1, 2]}),
        ("/v1/advantages", "/viewer/api/diagnostics", {"estimator": "grpo"}),
        ("/viewer/api/token-text", "/v1/advantages", request),
        ("/viewer/api/diagnostics", "/viewer/api/token-text", {"ids": [1]}),
    ):
        with hold_the_queue(server, holder):
            refused = server.client.post(path, json=body, headers=AUTH)
            assert refused.status_code == 503, (holder, path, refused.text)
            assert refused.json()["error"]["code"] == "overloaded"
            assert int(refused.headers["retry-after"]) >= 1
        poll(lambda: server.gauge("advantage_inflight_requests") == 0, 30, "the place freed")
        assert server.client.post(path, json=body, headers=AUTH).status_code == 200


def test_a_viewer_call_without_a_valid_token_takes_no_place(server: Server) -> None:
    """Authenticated before admission, as the API: a 401 even with the queue full."""
    with hold_the_queue(server, "/viewer/api/diagnostics"):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            refused = server.client.post(
                "/viewer/api/diagnostics", json={"estimator": "grpo"}, headers=headers
            )
            assert refused.status_code == 401, refused.text


def test_the_limit_holds_any_token_text_request_the_route_accepts() -> None:
    """MAX_TEXT_IDS ids of int64's largest value, as the page writes them, fit the viewer's
    body limit: the limit never refuses what the route would answer."""
    largest = json.dumps({"ids": [2**63 - 1] * MAX_TEXT_IDS}, separators=(",", ":"))
    assert len(largest) <= MAX_VIEWER_BODY_BYTES == VIEWER_LIMIT
