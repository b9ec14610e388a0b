"""One client's slow or idle connections never lock another out: a real service, two tenants
(bearer tokens team-a and team-b), attacks from real sockets.

- slow bodies: team-a's 300 connections trickle a body at a byte a second; team-b is served;
- slow headers: 1,100 unauthenticated connections trickle their headers; team-b is served and
  ``/readyz`` answers;
- headers over the limit are a 431, not a reset or a 400;
- streams: team-a holding its share of ``ADV_STREAM_MAX_OPEN`` (idle) leaves team-b its own; a
  token's own limit from the tokens file holds; an idle stream ends by itself and gives its
  place back; what incomplete stream groups hold counts in the byte budget.
"""

from __future__ import annotations

import asyncio
import json
import queue
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from advantage_client import GrpcClient
from advantage_client.grpc_client import options_message, rollout_message
from advantage_client.grpc_codec import compute_request_message, from_tensor
from advantage_contract.grpc_gen import advantage_pb2 as pb
from advantage_contract.grpc_gen import advantage_pb2_grpc as pb_grpc
from process_support import poll
from support import Service, bearer

TOKENS = {
    "token-of-team-a": {"namespaces": ["team-a"], "name": "team-a"},
    "token-of-team-b": {"namespaces": ["team-b"], "name": "team-b"},
}


def tokens_file(directory: Path, tokens: dict[str, Any] | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokens.json"
    path.write_text(json.dumps({"tokens": tokens or TOKENS}))
    return path


def body(namespace: str, seed: int = 0) -> bytes:
    groups = [
        {
            "id": f"prompt-{seed}-{g}",
            "rollouts": [
                {"tokens": [1 + g, 2, 3, 4 + seed % 7], "reward": 1.0},
                {"tokens": [5, 6 + g], "reward": 0.0},
            ],
        }
        for g in range(4)
    ]
    return json.dumps({"namespace": namespace, "estimator": "grpo", "groups": groups}).encode()


def timed_posts(
    service: Service, count: int, *, token: str = "token-of-team-b", pause: float = 0.2
) -> tuple[list[int], list[float]]:
    """``count`` requests of team-b's, one after another on fresh connections: their statuses
    and seconds."""
    statuses, seconds = [], []
    for n in range(count):
        start = time.perf_counter()
        try:
            with httpx.Client(base_url=service.url, timeout=30.0) as client:
                answer = client.post(
                    "/v1/advantages",
                    content=body("team-b", n),
                    headers={**bearer(token), "content-type": "application/json"},
                )
            statuses.append(answer.status_code)
        except httpx.TransportError:
            statuses.append(0)
        seconds.append(time.perf_counter() - start)
        time.sleep(pause)
    return statuses, seconds


class Trickle:
    """``count`` connections to the service's HTTP port, each sending ``head`` then one byte of
    ``tail`` per second, on an event loop in a thread; what each got back is kept."""

    def __init__(self, port: int, count: int, head: bytes, tail: bytes) -> None:
        self.port, self.count, self.head, self.tail = port, count, head, tail
        self.opened = self.ended = 0
        self.answers: list[bytes] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self.thread.start()

    async def _one(self) -> None:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        except OSError:
            return
        self.opened += 1
        try:
            writer.write(self.head)
            await writer.drain()
            for byte in self.tail:
                if self.stop.is_set() or reader.at_eof():
                    break
                writer.write(bytes([byte]))
                await writer.drain()
                try:
                    got = await asyncio.wait_for(reader.read(4096), 1.0)
                except TimeoutError:
                    continue
                self.answers.append(got)
                break
        except OSError:
            pass
        finally:
            self.ended += 1
            writer.close()

    async def _run(self) -> None:
        await asyncio.gather(*(self._one() for _ in range(self.count)))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=30)

    def statuses(self) -> list[int]:
        return [int(a.split(b" ", 2)[1]) for a in self.answers if a.startswith(b"HTTP/1.1 ")]


