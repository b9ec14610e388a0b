"""TLS and mutual TLS on a real service, both transports, with certificates the test makes: the
right CA (and client certificate) connects; plaintext, an unknown CA and a missing or foreign
client certificate do not. The client package connects with its TLS options and a token."""

from __future__ import annotations

import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from advantage_client import AdvantageError, GrpcClient, HttpClient
from advantage_client.grpc_client import compute_request_message
from advantage_contract.grpc_gen import advantage_pb2_grpc as pb_grpc
from support import Service, Tls, bearer, launch, make_tls, write_tokens

pytestmark = pytest.mark.integration

REQUEST: dict[str, Any] = {
    "estimator": "grpo",
    "groups": [
        {
            "id": "p",
            "rollouts": [{"tokens": [1, 2, 3], "reward": 1.0}, {"tokens": [4], "reward": 0.0}],
        }
    ],
}


def grpc_compute(channel: grpc.Channel, **kwargs: Any) -> Any:
    stub = pb_grpc.AdvantageServiceStub(channel)
    return stub.Compute(compute_request_message(REQUEST), timeout=10, **kwargs)


def https_fails(url: str, verify: ssl.SSLContext | bool) -> bool:
    try:
        httpx.post(url + "/v1/advantages", json=REQUEST, verify=verify, timeout=10)
    except (httpx.TransportError, ssl.SSLError):
        return True
    return False


def test_tls_serves_https_and_grpc_to_clients_that_trust_its_ca(
    service_factory: Callable[..., Service], tls: Tls
) -> None:
    service = service_factory(tls=tls)
    assert service.url.startswith("https://")
    answer = service.http.post("/v1/advantages", json=REQUEST)
    assert answer.status_code == 200
    np.testing.assert_allclose(answer.json()["groups"][0]["rollouts"][0]["advantages"], 0.70710576)
    with service.channel() as channel:
        assert grpc_compute(channel).summary.rollouts == 2

    # Plaintext on either port, or a client that does not trust the CA, gets nowhere.
    assert https_fails(f"http://127.0.0.1:{service.http_port}", True)
    assert https_fails(service.url, ssl.create_default_context())
    with grpc.insecure_channel(service.target) as channel, pytest.raises(grpc.RpcError) as plain:
        grpc_compute(channel)
    assert plain.value.code() == grpc.StatusCode.UNAVAILABLE
    other = make_tls(service.log.parent / "other-ca")
    with (
        grpc.secure_channel(
            service.target, grpc.ssl_channel_credentials(other.ca.read_bytes())
        ) as channel,
        pytest.raises(grpc.RpcError) as untrusted,
    ):
        grpc_compute(channel)
    assert untrusted.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_needs_a_client_certificate_from_the_client_ca(
    service_factory: Callable[..., Service], tls: Tls
) -> None:
    service = service_factory(tls=tls, mutual=True)
    assert service.http.post("/v1/advantages", json=REQUEST).status_code == 200
    with service.channel() as channel:
        assert grpc_compute(channel).summary.rollouts == 2

    assert https_fails(service.url, tls.client_context(client=False))
    assert https_fails(service.url, tls.client_context(rogue=True))
    for options in ({"client": False}, {"rogue": True}):
        with (
            grpc.secure_channel(service.target, tls.channel_credentials(**options)) as channel,
            pytest.raises(grpc.RpcError) as refused,
        ):
            grpc_compute(channel)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, options


def test_client_package_connects_with_tls_options_and_a_token(
    service_factory: Callable[..., Service], tls: Tls, tmp_path: Path
) -> None:
    tokens = write_tokens(tmp_path / "tokens.json", {"secret-token": ["team-a"]})
    service = service_factory(tls=tls, mutual=True, auth_tokens_file=tokens)
    files = {
        "ca_file": str(tls.ca),
        "client_cert": str(tls.client_cert),
        "client_key": str(tls.client_key),
    }
    request = {**REQUEST, "namespace": "team-a"}
    with (
        HttpClient(service.url, token="secret-token", retries=0, **files) as http,
        GrpcClient(service.target, token="secret-token", retries=0, **files) as rpc,
    ):
        via_http = http.compute(request)
        via_grpc = rpc.compute(request)
        for got in (via_http, via_grpc):
            np.testing.assert_array_equal(
                got["groups"][0]["rollouts"][1]["advantages"], np.float32([-0.70710576])
            )
        results = list(
            rpc.stream(
                [
                    {"group_id": "p", "group_size": 2, "tokens": [1, 2], "reward": 1.0},
                    {"group_id": "p", "group_size": 2, "tokens": [3], "reward": 0.0},
                ],
                estimator="grpo",
                namespace="team-a",
            )
        )
        assert [r["id"] for r in results] == ["p"]
    for client in (
        HttpClient(service.url, token="wrong", retries=0, **files),
        GrpcClient(service.target, token="wrong", retries=0, **files),
    ):
        with client, pytest.raises(AdvantageError) as denied:
            client.compute(request)
        assert denied.value.code == "unauthenticated"
    with (
        HttpClient(service.url, token="secret-token", retries=0, **files) as http,
        pytest.raises(AdvantageError) as forbidden,
    ):
        http.compute({**REQUEST, "namespace": "team-b"})
    assert forbidden.value.code == "permission_denied"
    assert forbidden.value.status == 403
    assert service.http.get("/v1/estimators", headers=bearer("secret-token")).status_code == 200


@pytest.mark.parametrize("problem", ["missing key", "key of another certificate", "half pair"])
def test_unusable_tls_files_stop_the_start_with_exit_2(
    tmp_path: Path, tls: Tls, problem: str
) -> None:
    settings: dict[str, Any] = {"tls_cert": tls.server_cert, "tls_key": tls.server_key}
    if problem == "missing key":
        settings["tls_key"] = tmp_path / "absent.pem"
    elif problem == "key of another certificate":
        settings["tls_key"] = tls.client_key
    else:
        del settings["tls_key"]
    proc, _, _, log = launch(tmp_path, settings)
    assert proc.wait(120) == 2, log.read_text()
