"""Bearer tokens and namespaces on a real service, over both transports: the 401/403/200 matrix,
the open routes, reloading the tokens file (a Kubernetes Secret's symlink swap included), a bad
file at start and on reload, and one namespace never reading another's statistics or history.
"""

from __future__ import annotations

import json
import os
import queue
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from advantage_client.grpc_client import compute_request_message, options_message, rollout_message
from advantage_contract.grpc_gen import advantage_pb2 as pb
from advantage_contract.grpc_gen import advantage_pb2_grpc as pb_grpc
from process_support import poll
from stats.redis_support import RedisServer
from support import Service, bearer, launch, start_service, write_tokens

pytestmark = pytest.mark.integration

ARROW = "application/vnd.apache.arrow.stream"
TOKENS = {
    "token-team-a": ["team-a"],
    "token-both": ["team-a", "team-b"],
    "token-admin": ["*"],
}
# (token or None, namespace) -> expected HTTP status
MATRIX = [
    (None, "team-a", 401),
    ("not-a-token", "team-a", 401),
    ("token-team-a", "team-a", 200),
    ("token-team-a", "team-b", 403),
    ("token-team-a", "default", 403),
    ("token-both", "team-b", 200),
    ("token-admin", "team-z", 200),
    ("token-admin", "default", 200),
]
GRPC_CODES = {
    200: grpc.StatusCode.OK,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
}


def request(
    namespace: str, *, history: bool = False, request_id: str | None = None
) -> dict[str, Any]:
    ktae: dict[str, Any] = {"history": "prompt", "history_decay": 1.0} if history else {}
    out: dict[str, Any] = {
        "namespace": namespace,
        "estimator": {"outcome": "grpo", "ktae": ktae},
        "return": ["ktae_score"],
        "groups": [
            {
                "id": "prompt-1",
                "rollouts": [
                    {"tokens": [5, 6, 7], "reward": 1.0},
                    {"tokens": [5, 8], "reward": 0.0},
                    {"tokens": [6, 9, 9], "reward": 0.0},
                ],
            }
        ],
    }
    if request_id is not None:
        out["request_id"] = request_id
    return out


def headers(token: str | None) -> dict[str, str]:
    return bearer(token) if token is not None else {}


def metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token is not None else ()


@pytest.fixture
def tokens_file(tmp_path: Path) -> Path:
    return write_tokens(tmp_path / "tokens.json", TOKENS)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """One service for the tests that do not change its tokens file."""
    directory = tmp_path_factory.mktemp("auth")
    service = start_service(
        directory, auth_tokens_file=write_tokens(directory / "tokens.json", TOKENS)
    )
    yield service
    service.stop()


@pytest.fixture
def service(service_factory: Callable[..., Service], tokens_file: Path) -> Service:
    return service_factory(auth_tokens_file=tokens_file, auth_reload_seconds=0.2)


def arrow_body(req: dict[str, Any]) -> bytes:
    from advantage_client.http_client import arrow_request_body

    return arrow_request_body(req)


def grpc_compute_code(service: Service, token: str | None, namespace: str) -> grpc.StatusCode:
    with service.channel() as channel:
        stub = pb_grpc.AdvantageServiceStub(channel)
        try:
            stub.Compute(
                compute_request_message(request(namespace)), metadata=metadata(token), timeout=30
            )
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def grpc_stream_code(service: Service, token: str | None, namespace: str) -> grpc.StatusCode:
    req = request(namespace)
    group = req["groups"][0]
    messages = [pb.StreamRequest(options=options_message(namespace=namespace, estimator="ktae"))]
    for r in group["rollouts"]:
        rollout = {"group_id": group["id"], "group_size": len(group["rollouts"]), **r}
        messages.append(pb.StreamRequest(rollout=rollout_message(rollout)))
    with service.channel() as channel:
        stub = pb_grpc.AdvantageServiceStub(channel)
        try:
            results = list(stub.StreamCompute(iter(messages), metadata=metadata(token), timeout=30))
        except grpc.RpcError as exc:
            return exc.code()
    assert [r.WhichOneof("kind") for r in results] == ["result"]
    return grpc.StatusCode.OK