def slow_bodies(service: Service) -> Trickle:
    """team-a's 300 connections, each declaring a 4 KiB body and sending it a byte a second."""
    head = (
        b"POST /v1/advantages HTTP/1.1\r\nhost: x\r\nauthorization: Bearer token-of-team-a\r\n"
        b"content-type: application/json\r\ncontent-length: 4096\r\n\r\n"
    )
    return Trickle(service.http_port, 300, head, b"{" * 4096)


def slow_headers(service: Service) -> Trickle:
    """1,100 unauthenticated connections sending their request head a byte a second."""
    return Trickle(service.http_port, 1100, b"", b"GET /readyz HTTP/1.1\r\nhost: x" + b"x" * 60)


def unloaded_p50(service: Service) -> float:
    statuses, seconds = timed_posts(service, 7, pause=0.05)
    assert statuses == [200] * 7
    return statistics.median(seconds)


def assert_served(statuses: list[int], seconds: list[float], baseline: float) -> None:
    served = sum(1 for s in statuses if s == 200)
    assert served >= 0.9 * len(statuses), f"team-b served {served} of {len(statuses)}: {statuses}"
    p50 = statistics.median(seconds)
    assert p50 < 5 * baseline, f"team-b's p50 {p50 * 1000:.0f} ms, unloaded {baseline * 1000:.0f}"


@pytest.mark.integration
def test_team_a_slow_bodies_leave_team_b_served(
    service_factory: Callable[..., Service], tmp_path: Path
) -> None:
    """300 connections of team-a's each declare a 4 KiB body and send it a byte a second:
    today's queue held a place for each (256: every other request 503 for the 60 s body
    timeout). Now bodies being received hold no place among the requests, team-a holds at most
    half of the places for bodies, and a body slower than the minimum rate is cut after the
    grace period (408)."""
    service = service_factory(auth_tokens_file=tokens_file(tmp_path / "auth"))
    baseline = unloaded_p50(service)
    attack = slow_bodies(service)
    try:
        time.sleep(2.0)
        statuses, seconds = timed_posts(service, 12)
        assert_served(statuses, seconds, baseline)
        # Each of team-a's connections is answered: at once (over its share), or once under
        # the minimum rate past the grace period (5 s), and closed.
        poll(lambda: attack.ended == 300, 30, "every slow body to be answered")
    finally:
        attack.close()
    refused = attack.statuses()
    # team-a's bodies beyond its share were refused at once; the rest were cut as too slow.
    assert refused.count(503) >= 300 - 128, refused
    assert 408 in refused, refused
    samples = service.metrics()
    key = ("advantage_tenant_refusals_total", (("resource", "bodies"), ("tenant", "team-a")))
    assert samples[key] >= 300 - 128
    assert (
        "advantage_tenant_refusals_total",
        (("resource", "bodies"), ("tenant", "team-b")),
    ) not in samples


@pytest.mark.integration
def test_slow_headers_leave_team_b_served_and_readiness_answering(
    service_factory: Callable[..., Service], tmp_path: Path
) -> None:
    """1,100 connections that send their headers a byte a second, before any authentication:
    uvicorn counted them against ADV_MAX_CONNECTIONS (1,024) and answered every request 503,
    /readyz included, for as long as they stayed. Now they are pending connections: the oldest
    gives way to a new one, and none holds a place a request needs."""
    service = service_factory(auth_tokens_file=tokens_file(tmp_path / "auth"))
    baseline = unloaded_p50(service)
    attack = slow_headers(service)
    try:
        poll(lambda: attack.opened >= 1100, 30, "the attack's connections to open")
        time.sleep(2.0)
        ready = httpx.get(f"{service.url}/readyz", timeout=10.0)
        statuses, seconds = timed_posts(service, 12)
    finally:
        attack.close()
    assert ready.status_code == 200, ready.text
    assert_served(statuses, seconds, baseline)
    samples = service.metrics()
    assert samples[("advantage_http_connections_closed_total", (("reason", "pending_full"),))] > 0


