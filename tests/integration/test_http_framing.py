"""What a request says of its body, over raw sockets to a real server: an answer sent before the
body is whole closes the connection (a body that never ends holds nothing after its answer), a
client waiting for ``100 Continue`` is refused without being invited to send, and a body the
service cannot frame (Content-Length beside Transfer-Encoding) or decode (a Content-Encoding)
is refused on every route."""

from __future__ import annotations

import gzip
import json
import socket
import time
from typing import Any

import pytest
from http_support import SHARED_SETTINGS, Server

pytestmark = pytest.mark.integration

REQUEST = {"groups": [{"id": "g", "rollouts": [{"tokens": [1, 2], "reward": 1.0}]}]}


def connect(server: Server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def read_answer(sock: socket.socket) -> tuple[bytes, dict[str, str], bytes, bytes]:
    """(status line, headers, body, anything after it) of the next answer on ``sock``."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before an answer: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status, *lines = head.split(b"\r\n")
    headers = {
        k.strip().lower().decode(): v.strip().decode()
        for k, _, v in (line.partition(b":") for line in lines)
    }
    size = int(headers.get("content-length", "0"))
    while len(rest) < size:
        chunk = sock.recv(65536)
        assert chunk, "closed inside an answer"
        rest += chunk
    return status, headers, rest[:size], rest[size:]


def closed_within(sock: socket.socket, seconds: float, trickle: bool) -> bool:
    """Whether the server closes ``sock`` within ``seconds`` (sending a byte of body every
    0.2 s meanwhile when ``trickle``)."""
    sock.settimeout(0.2)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if trickle:
                sock.sendall(b"x")
            if sock.recv(65536) == b"":
                return True
        except TimeoutError:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return True
    return False


def error(body: bytes) -> dict[str, Any]:
    detail: dict[str, Any] = json.loads(body)["error"]
    return detail


def test_a_body_that_never_ends_is_closed_after_the_answer_of_a_route_that_takes_none(
    server: Server,
) -> None:
    # (Kept open for good before: uvicorn waits for the declared body before another request,
    # and each byte put off every timeout; a few hundred such connections took every socket.)
    for head in (
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000000\r\n\r\n",
        b"POST /nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000000\r\n\r\n",
    ):
        with connect(server) as sock:
            sock.sendall(head + b"x")
            status, headers, _, _ = read_answer(sock)
            assert status.split()[1] in (b"200", b"404") and headers["connection"] == "close"
            # The rest is dropped at the body's minimum rate, after its grace (5 s), then closed.
            assert closed_within(sock, 20, trickle=True), head


def test_an_oversized_body_waiting_for_100_continue_is_refused_at_once_without_it(
    server: Server,
) -> None:
    declared = 20 * SHARED_SETTINGS["max_body_bytes"]
    with connect(server) as sock:
        start = time.monotonic()
        sock.sendall(
            b"POST /v1/advantages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % declared
        )
        status, headers, body, _ = read_answer(sock)
        # (Before: 100 Continue at once, the client invited to send 20 MB, the 413 at 5 s.)
        assert status.split()[1] == b"413", status
        assert time.monotonic() - start < 2
        assert error(body)["field"] == "body" and headers["connection"] == "close"
        assert closed_within(sock, 5, trickle=False)


def test_content_length_beside_transfer_encoding_is_400_and_nothing_after_it_is_served(
    server: Server,
) -> None:
    smuggled = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    body = b"0\r\n\r\n" + smuggled
    with connect(server) as sock:
        sock.sendall(
            b"POST /v1/advantages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n%s" % (len(body), body)
        )
        status, headers, answer, after = read_answer(sock)
        assert status.split()[1] == b"400", status
        detail = error(answer)
        assert (detail["code"], detail["field"]) == ("invalid_request", "Transfer-Encoding")
        assert headers["connection"] == "close"
        assert closed_within(sock, 5, trickle=False) and after == b""


@pytest.mark.parametrize("encoding", ["gzip", "br", "deflate"])
def test_a_body_with_a_content_encoding_is_415_naming_it(server: Server, encoding: str) -> None:
    text = json.dumps(REQUEST).encode()
    for body in (gzip.compress(text), text):  # (compressed, or plain but labelled so)
        answer = server.client.post(
            "/v1/advantages",
            content=body,
            headers={"content-type": "application/json", "content-encoding": encoding},
        )
        assert answer.status_code == 415, answer.text
        detail = answer.json()["error"]
        assert (detail["code"], detail["field"]) == ("unsupported_media_type", "Content-Encoding")
        assert encoding in detail["message"]
    plain = server.client.post(
        "/v1/advantages",
        content=text,
        headers={"content-type": "application/json", "content-encoding": "identity"},
    )
    assert plain.status_code == 200, plain.text


def test_a_body_read_whole_keeps_the_connection_for_the_next_request(server: Server) -> None:
    # The closing is for bodies not read whole: a refusal after its body (422) and an answer
    # leave the connection to carry the next request.
    with connect(server) as sock:
        for obj, status in ((REQUEST, b"200"), ({"groups": "no"}, b"422"), (REQUEST, b"200")):
            text = json.dumps(obj).encode()
            sock.sendall(
                b"POST /v1/advantages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(text), text)
            )
            got, headers, _, _ = read_answer(sock)
            assert got.split()[1] == status and headers.get("connection") != "close", got
