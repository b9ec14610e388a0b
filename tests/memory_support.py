"""What a request costs a service process in memory: the growth of its peak resident set
(VmHWM) around one action, read from /proc (Linux).

The peak is reset first (``clear_refs`` 5, the same user may), so the growth is measured from
the process's resident set just before the action, not from whatever peak startup left. Where
the reset is not allowed the peak before the action is the baseline: the growth then counts
only what goes beyond it (an underestimate, said in the result).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T")
MIB = 2**20


def status_bytes(pid: int, key: str) -> int:
    """A ``kB`` line of /proc/<pid>/status (VmRSS, VmHWM) in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key} for process {pid}")


@dataclass
class Growth(Generic[T]):
    result: T
    bytes: int  # peak resident set during the action minus the resident set before it
    reset: bool  # False: the peak could not be reset (the growth may be underestimated)

    def within(self, payload: int, factor: float, slack: int = 16 * MIB) -> bool:
        return self.bytes <= factor * payload + slack

    def describe(self, payload: int) -> str:
        return (
            f"peak RSS grew {self.bytes / MIB:.1f} MiB for {payload / MIB:.1f} MiB sent "
            f"({self.bytes / max(payload, 1):.2f}x){'' if self.reset else ' (peak not reset)'}"
        )


def peak_growth(pid: int, action: Callable[[], T]) -> Growth[T]:
    """Run ``action`` (a request to the process ``pid``); its result and the growth of the
    process's peak RSS over its RSS before."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        reset = True
        before = status_bytes(pid, "VmRSS")
    except OSError:
        reset = False
        before = status_bytes(pid, "VmHWM")
    result = action()
    return Growth(result, max(0, status_bytes(pid, "VmHWM") - before), reset)
