"""Fixtures: a shared real server, and a factory for servers with their own settings."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from http_support import SHARED_SETTINGS, Server, start_server


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server shared by the tests that do not stop or saturate it."""
    srv = start_server(tmp_path_factory.mktemp("server"), **SHARED_SETTINGS)
    yield srv
    srv.stop()


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    """Start servers with custom settings; each is stopped at the end of the test."""
    started: list[Server] = []

    def make(**settings: Any) -> Server:
        srv = start_server(tmp_path, **settings)
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()
