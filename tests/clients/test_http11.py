"""The HTTP client's plain-HTTP transport (advantage_client/http11.py): against real servers on
loopback, a scripted one for what a server may do to a connection (close it while it is idle,
cut an answer short, never answer, not be there) and the real service for its answers, which
must be what httpx's own transport reads, from several threads on one client."""

from __future__ import annotations

import json
import os
import resource
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from advantage_client import AdvantageError, GrpcClient, HttpClient
from advantage_client.http11 import Http11Transport, wanted
from service_support import Service

ANSWER = json.dumps(
    {
        "request_id": "r",
        "namespace": "default",
        "estimator": {},
        "groups": [{"id": "g", "rollouts": [{"advantages": [0.5, 0.5], "scalar": 0.5}]}],
        "summary": {},
    }
).encode()
REQUEST = {"groups": [{"id": "g", "rollouts": [{"tokens": [1, 2], "reward": 1}]}]}


def read_request(conn: socket.socket) -> bool:
    """One request's head and Content-Length body off ``conn`` (False: the client closed)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return False
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ),
        0,  # (a GET)
    )
    while len(body) < length:
        body += conn.recv(65536)
    return True


def answer(body: bytes, length: int | None = None) -> bytes:
    """A keep-alive 200 carrying ``body`` (declaring ``length`` bytes, its own by default)."""
    declared = len(body) if length is None else length
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        declared,
        body,
    )


@contextmanager
def scripted(*connections: Callable[[socket.socket], None]) -> Iterator[tuple[str, list[int]]]:
    """A real TCP server on loopback handing its n-th accepted connection to
    ``connections[n]`` (the last for any after); yields its URL and the count accepted."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted = [0]
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            handle = connections[min(accepted[0], len(connections) - 1)]
            accepted[0] += 1
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", accepted
    finally:
        stop.set()
        thread.join()
        listener.close()


def keep_alive(conn: socket.socket) -> None:
    with conn:
        while read_request(conn):
            conn.sendall(answer(ANSWER))


def one_then_close(closed: threading.Event) -> Callable[[socket.socket], None]:
    """Answers one request as keep-alive, then closes the connection (a server's idle
    keep-alive timeout, uvicorn's 5 s, run out) and sets ``closed``."""

    def serve(conn: socket.socket) -> None:
        with conn:
            if read_request(conn):
                conn.sendall(answer(ANSWER))
        closed.set()

    return serve


def cut_short(conn: socket.socket) -> None:
    with conn:
        if read_request(conn):
            conn.sendall(answer(ANSWER[:10], length=len(ANSWER)))


def reset(conn: socket.socket) -> None:
    """Reads the request, then resets the connection (RST, not FIN: a process killed, a load
    balancer or a listener closing with the request unread)."""
    with conn:
        if read_request(conn):
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def gateway(status: bytes) -> Callable[[socket.socket], None]:
    """Answers as a proxy in front of a replica that is gone does: ``status`` with its HTML
    page (haproxy's 502 and 504), then closes."""

    def serve(conn: socket.socket) -> None:
        page = b"<html><body><h1>%s</h1>\nThe server is unavailable.\n</body></html>\n" % status
        with conn:
            if read_request(conn):
                conn.sendall(
                    b"HTTP/1.1 %s\r\ncontent-type: text/html\r\ncontent-length: %d\r\n"
                    b"connection: close\r\n\r\n%s" % (status, len(page), page)
                )

    return serve


def silent(conn: socket.socket) -> None:
    with conn:
        read_request(conn)
        time.sleep(3)


def test_plain_http_without_a_proxy_is_carried_and_https_or_a_proxied_url_is_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    assert wanted("http://127.0.0.1:8000")
    assert not wanted("https://service:8443")
    assert isinstance(HttpClient("http://127.0.0.1:8000").http._transport, Http11Transport)
    assert not isinstance(HttpClient("https://svc:8443").http._transport, Http11Transport)
    monkeypatch.setenv("HTTP_PROXY", "http://proxy:3128")
    assert not wanted("http://service:8000")
    assert not isinstance(HttpClient("http://service:8000").http._transport, Http11Transport)
    monkeypatch.setenv("NO_PROXY", "service")
    assert wanted("http://service:8000")


def test_a_connection_the_server_closed_while_idle_is_not_used_again() -> None:
    # Sent over the closed connection, the second call would fail (the server gone without
    # an answer) and be retried: it must go on a new connection at once.
    closed = threading.Event()
    with scripted(one_then_close(closed)) as (url, accepted):
        client = HttpClient(url, wire="json", retries=0)
        first = client.compute(REQUEST)
        assert closed.wait(10)
        time.sleep(0.05)  # (the server's FIN on its way over loopback)
        second = client.compute(REQUEST)
        assert client.retry_stats.retries == 0
        assert accepted[0] == 2
        for answered in (first, second):
            np.testing.assert_array_equal(answered["groups"][0]["rollouts"][0]["advantages"], 0.5)


