"""Fixtures: one real service (HTTP and gRPC on one engine) for the trainer integrations."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trainer_support import TrainerService


@pytest.fixture(scope="session")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TrainerService]:
    srv = TrainerService.start(tmp_path_factory.mktemp("trainer-service"))
    yield srv
    srv.stop()
