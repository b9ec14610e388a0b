"""glibc's malloc arenas, capped in the service process (``serve``).

glibc gives each thread that allocates an arena of its own, up to eight per core, and the
service runs many threads (gRPC's, the codec and compute workers, the statistics writer,
torch's). Spread over them, the multi-megabyte buffers of every request (a protobuf message and
its arrays, an Arrow body, the answer) went back to the kernel and were faulted in again: a gRPC
GRPO call on the training batch (1.09 M tokens) took 11,700 minor page faults (46 MiB of pages)
with glibc's default, 2,050 (8 MiB) with two arenas; against the same service without the cap
in the same run, 92-107 -> 73-80 ms (KTAE) and 54-55 -> 40-43 ms (GRPO) on the median (README,
"Transports"). ``MALLOC_ARENA_MAX`` set in the environment wins (glibc reads it at start);
another C library is left as it is.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_ARENA_MAX = -8  # (glibc's malloc.h)
ARENAS = 2


def limit_arenas(arenas: int = ARENAS) -> bool:
    """Cap glibc's malloc arenas at ``arenas`` for the threads that allocate from now on (call
    it before the process starts its threads); True when the cap was set."""
    if os.environ.get("MALLOC_ARENA_MAX") or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # (no C library to ask, or one without mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_ARENA_MAX, arenas))
