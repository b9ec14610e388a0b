"""Shared test setup: the tests directory is importable (for the oracle and helpers), and a
real redis-server for any test that asks for one."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stats.redis_support import REDIS_SERVER, RedisServer


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh redis-server on a free port in a temporary directory, stopped after the test."""
    if not os.path.exists(REDIS_SERVER):
        pytest.skip("redis-server is not installed (OS package redis-server)")
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Long fuzzing runs (marker ``fuzz_long``) run only when selected: ``-m fuzz_long``."""
    if "fuzz_long" in (config.getoption("markexpr", "") or ""):
        return
    skip = pytest.mark.skip(reason="a long fuzzing run: select it with -m fuzz_long")
    for item in items:
        if "fuzz_long" in item.keywords:
            item.add_marker(skip)
