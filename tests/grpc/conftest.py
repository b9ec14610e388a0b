"""Fixtures: a shared real service (HTTP + gRPC), and one with tight limits."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from service_support import Service

# Small enough that the limit tests stay cheap; roomy enough for the parity requests.
SHARED_SETTINGS = {"max_request_tokens": 50_000, "max_group_size": 32, "max_inflight": 4}
LIMITED_SETTINGS = {
    "max_request_tokens": 300,
    "max_group_size": 8,
    "max_body_bytes": 200_000,
    "stream_max_pending_groups": 3,
    "stream_max_pending_tokens": 100,
}


@pytest.fixture(scope="session")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """One service shared by the tests that do not need their own limits."""
    srv = Service.start(tmp_path_factory.mktemp("grpc-service"), **SHARED_SETTINGS)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def limited_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    srv = Service.start(tmp_path_factory.mktemp("grpc-limited"), **LIMITED_SETTINGS)
    yield srv
    srv.stop()