@pytest.mark.parametrize(("token", "namespace", "status"), MATRIX)
def test_http_advantages_answers_401_403_200_by_token_and_namespace(
    shared: Service, token: str | None, namespace: str, status: int
) -> None:
    json_answer = shared.http.post(
        "/v1/advantages", json=request(namespace), headers=headers(token)
    )
    arrow_answer = shared.http.post(
        "/v1/advantages",
        content=arrow_body(request(namespace)),
        headers={**headers(token), "content-type": ARROW},
    )
    for answer in (json_answer, arrow_answer):
        assert answer.status_code == status, answer.text
        if status == 401:
            assert answer.headers["www-authenticate"].startswith("Bearer")
            assert answer.json()["error"]["code"] == "unauthenticated"
        if status == 403:
            assert answer.json()["error"]["code"] == "permission_denied"
            assert answer.json()["error"]["field"] == "namespace"


@pytest.mark.parametrize(("token", "namespace", "status"), MATRIX)
def test_http_token_stats_answers_401_403_200_by_token_and_namespace(
    shared: Service, token: str | None, namespace: str, status: int
) -> None:
    answer = shared.http.get(
        "/v1/stats/tokens", params={"namespace": namespace}, headers=headers(token)
    )
    assert answer.status_code == status, answer.text


@pytest.mark.parametrize(("token", "namespace", "status"), MATRIX)
def test_grpc_compute_and_stream_answer_unauthenticated_denied_ok(
    shared: Service, token: str | None, namespace: str, status: int
) -> None:
    assert grpc_compute_code(shared, token, namespace) == GRPC_CODES[status]
    assert grpc_stream_code(shared, token, namespace) == GRPC_CODES[status]


