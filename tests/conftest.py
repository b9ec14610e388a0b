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
