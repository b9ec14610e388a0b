"""Fixtures: services with their own settings (stopped at the end of each test), certificates,
and a real redis-server."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from support import Service, Tls, make_tls, start_service


@pytest.fixture
def service_factory(tmp_path: Path) -> Iterator[Callable[..., Service]]:
    started: list[Service] = []

    def make(**settings: Any) -> Service:
        service = start_service(tmp_path / f"service-{len(started)}", **settings)
        started.append(service)
        return service

    yield make
    for service in started:
        service.stop()


@pytest.fixture(scope="session")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Tls:
    return make_tls(tmp_path_factory.mktemp("tls"))
