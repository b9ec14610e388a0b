"""The contract version: the service lists it, a client of the same version takes the listing
quietly, and a client facing a service of another version warns (fields, limits or methods
may differ) instead of working around the difference."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from typing import Any

import httpx
import pytest
from advantage_client import GrpcClient, HttpClient
from advantage_contract import CONTRACT_VERSION
from advantage_contract.backend import ContractMismatch, check_contract


@pytest.mark.integration
def test_a_client_of_the_services_version_takes_its_listing_quietly(service: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with HttpClient(service.url) as http:
            assert http.list_estimators()["contract"] == CONTRACT_VERSION
        with GrpcClient(service.target) as grpc_client:
            assert grpc_client.list_estimators()["contract"] == CONTRACT_VERSION


@pytest.mark.parametrize("theirs", [None, CONTRACT_VERSION - 1, CONTRACT_VERSION + 1])
def test_a_client_facing_another_version_warns(theirs: int | None) -> None:
    listing = {"default": "grpo", "presets": {}, "outcomes": [], "terms": []}
    if theirs is not None:
        listing["contract"] = theirs

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=json.dumps(listing).encode())

    with (
        HttpClient("http://service.test", transport=httpx.MockTransport(answer)) as http,
        pytest.warns(ContractMismatch, match=f"contract version {theirs or 1}"),
    ):
        http.list_estimators()


def test_check_contract_is_quiet_only_on_the_same_version() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_contract({"contract": CONTRACT_VERSION}, "here")
    with pytest.warns(ContractMismatch):
        assert not check_contract({"contract": "2.0"}, "here")


@pytest.mark.integration
def test_inprocess_works_in_a_trainer_process_that_never_imported_the_service() -> None:
    """The integrations find the in-process backend through the contract's entry point: a fresh
    process that imports only the client computes, and the service was loaded by the entry
    point, not by an import of the client's."""
    code = """
import sys
import numpy as np
from advantage_client.integrations import backend
assert "advantage_service" not in sys.modules
chosen = backend("inprocess", None, {})
result = chosen.compute_padded(
    None, np.ones((4, 2), bool), np.array([1.0, 0.0, 1.0, 1.0]), np.array([0, 0, 1, 1]),
)
print(type(chosen).__module__, [round(float(a), 4) for a in result.advantages[:, 0]])
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split(maxsplit=1)
    assert out[0] == "advantage_service.api"
    assert json.loads(out[1]) == [0.7071, -0.7071, 0.0, 0.0]