@pytest.mark.integration
def test_both_attacks_at_once_leave_team_b_served(
    service_factory: Callable[..., Service], tmp_path: Path
) -> None:
    """team-a's 300 slow bodies and 1,100 unauthenticated slow-header connections together:
    team-b's requests from 2 s into the attack are answered 200 (9 in 10 at least), its median
    within 5x of an idle service's."""
    service = service_factory(auth_tokens_file=tokens_file(tmp_path / "auth"))
    baseline = unloaded_p50(service)
    bodies = slow_bodies(service)
    headers = slow_headers(service)
    try:
        poll(lambda: bodies.opened + headers.opened >= 1400, 30, "the attacks' connections")
        time.sleep(2.0)
        statuses, seconds = timed_posts(service, 12)
    finally:
        bodies.close()
        headers.close()
    assert_served(statuses, seconds, baseline)


@pytest.mark.integration
def test_a_connection_that_does_not_finish_its_headers_is_closed(
    service_factory: Callable[..., Service],
) -> None:
    """ADV_HEADER_TIMEOUT_SECONDS 1: half a request line, then silence, is closed after about
    a second (uvicorn had no such deadline: it stayed open); a connection kept alive after an
    answer has the same deadline for its next request's headers."""
    service = service_factory(header_timeout_seconds=1.0)
    with socket.create_connection(("127.0.0.1", service.http_port), timeout=15) as sock:
        sock.sendall(b"GET /heal")
        start = time.monotonic()
        assert sock.recv(1024) == b""  # closed by the service
        assert time.monotonic() - start < 5
    samples = service.metrics()
    assert (
        samples[("advantage_http_connections_closed_total", (("reason", "header_timeout"),))] >= 1
    )