@pytest.fixture
def descriptors_past_1023() -> Iterator[None]:
    """This process's next sockets numbered above 1023, as in a trainer holding many files
    (``select.select`` refuses them)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"at most {hard} open files here")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("descriptors", ["few", "past 1023"])
def test_a_connection_kept_alive_carries_the_next_call(
    descriptors: str, request: pytest.FixtureRequest
) -> None:
    if descriptors == "past 1023":
        request.getfixturevalue("descriptors_past_1023")
    with scripted(keep_alive) as (url, accepted):
        client = HttpClient(url, wire="json", retries=0)
        for _ in range(5):
            client.compute(REQUEST)
        assert accepted[0] == 1


def test_an_answer_cut_short_is_a_lost_connection_and_retried() -> None:
    with scripted(cut_short, keep_alive) as (url, accepted):
        client = HttpClient(url, wire="json", retries=1, backoff=0.001)
        client.compute(REQUEST)
        assert client.retry_stats.retries == 1 and accepted[0] == 2
    with scripted(cut_short) as (url, _):
        with pytest.raises(AdvantageError) as info:
            HttpClient(url, wire="json", retries=0).compute(REQUEST)
        assert info.value.code == "unavailable", info.value


def test_a_connection_reset_before_the_answer_is_a_lost_connection_and_retried() -> None:
    # (A reset, not a close: http.client's ConnectionResetError, httpx's ReadError through
    # httpx's own transport; both the service's "unavailable", retried as a close is.)
    for transport in ("ours", "httpx's"):
        chosen = {"transport": httpx.HTTPTransport()} if transport == "httpx's" else {}
        with scripted(reset, keep_alive) as (url, accepted):
            client = HttpClient(url, wire="json", retries=1, backoff=0.001, **chosen)
            client.compute(REQUEST)
            assert client.retry_stats.retries == 1 and accepted[0] == 2, transport
        with scripted(reset) as (url, _):
            chosen = {"transport": httpx.HTTPTransport()} if transport == "httpx's" else {}
            client = HttpClient(url, wire="json", retries=0, **chosen)
            with pytest.raises(AdvantageError) as info:
                client.compute(REQUEST)
            assert info.value.code == "unavailable", (transport, info.value)


@pytest.mark.parametrize("status", [b"502 Bad Gateway", b"504 Gateway Time-out"])
def test_a_proxys_lost_replica_is_retried_and_named_by_its_status(status: bytes) -> None:
    with scripted(gateway(status), keep_alive) as (url, accepted):
        client = HttpClient(url, wire="json", retries=1, backoff=0.001)
        client.compute(REQUEST)
        assert client.retry_stats.retries == 1 and accepted[0] == 2
    with scripted(gateway(status)) as (url, accepted):
        with pytest.raises(AdvantageError) as info:
            HttpClient(url, wire="json", retries=2, backoff=0.001).compute(REQUEST)
        code = int(status[:3])
        assert (info.value.code, info.value.status) == (f"http_{code}", code), info.value
        assert "unavailable" in info.value.message and accepted[0] == 3


def test_a_server_that_does_not_answer_is_a_timeout_in_time() -> None:
    with scripted(silent) as (url, _):
        client = HttpClient(url, wire="json", retries=0, timeout=0.3)
        start = time.monotonic()
        with pytest.raises(AdvantageError) as info:
            client.compute(REQUEST)
        assert info.value.code == "timeout", info.value
        assert time.monotonic() - start < 2


def test_nothing_listening_is_unavailable() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: connections are refused
        with pytest.raises(AdvantageError) as info:
            HttpClient(f"http://127.0.0.1:{port}", retries=0).compute(REQUEST)
    assert info.value.code == "unavailable", info.value


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    srv = Service.start(tmp_path_factory.mktemp("http11-service"))
    yield srv
    srv.stop()


def batch(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    groups = [
        {
            "id": f"g{g}",
            "rollouts": [
                {
                    "tokens": rng.integers(0, 500, int(rng.integers(1, 300))).tolist(),
                    "reward": float(rng.integers(0, 2)),
                }
                for _ in range(8)
            ],
        }
        for g in range(16)
    ]
    return {"estimator": "ktae", "namespace": f"http11-{seed}", "groups": groups}


@pytest.mark.integration
@pytest.mark.parametrize("wire", ["arrow", "json"])
def test_the_services_answers_are_what_httpxs_transport_reads_from_several_threads(
    service: Service, wire: str, tmp_path: Path
) -> None:
    ours = HttpClient(service.url, wire=wire)
    theirs = HttpClient(service.url, wire=wire, transport=httpx.HTTPTransport())
    assert isinstance(ours.http._transport, Http11Transport)
    # A namespace per request and per client: KTAE's history must not make the two differ.
    requests = [batch(seed) for seed in range(12)]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(ours.compute, requests))
    for request in requests:
        request["namespace"] += "-httpx"
    expected = [theirs.compute(request) for request in requests]
    for a, b in zip(got, expected, strict=True):
        for ga, gb in zip(a["groups"], b["groups"], strict=True):
            for ra, rb in zip(ga["rollouts"], gb["rollouts"], strict=True):
                np.testing.assert_array_equal(ra["advantages"], rb["advantages"])
    ours.close()
    theirs.close()


def answering(body: bytes) -> Callable[[socket.socket], None]:
    """Answers every request 200 with ``body`` (a proxy's page, a cut or foreign answer)."""

    def serve(conn: socket.socket) -> None:
        with conn:
            while read_request(conn):
                conn.sendall(answer(body))

    return serve


def arrow_stream_without_metadata() -> bytes:
    import pyarrow as pa

    table = pa.table({"advantages": pa.array([[0.5]], pa.list_(pa.float32()))})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


@pytest.mark.parametrize(
    ("wire", "body"),
    [
        ("arrow", b""),
        ("arrow", b"<html>502</html>"),
        ("arrow", arrow_stream_without_metadata()),
        ("arrow", arrow_stream_without_metadata()[:40]),
        ("json", b"<html>502</html>"),
        ("json", ANSWER[: len(ANSWER) // 2]),
        ("json", b"{}"),
        ("json", b"[]"),
        ("json", b'"text"'),
    ],
)
def test_a_200_that_is_not_the_services_answer_is_an_invalid_response(
    wire: str, body: bytes
) -> None:
    # (Before: pyarrow's ArrowInvalid or OSError, orjson's JSONDecodeError, a KeyError or a
    # TypeError reached the caller.)
    with scripted(answering(body)) as (url, accepted), pytest.raises(AdvantageError) as info:
        HttpClient(url, wire=wire, retries=0).compute(REQUEST)  # type: ignore[arg-type]
    assert info.value.code == "invalid_response", info.value
    assert accepted[0] == 1


@pytest.mark.parametrize("body", [b"<html>502</html>", b"[]", b"{"])
def test_an_estimator_listing_that_is_not_one_is_an_invalid_response(body: bytes) -> None:
    with scripted(answering(body)) as (url, _), pytest.raises(AdvantageError) as info:
        HttpClient(url, retries=0).list_estimators()
    assert info.value.code == "invalid_response", info.value


@pytest.mark.parametrize(
    "options",
    [
        {"return": "scalar"},  # (gRPC sent 's', 'c', ... before)
        {"return": ["scalar", 3]},
        {"vocab_size": 3.5},  # (gRPC sent 3 before)
        {"vocab_size": True},
        {"vocab_size": 0},
        {"ignore_token_ids": ["x"]},
        {"ignore_token_ids": [1.5]},
        {"namespace": 5},
        {"request_id": 5},
    ],
    ids=str,
)
def test_a_wrong_option_is_the_same_error_from_both_clients(
    service: Service, options: dict[str, Any]
) -> None:
    """The JSON request's options as the gRPC client encodes them: a value the message would
    coerce or refuse is the error the service answers the JSON request (protobuf's TypeError
    or a silent truncation before)."""
    request = {**REQUEST, **options}
    errors = []
    for client in (
        HttpClient(service.url, wire="json", retries=0),
        GrpcClient(service.target, retries=0),
    ):
        with client, pytest.raises(AdvantageError) as info:
            client.compute(request)
        errors.append((info.value.code, info.value.field))
    assert errors[0] == errors[1], errors
    assert errors[0][1] == next(iter(options)), errors


def test_a_message_over_the_body_limit_is_the_same_error_from_both_clients(
    tmp_path: Path,
) -> None:
    # (gRPC refuses it before the service sees it, RESOURCE_EXHAUSTED without the service's
    # code: the client called it 'resource_exhausted' where HTTP says limit_exceeded on body.)
    small = Service.start(tmp_path, max_body_bytes=100_000)
    try:
        request = {
            "groups": [{"id": "g", "rollouts": [{"tokens": list(range(1, 50_000)), "reward": 1.0}]}]
        }
        errors = []
        for client in (
            HttpClient(small.url, retries=0),
            GrpcClient(small.target, retries=0),
        ):
            with client, pytest.raises(AdvantageError) as info:
                client.compute(request)
            errors.append((info.value.code, info.value.field))
        assert errors == [("limit_exceeded", "body")] * 2, errors
    finally:
        small.stop()