def test_listings_need_a_valid_token_and_probes_stay_open(shared: Service) -> None:
    assert shared.http.get("/v1/estimators").status_code == 401
    assert shared.http.get("/v1/estimators", headers=bearer("wrong")).status_code == 401
    assert shared.http.get("/v1/estimators", headers=bearer("token-team-a")).status_code == 200
    for route in ("/healthz", "/readyz", "/metrics", "/openapi.json"):
        assert shared.http.get(route).status_code == 200, route
    with shared.channel() as channel:
        stub = pb_grpc.AdvantageServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.ListEstimators(pb.ListEstimatorsRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        stub.ListEstimators(pb.ListEstimatorsRequest(), metadata=metadata("token-both"), timeout=10)
    assert shared.grpc_health() == 1  # SERVING, without a token


def test_a_bad_scheme_is_401_and_tokens_never_reach_the_log(shared: Service) -> None:
    answer = shared.http.post(
        "/v1/advantages", json=request("team-a"), headers={"authorization": "Basic dXNlcjpwdw=="}
    )
    assert answer.status_code == 401
    shared.http.post("/v1/advantages", json=request("team-a"), headers=bearer("token-team-a"))
    shared.http.post("/v1/advantages", json=request("team-a"), headers=bearer("guess-1234"))
    grpc_compute_code(shared, "token-admin", "team-a")
    output = shared.output()
    for secret in (*TOKENS, "guess-1234", "dXNlcjpwdw=="):
        assert secret not in output
    statuses = [line["status"] for line in shared.access_lines()]
    assert {200, 401} <= set(statuses)
    metrics = shared.metrics()
    assert metrics[("advantage_auth_tokens", ())] == len(TOKENS)


def test_tokens_file_changes_take_effect_without_restart(
    service: Service, tokens_file: Path
) -> None:
    def status(token: str, namespace: str) -> int:
        return service.http.post(
            "/v1/advantages", json=request(namespace), headers=bearer(token)
        ).status_code

    assert status("token-team-a", "team-b") == 403
    write_tokens(tokens_file, {"token-team-a": ["team-a", "team-b"], "token-new": ["team-c"]})
    poll(lambda: status("token-team-a", "team-b") == 200, 30, "the widened token")
    assert status("token-new", "team-c") == 200
    assert status("token-admin", "team-a") == 401  # removed from the file
    assert grpc_compute_code(service, "token-new", "team-c") == grpc.StatusCode.OK
    assert grpc_compute_code(service, "token-admin", "team-a") == grpc.StatusCode.UNAUTHENTICATED

    # A file that does not parse keeps the tokens in force, and is logged and counted.
    tokens_file.write_text('{"tokens": {"token-x": "not a list"}}')
    poll(
        lambda: (
            service.metrics().get(("advantage_auth_reloads_total", (("outcome", "error"),))) == 1
        ),
        30,
        "the failed reload to be counted",
    )
    assert status("token-new", "team-c") == 200
    assert "tokens file not reloaded" in service.output()


def test_a_kubernetes_secret_update_swaps_the_symlink_and_is_picked_up(
    service_factory: Callable[..., Service], tmp_path: Path
) -> None:
    # The layout of a Secret volume: tokens.json -> ..data/tokens.json, ..data -> ..<version>
    mount = tmp_path / "secret"
    first = mount / "..v1"
    first.mkdir(parents=True)
    write_tokens(first / "tokens.json", {"token-old": ["team-a"]})
    (mount / "..data").symlink_to("..v1")
    (mount / "tokens.json").symlink_to("..data/tokens.json")
    service = service_factory(auth_tokens_file=mount / "tokens.json", auth_reload_seconds=0.2)

    def status(token: str) -> int:
        return service.http.post(
            "/v1/advantages", json=request("team-a"), headers=bearer(token)
        ).status_code

    assert status("token-old") == 200
    second = mount / "..v2"
    second.mkdir()
    write_tokens(second / "tokens.json", {"token-rotated": ["team-a"]})
    (mount / "..data_tmp").symlink_to("..v2")
    os.replace(mount / "..data_tmp", mount / "..data")  # the kubelet's atomic swap
    poll(lambda: status("token-rotated") == 200, 30, "the rotated token")
    assert status("token-old") == 401


@pytest.mark.parametrize(
    "content",
    ["not json", '{"tokens": []}', '{"tokens": {"t": []}}', '{"tokens": {"t": ["a"]}, "x": 1}'],
)
def test_a_bad_tokens_file_at_start_exits_2_without_naming_tokens(
    tmp_path: Path, content: str
) -> None:
    path = tmp_path / "tokens.json"
    path.write_text(content)
    proc, _, _, log = launch(tmp_path, {"auth_tokens_file": path})
    assert proc.wait(120) == 2
    assert "tokens file" in log.read_text()


def test_a_missing_tokens_file_at_start_exits_2(tmp_path: Path) -> None:
    proc, _, _, log = launch(tmp_path, {"auth_tokens_file": tmp_path / "absent.json"})
    assert proc.wait(120) == 2
    assert "cannot read the tokens file" in log.read_text()


def test_without_a_tokens_file_the_service_is_open_and_says_so_loudly(
    service_factory: Callable[..., Service],
) -> None:
    service = service_factory(log_level="info")
    assert service.http.post("/v1/advantages", json=request("team-a")).status_code == 200
    warnings = [
        json.loads(line)
        for line in service.output().splitlines()
        if line.startswith("{") and "AUTHENTICATION IS OFF" in line
    ]
    assert warnings and warnings[0]["level"] == "warning"


# ---- isolation --------------------------------------------------------------------------------


def test_one_namespace_never_reads_another_namespaces_statistics_or_history(
    service_factory: Callable[..., Service], tokens_file: Path, redis_server: RedisServer
) -> None:
    service = service_factory(auth_tokens_file=tokens_file, redis_url=redis_server.url)
    a, both = bearer("token-team-a"), bearer("token-both")

    def stats(namespace: str, token: dict[str, str]) -> Any:
        return service.http.get("/v1/stats/tokens", params={"namespace": namespace}, headers=token)

    def post(namespace: str, token: dict[str, str], request_id: str) -> dict[str, Any]:
        answer = service.http.post(
            "/v1/advantages",
            json=request(namespace, history=True, request_id=request_id),
            headers=token,
        )
        assert answer.status_code == 200, answer.text
        return answer.json()

    # team-b's visits of prompt-1 build history and statistics in team-b only.
    post("team-b", both, "b-1")
    post("team-b", both, "b-2")
    poll(lambda: stats("team-b", both).json()["rollouts_counted"] == 6, 30, "team-b counted")
    # team-a's first visit of the same prompt id sees no history: its scores are those of a
    # first visit, the same as team-b's first visit.
    first_b = post("team-c", bearer("token-admin"), "c-1")
    first_a = post("team-a", a, "a-1")
    assert first_a["groups"] == first_b["groups"]
    poll(lambda: stats("team-a", a).json()["rollouts_counted"] == 3, 30, "team-a counted")
    assert stats("team-b", both).json()["rollouts_counted"] == 6
    # The same request id in another namespace is a different request (counted again).
    post("team-a", a, "b-1")
    poll(lambda: stats("team-a", a).json()["rollouts_counted"] == 6, 30, "team-a counted twice")
    # team-a's token cannot read team-b's statistics or compute in team-b.
    assert stats("team-b", a).status_code == 403
    denied = service.http.post("/v1/advantages", json=request("team-b", history=True), headers=a)
    assert denied.status_code == 403
    assert grpc_compute_code(service, "token-team-a", "team-b") == grpc.StatusCode.PERMISSION_DENIED


def test_two_credentials_on_one_call_are_refused_whatever_their_order(shared: Service) -> None:
    """A call carrying a team token and a wildcard token is not judged by whichever comes last:
    ambiguous credentials are a 401 / UNAUTHENTICATED over HTTP and gRPC, both orders."""
    body = request("team-z")
    for pair in (("token-team-a", "token-admin"), ("token-admin", "token-team-a")):
        raw = httpx.Request(
            "POST",
            f"{shared.url}/v1/advantages",
            json=body,
            headers=[("authorization", f"Bearer {t}") for t in pair],
        )
        with httpx.Client(timeout=30) as client:
            answer = client.send(raw)
        assert answer.status_code == 401, answer.text
        assert "more than one" in answer.json()["error"]["message"]
        with shared.channel() as channel:
            stub = pb_grpc.AdvantageServiceStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.Compute(
                    compute_request_message(body),
                    metadata=[("authorization", f"Bearer {t}") for t in pair],
                    timeout=30,
                )
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # One of them alone still works.
    ok = httpx.post(
        f"{shared.url}/v1/advantages", json=body, headers=bearer("token-admin"), timeout=30
    )
    assert ok.status_code == 200


# ---- one rule on every route, and streams across reloads ---------------------------------------

VIEWER_ROUTES: list[tuple[str, str, dict[str, Any] | None]] = [
    ("GET", "/viewer/api/recent?namespace=team-a", None),
    ("GET", "/viewer/api/requests/r-1?namespace=team-a", None),
    ("POST", "/viewer/api/diagnostics", {"estimator": "grpo"}),
    ("POST", "/viewer/api/token-text", {"ids": [1, 2]}),
]


@pytest.mark.parametrize(("method", "route", "body"), VIEWER_ROUTES)
def test_two_credentials_are_refused_on_the_viewers_routes_as_on_the_api(
    shared: Service, method: str, route: str, body: dict[str, Any] | None
) -> None:
    """The viewer's routes make the API's call: a team token and a wildcard token together
    are a 401 whatever their order (the viewer used to take the first one)."""
    for pair in (("token-team-a", "token-admin"), ("token-admin", "token-team-a")):
        with httpx.Client(base_url=shared.url, timeout=30) as client:
            raw = client.build_request(
                method,
                route,
                json=body,
                headers=[("authorization", f"Bearer {t}") for t in pair],
            )
            answer = client.send(raw)
        assert answer.status_code == 401, (pair, answer.text)
        assert answer.headers["www-authenticate"].startswith("Bearer")
        error = answer.json()["error"]
        assert error["code"] == "unauthenticated" and "more than one" in error["message"]
    # Either token alone is accepted (a kept request that is absent is a 404, not a 401).
    alone = shared.http.request(method, route, json=body, headers=bearer("token-admin"))
    assert alone.status_code in (200, 404), alone.text


def test_two_credentials_end_a_stream_unauthenticated(shared: Service) -> None:
    messages = [pb.StreamRequest(options=options_message(namespace="team-a", estimator="grpo"))]
    with shared.channel() as channel, pytest.raises(grpc.RpcError) as info:
        list(
            pb_grpc.AdvantageServiceStub(channel).StreamCompute(
                iter(messages),
                metadata=[("authorization", "Bearer token-team-a")] * 2,
                timeout=30,
            )
        )
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


class OpenStream:
    """A StreamCompute call whose messages the test sends one group at a time."""

    def __init__(self, stub: pb_grpc.AdvantageServiceStub, token: str, namespace: str) -> None:
        self.feed: queue.Queue[pb.StreamRequest | None] = queue.Queue()
        self.feed.put(
            pb.StreamRequest(options=options_message(namespace=namespace, estimator="grpo"))
        )
        self.responses = stub.StreamCompute(
            iter(self.feed.get, None), metadata=metadata(token), timeout=60
        )

    def send_group(self, group_id: str) -> None:
        rollouts = [{"tokens": [5, 6, 7], "reward": 1.0}, {"tokens": [5, 8], "reward": 0.0}]
        for rollout in rollouts:
            message = rollout_message({"group_id": group_id, "group_size": 2, **rollout})
            self.feed.put(pb.StreamRequest(rollout=message))

    def result(self) -> str:
        response = next(self.responses)
        assert response.WhichOneof("kind") == "result", response
        return str(response.result.group_id)

    def end(self) -> grpc.StatusCode:
        """How the call ends: its status once no response is left (none may be)."""
        try:
            extra = list(self.responses)
        except grpc.RpcError as exc:
            return exc.code()
        assert not extra, extra
        return grpc.StatusCode.OK

    def close(self) -> None:
        self.feed.put(None)


def computed(service: Service) -> tuple[float, float]:
    """(rollouts computed, gRPC calls answered 200) so far, from the metrics."""
    samples = service.metrics()
    ok = sum(
        value
        for (name, labels), value in samples.items()
        if name == "advantage_requests_total"
        and dict(labels).get("transport") == "grpc"
        and dict(labels).get("code") == "200"
    )
    return samples[("advantage_rollouts_total", ())], ok


def test_an_open_stream_ends_when_a_reload_revokes_its_token_or_its_namespace(
    service_factory: Callable[..., Service], tmp_path: Path
) -> None:
    """A token removed from the file ends its open streams UNAUTHENTICATED (one that lost the
    stream's namespace: PERMISSION_DENIED) within a bounded time of the reload, also while the
    client sends nothing; a group completed after the reload is neither answered nor counted.
    A stream whose token is still allowed goes on."""
    path = write_tokens(
        tmp_path / "tokens.json",
        {
            "token-admin": ["*"],
            "token-revoked": ["team-a"],
            "token-narrowed": ["team-a", "team-b"],
            "token-kept": ["team-a"],
        },
    )
    service = service_factory(auth_tokens_file=path, auth_reload_seconds=0.2)
    with service.channel() as channel:
        stub = pb_grpc.AdvantageServiceStub(channel)
        idle = OpenStream(stub, "token-revoked", "team-a")
        busy = OpenStream(stub, "token-revoked", "team-a")
        narrowed = OpenStream(stub, "token-narrowed", "team-b")
        kept = OpenStream(stub, "token-kept", "team-a")
        streams = (idle, busy, narrowed, kept)
        try:
            for stream in streams:
                stream.send_group("before")
                assert stream.result() == "before"
            before = computed(service)
            assert before == (8.0, 4.0)

            write_tokens(
                path, {"token-admin": ["*"], "token-narrowed": ["team-a"], "token-kept": ["team-a"]}
            )
            rewritten = time.monotonic()
            # The reload is in force once HTTP refuses the token (a listing: counts nothing).
            poll(
                lambda: (
                    service.http.get("/v1/estimators", headers=bearer("token-revoked")).status_code
                    == 401
                ),
                30,
                "the reload",
            )
            busy.send_group("after")  # completed after the revocation
            assert idle.end() == grpc.StatusCode.UNAUTHENTICATED
            assert busy.end() == grpc.StatusCode.UNAUTHENTICATED
            assert narrowed.end() == grpc.StatusCode.PERMISSION_DENIED
            assert time.monotonic() - rewritten < 15

            kept.send_group("after")
            assert kept.result() == "after"
            kept.close()
            assert kept.end() == grpc.StatusCode.OK
        finally:
            for stream in streams:
                stream.close()
    # Only the kept stream's second group was computed after the reload.
    assert computed(service) == (before[0] + 2, before[1] + 1)
    # Each stream ended by the reload is counted once, as its end's status.
    ends = [line["status"] for line in service.access_lines() if line["transport"] == "grpc"]
    assert sorted(status for status in ends if status != 200) == [401, 401, 403]
