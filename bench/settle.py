"""Waiting for processes to go quiet between timed measures.

A computation's worker threads keep the cores busy after it returns (OpenMP workers spin a
while after a parallel region) and a server keeps working after its answer (statistics writes):
on a 2-core machine whatever runs next pays for it. A fixed sleep guesses how long that lasts;
:func:`settle` watches the threads' CPU time (``/proc/<pid>/task/*/schedstat``, nanoseconds)
until it stops moving.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

WINDOW_SECONDS = 0.02
QUIET_SHARE = 0.05  # busy below 5% of a window's wall time counts as quiet
LIMIT_SECONDS = 5.0


def cpu_ns(pid: int, skip: int | None = None) -> int:
    """CPU nanoseconds of every thread of ``pid`` but ``skip`` (a native thread id)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        if skip is not None and task.name == str(skip):
            continue
        with contextlib.suppress(FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            total += int((task / "schedstat").read_text().split()[0])  # (ended meanwhile)
    return total


def settle(*pids: int) -> float:
    """Wait until this process (but the calling thread) and ``pids`` stay quiet for two windows
    in a row, at most :data:`LIMIT_SECONDS`; returns the seconds waited. Where ``/proc`` gives no
    per-thread times (not Linux), waits one fixed 0.2 s."""
    if not Path("/proc/self/task").is_dir():
        time.sleep(0.2)
        return 0.2
    watched = [(os.getpid(), threading.get_native_id()), *((p, None) for p in pids)]
    start = time.perf_counter()
    before = sum(cpu_ns(p, skip) for p, skip in watched)
    quiet = 0
    while quiet < 2 and time.perf_counter() - start < LIMIT_SECONDS:
        time.sleep(WINDOW_SECONDS)
        now = sum(cpu_ns(p, skip) for p, skip in watched)
        quiet = quiet + 1 if now - before < QUIET_SHARE * WINDOW_SECONDS * 1e9 else 0
        before = now
    return time.perf_counter() - start