@pytest.mark.parametrize("pieces", [1, 16])
@pytest.mark.integration
def test_headers_over_the_limit_are_431(
    service_factory: Callable[..., Service], pieces: int
) -> None:
    """Whole in one read (measured by the app) or in pieces (h11's buffer limit): a 431 naming
    the setting, not a 400 or a reset."""
    service = service_factory(max_header_bytes=4096)
    request = b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 8192 + b"\r\n\r\n"
    with socket.create_connection(("127.0.0.1", service.http_port), timeout=10) as sock:
        step = -(-len(request) // pieces)
        try:
            for start in range(0, len(request), step):
                sock.sendall(request[start : start + step])
                time.sleep(0.05 if pieces > 1 else 0)
        except OSError:  # (closed once over the limit: the answer is still there to read)
            pass
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 "), head
    error = json.loads(payload)["error"]
    assert error["code"] == "headers_too_large" and "ADV_MAX_HEADER_BYTES" in error["message"]
    # Below the limit all is as before.
    assert service.http.get("/healthz", headers={"x-big": "a" * 2048}).status_code == 200


# ---- streams -------------------------------------------------------------------------------------


class HeldStream:
    """A StreamCompute call whose messages come from a queue (None ends it), its answers
    collected on a thread."""

    def __init__(self, channel: grpc.Channel, token: str, namespace: str) -> None:
        self.messages: queue.Queue[pb.StreamRequest | None] = queue.Queue()
        self.messages.put(pb.StreamRequest(options=options_message(namespace=namespace)))
        self.answers: list[pb.StreamResponse] = []
        self.error: grpc.RpcError | None = None
        self.done = threading.Event()
        stub = pb_grpc.AdvantageServiceStub(channel)
        self.call = stub.StreamCompute(self._requests(), metadata=bearer(token).items())
        threading.Thread(target=self._collect, daemon=True).start()

    def _requests(self) -> Iterator[pb.StreamRequest]:
        while (message := self.messages.get()) is not None:
            yield message

    def _collect(self) -> None:
        try:
            for answer in self.call:
                self.answers.append(answer)
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.done.set()

    def send(self, group_id: str, group_size: int, tokens: list[int], reward: float) -> None:
        rollout = rollout_message(
            {"group_id": group_id, "group_size": group_size, "tokens": tokens, "reward": reward}
        )
        self.messages.put(pb.StreamRequest(rollout=rollout))

    def close(self) -> None:
        self.messages.put(None)
        self.call.cancel()


def opened(stream: HeldStream, seconds: float = 2.0) -> bool:
    """True when the stream is still open after ``seconds`` (a refusal ends it at once)."""
    return not stream.done.wait(seconds)


@pytest.mark.integration
def test_team_a_at_its_stream_share_leaves_team_b_streams(
    service_factory: Callable[..., Service], tmp_path: Path
) -> None:
    """ADV_STREAM_MAX_OPEN 8: team-a's idle streams stop at its half (today all 8 and every
    other tenant refused until they close); team-b opens streams and computes; a token whose
    own limit is 1 stream gets 1."""
    tokens = {**TOKENS, "token-of-team-c": {"namespaces": ["team-c"], "limits": {"streams": 1}}}
    service = service_factory(
        auth_tokens_file=tokens_file(tmp_path / "auth", tokens), stream_max_open=8
    )
    channel = service.channel()
    held = [HeldStream(channel, "token-of-team-a", "team-a") for _ in range(8)]
    try:
        poll(lambda: sum(s.done.is_set() for s in held) >= 4, 10, "team-a's refusals")
        assert sum(opened(s, 0.5) for s in held) == 4
        refused = [s.error for s in held if s.done.is_set()]
        assert all(e is not None and e.code() == grpc.StatusCode.UNAVAILABLE for e in refused)
        assert "team-a" in refused[0].details() and "ADV_STREAM_MAX_OPEN" in refused[0].details()

        team_b = [HeldStream(channel, "token-of-team-b", "team-b") for _ in range(2)]
        assert all(opened(s) for s in team_b)
        team_b[0].send("g", 2, [1, 2, 3], 1.0)
        team_b[0].send("g", 2, [4, 5], 0.0)
        poll(lambda: team_b[0].answers, 30, "team-b's group")
        assert team_b[0].answers[0].WhichOneof("kind") == "result", team_b[0].answers[0]

        team_c = [HeldStream(channel, "token-of-team-c", "team-c") for _ in range(2)]
        assert opened(team_c[0]) and not opened(team_c[1], 0.5)
        for stream in [*team_b, *team_c]:
            stream.close()
    finally:
        for stream in held:
            stream.close()
        channel.close()


@pytest.mark.integration
def test_an_idle_stream_ends_and_gives_its_place_back(
    service_factory: Callable[..., Service],
) -> None:
    """A stream that sends half a group and then nothing is ended after the idle timeout: the
    incomplete group is answered with an error, the call ends DEADLINE_EXCEEDED, and its
    place (ADV_STREAM_MAX_OPEN 1 here) is free for the next stream."""
    service = service_factory(stream_max_open=1, stream_idle_timeout_seconds=1.0)
    channel = service.channel()
    try:
        idle = HeldStream(channel, "unused", "default")
        idle.send("half", 2, [1, 2, 3], 1.0)
        assert idle.done.wait(15), "the idle stream did not end"
        assert idle.error is not None and idle.error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "ADV_STREAM_IDLE_TIMEOUT_SECONDS" in idle.error.details()
        [answer] = idle.answers
        assert answer.error.error.code == "incomplete_group" and answer.error.group_id == "half"
        after = HeldStream(channel, "unused", "default")
        after.send("whole", 1, [1, 2], 1.0)
        poll(lambda: after.answers, 30, "the next stream's group")
        assert after.answers[0].WhichOneof("kind") == "result"
        after.close()
        samples = service.metrics()
        assert samples[("advantage_stream_open", ())] <= 1
    finally:
        channel.close()


@pytest.mark.integration
def test_what_incomplete_stream_groups_hold_counts_in_the_byte_budget(
    service_factory: Callable[..., Service],
) -> None:
    """ADV_MAX_QUEUE_BYTES 1 MiB: a stream's incomplete groups hold their rollouts' bytes in
    it (today a stream could hold ADV_STREAM_MAX_PENDING_TOKENS whatever the byte budget: 64
    streams ~4.3 GiB against a 1 GiB budget). Past the client's share its next rollout's group
    is refused with the limit named, and the stream goes on."""
    service = service_factory(max_queue_bytes=2**20)
    channel = service.channel()
    try:
        stream = HeldStream(channel, "unused", "default")
        tokens = list(range(20_000))  # 80 kB of int32 a rollout
        for g in range(12):
            stream.send(f"open-{g}", 2, tokens, 1.0)  # each group waits for a second rollout
        poll(lambda: stream.answers, 30, "a refused group")
        error = stream.answers[0].error.error
        assert error.code == "overloaded" and "ADV_MAX_QUEUE_BYTES" in error.message, error
        stream.send("small", 1, [1, 2], 1.0)
        poll(lambda: any(a.result.group_id == "small" for a in stream.answers), 30, "the next")
        assert stream.error is None
        stream.close()
    finally:
        channel.close()


def message_never_sent(release: threading.Event) -> Iterator[bytes]:
    """A unary call's requests that never come: the call stays open with no message."""
    release.wait()
    return
    yield b""  # (a generator)


def raw_compute(channel: grpc.Channel) -> Any:
    """``Compute`` called with its requests as raw bytes, so a call can send none."""
    return channel.stream_unary(
        "/advantage.v1.AdvantageService/Compute",
        request_serializer=lambda raw: raw,
        response_deserializer=pb.ComputeResponse.FromString,
    )


@pytest.mark.integration
def test_team_a_unary_calls_that_never_send_their_message_leave_team_b_served(
    service_factory: Callable[..., Service], tmp_path: Path
) -> None:
    """16 calls the service handles at once (ADV_MAX_CONNECTIONS), 8 messages being received
    (ADV_MAX_RECEIVING): team-a opens 16 Compute calls and sends no message. Before, each held
    its place until the client gave up (gRPC runs a unary handler only on a whole message) and
    team-b was refused 'Concurrent RPC limit exceeded'; now team-a holds its half of the 8, the
    rest refused at once, each ended past the body's deadline, and team-b is answered."""
    service = service_factory(
        auth_tokens_file=tokens_file(tmp_path / "auth"),
        max_connections=16,
        max_receiving=8,
        body_timeout_seconds=3,
    )
    channel = service.channel()
    compute = raw_compute(channel)
    release = threading.Event()
    try:
        held = [
            compute.future(message_never_sent(release), metadata=bearer("token-of-team-a").items())
            for _ in range(16)
        ]
        poll(lambda: sum(call.done() for call in held) >= 12, 10, "team-a's refusals")
        refused = [call for call in held if call.done()]
        assert {call.code() for call in refused} == {grpc.StatusCode.UNAVAILABLE}
        assert "team-a" in refused[0].details()

        stub = pb_grpc.AdvantageServiceStub(channel)
        team_b = json.loads(body("team-b"))
        answer = stub.Compute(
            compute_request_message(team_b), metadata=bearer("token-of-team-b").items(), timeout=10
        )
        assert len(from_tensor(answer.advantages)) == 24

        # The four team-a holds end at the body's deadline, their places given back.
        poll(lambda: all(call.done() for call in held), 10, "team-a's held calls ending")
        late = [call for call in held if call.code() == grpc.StatusCode.DEADLINE_EXCEEDED]
        assert len(late) == 4 and "did not arrive within 3 s" in late[0].details()
        team_a = json.loads(body("team-a"))
        answer = stub.Compute(
            compute_request_message(team_a), metadata=bearer("token-of-team-a").items(), timeout=10
        )
        assert len(from_tensor(answer.advantages)) == 24
    finally:
        release.set()
        channel.close()


@pytest.mark.integration
def test_grpc_client_retries_the_servers_call_limit_until_a_place_frees(
    service_factory: Callable[..., Service],
) -> None:
    """One call at once (ADV_MAX_CONNECTIONS 1), held by a call that sends no message: gRPC
    refuses the client's call RESOURCE_EXHAUSTED 'Concurrent RPC limit exceeded', which HTTP
    answers 503 for the same limit. GrpcClient retries it (it raised it at once) and is answered
    once the held call ends at the body's deadline (2 s)."""
    service = service_factory(max_connections=1, body_timeout_seconds=2)
    channel = service.channel()
    compute = raw_compute(channel)
    release = threading.Event()
    try:
        held = compute.future(message_never_sent(release))
        time.sleep(0.5)
        assert not held.done()
        with GrpcClient(service.target, backoff=0.2, max_backoff=0.5, timeout=10) as client:
            answer = client.compute(json.loads(body("default")))
            assert client.retry_stats.retries >= 1
        assert len(answer["groups"]) == 4
        assert held.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        release.set()
        channel.close()
