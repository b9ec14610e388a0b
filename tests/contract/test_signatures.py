"""One ``compute_padded``: in-process, HTTP and gRPC take the same arguments (names, order,
kinds and defaults) as the contract's :class:`~advantage_contract.backend.Backend`, and every
per-token input of the contract is one of them. (Before, the clients lacked ``returns``, so
verl's OTB over HTTP or gRPC raised TypeError.)"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import advantage_service
import numpy as np
import pytest
from advantage_client import AdvantageError, GrpcClient, HttpClient
from advantage_contract import padded
from advantage_contract.backend import Backend, RemoteBackend, inprocess
from advantage_contract.fields import TEACHER_FIELD, TOKEN_FIELDS
from advantage_service.api import InProcess


def parameters(fn: Any) -> list[tuple[str, Any, Any]]:
    """(name, kind, default) of each parameter, ``self`` left out."""
    return [
        (p.name, p.kind, p.default)
        for p in inspect.signature(fn).parameters.values()
        if p.name != "self"
    ]


CONTRACT = parameters(Backend.compute_padded)
IMPLEMENTATIONS = {
    "advantage_service.compute_padded": advantage_service.compute_padded,
    "InProcess().compute_padded": InProcess().compute_padded,
    "HttpClient.compute_padded": HttpClient.compute_padded,
    "GrpcClient.compute_padded": GrpcClient.compute_padded,
}


@pytest.mark.parametrize("name", sorted(IMPLEMENTATIONS))
def test_each_compute_padded_has_the_contracts_signature(name: str) -> None:
    assert parameters(IMPLEMENTATIONS[name]) == CONTRACT


def test_the_contract_takes_every_per_token_input_by_keyword() -> None:
    keywords = {n for n, kind, _ in CONTRACT if kind is inspect.Parameter.KEYWORD_ONLY}
    assert {*TOKEN_FIELDS, TEACHER_FIELD} <= keywords
    for name in (*TOKEN_FIELDS, TEACHER_FIELD):
        assert dict((n, d) for n, _, d in CONTRACT)[name] is None, name


def test_the_comparison_notices_a_missing_keyword() -> None:
    def without_returns(
        self: Any, tokens: Any, mask: Any, rewards: Any, group_ids: Any, *, estimator: Any = "grpo"
    ) -> None: ...

    assert parameters(without_returns) != CONTRACT


def test_every_backend_is_the_protocol() -> None:
    assert isinstance(inprocess(), Backend)
    with HttpClient("http://127.0.0.1:9") as http:
        assert isinstance(http, Backend)
    with GrpcClient("127.0.0.1:9") as grpc_client:
        assert isinstance(grpc_client, Backend)


@pytest.mark.parametrize(
    ("client", "name"),
    [
        (lambda: HttpClient("http://127.0.0.1:9"), "the HTTP client"),
        (lambda: GrpcClient("127.0.0.1:9"), "the gRPC client"),
    ],
)
def test_each_client_names_itself_refusing_an_input_it_cannot_carry(
    monkeypatch: pytest.MonkeyPatch, client: Callable[[], RemoteBackend], name: str
) -> None:
    """The clients share one compute_padded; a per-token input the contract of this client
    version lacks (here: all but logprobs) is refused before anything is sent, naming the
    client that refused it."""
    monkeypatch.setattr(padded, "TOKEN_FIELDS", ("logprobs",))
    mask = np.ones((1, 2), dtype=bool)
    with client() as backend, pytest.raises(AdvantageError) as refused:
        backend.compute_padded(None, mask, [1.0], ["g"], entropy=np.zeros((1, 2)))
    assert refused.value.code == "unsupported_input"
    assert refused.value.field == "entropy"
    assert f"entropy is not accepted by {name} yet" in str(refused.value)
