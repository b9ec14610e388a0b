"""Shared test setup: the tests directory is importable (for the oracle and helpers), and a
real redis-server for any test that asks for one."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


@pytest.fixture(autouse=True)
def unit_tests_start_no_process(request: pytest.FixtureRequest) -> Iterator[None]:
    """Under ``make test-unit`` (``ADV_UNIT_ONLY=1``, tests not marked ``integration``): a test
    that starts a process (a service, redis-server, a trainer) fails, naming the marker it
    lacks, so the quick loop never depends on a real component by accident."""
    if os.environ.get("ADV_UNIT_ONLY") != "1" or "integration" in request.keywords:
        yield
        return
    real = subprocess.Popen.__init__

    def refuse(self: Any, args: Any, *rest: Any, **kwargs: Any) -> None:
        raise AssertionError(
            f"{request.node.nodeid} starts a process ({str(args)[:80]}): mark it "
            "@pytest.mark.integration (make test-unit runs the tests that need none)"
        )

    subprocess.Popen.__init__ = refuse  # type: ignore[method-assign]
    try:
        yield
    finally:
        subprocess.Popen.__init__ = real  # type: ignore[method-assign]


# Runs that only go when selected by their marker (``-m <marker>``): too long for every run.
SELECTED_ONLY = {
    "fuzz_long": "a long fuzzing run: select it with -m fuzz_long",
    "installs": "the documented install commands in clean environments (minutes on a cold "
    "cache): select them with -m installs (make test-installs)",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests of the markers in :data:`SELECTED_ONLY` run only when selected with ``-m``."""
    selected = config.getoption("markexpr", "") or ""
    for marker, why in SELECTED_ONLY.items():
        if marker in selected:
            continue
        skip = pytest.mark.skip(reason=why)
        for item in items:
            # (the marker itself: item.keywords also holds folder names, tests/installs)
            if item.get_closest_marker(marker) is not None:
                item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Captured output with a lone surrogate in it (the text tests log some on purpose) is kept
    escaped (``\\ud800``) in the report: a report is sent from a worker process to the main one
    as UTF-8 under pytest-xdist (``make test`` runs two), and a raw surrogate stopped the run."""
    report = yield
    report.sections = [
        (title, text.encode("utf-8", "backslashreplace").decode("utf-8"))
        for title, text in report.sections
    ]
    return report
