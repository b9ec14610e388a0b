"""The service caps glibc's malloc arenas (``advantage_service.arenas``): with one arena per
thread, the buffers of every request were faulted in afresh (bench/bench_grpc.py, README)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Twelve threads allocate at once and keep what they allocated; glibc's malloc_stats() then
# lists one "Arena N:" line per arena on stderr.
PROGRAM = """
import ctypes, sys, threading
from advantage_service.arenas import limit_arenas
print("capped" if limit_arenas() else "not capped", file=sys.stderr, flush=True)
held, barrier = [], threading.Barrier(12)
def work():
    barrier.wait()
    held.append([bytearray(4096) for _ in range(64)])
threads = [threading.Thread(target=work) for _ in range(12)]
for t in threads: t.start()
for t in threads: t.join()
ctypes.CDLL(None).malloc_stats()
"""

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
    reason="glibc only",
)


def arenas(env: dict[str, str]) -> tuple[str, int]:
    """(what limit_arenas said, the arenas glibc made) in a fresh process with ``env``."""
    base = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM],
        capture_output=True,
        text=True,
        timeout=60,
        env={**base, **env},
        check=True,
    ).stderr
    said = out.splitlines()[0]
    return said, sum(1 for line in out.splitlines() if line.startswith("Arena "))


def test_twelve_threads_share_two_arenas() -> None:
    assert arenas({}) == ("capped", 2)


def test_an_operators_malloc_arena_max_wins() -> None:
    # (glibc's own default on this machine: up to eight per core, so twelve threads make more)
    said, made = arenas({"MALLOC_ARENA_MAX": "64"})
    assert said == "not capped" and made > 2
