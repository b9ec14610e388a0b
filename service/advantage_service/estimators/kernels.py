"""Loops over the flat batch compiled for the CPU (numba), where torch would take several passes.

Why: on the CPU each torch operation is a pass over N tokens into a fresh N-sized buffer, and a
per-position method (GTPO) or a term that reads and writes the advantage (HICRA) needs several;
a loop over each rollout's contiguous slice does the same arithmetic in one or two passes, in
cache. Each loop here does, in float32 and in the same order, what the torch code beside it in
the estimator's module does (the same bits: tests compare them), so that a request's answer
does not depend on which path computed it. CUDA tensors never come here. GTPO's loops are in
:mod:`.gtpo_kernels`, built from :func:`compiled`, :func:`reassociating` and
:func:`sum_float64` here.

Imported (with numba) only where a loop first runs; compiled on first use (about 7 s for all
of them, 3 s of it GTPO's group at a time loop) and cached on disk where a writable location
exists (``NUMBA_CACHE_DIR``, else next to this file: 1.3 s to import numba and load them all);
the engine's warm-up compiles them before the service reports ready (:func:`compile_all`).

Notes for the loops: each one takes slices of its arrays per rollout and indexes them from 0
(an index that numba cannot prove non-negative costs a wrap-around check per access and
defeats vectorisation), and ``error_model="numpy"`` lets a division by 0 give inf as numpy's
does instead of raising (a check per element).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import numba
import numpy as np

F = TypeVar("F", bound=Callable[..., Any])


def compiled(fn: F) -> F:
    """``fn`` compiled without the GIL, cached on disk where numba finds a writable place."""
    return _compile(fn, {})


def reassociating(fn: F) -> F:
    """As :func:`compiled`, letting the compiler reorder ``fn``'s float additions so that a sum
    runs in vector registers (several partial sums, combined at the end: about 3x faster than
    one chain of float64 additions). The order depends only on the slice's length and the
    machine's vector width, never on where the slice sits in memory or what else is in the
    batch: a rollout's sum is the same alone or merged, and both paths of a method that share
    this function agree bit for bit."""
    return _compile(fn, {"fastmath": {"reassoc"}})


def _compile(fn: F, options: dict[str, Any]) -> F:
    try:
        return numba.njit(cache=True, nogil=True, error_model="numpy", **options)(fn)
    except RuntimeError:  # no cache location (a read-only install, no writable home)
        return numba.njit(nogil=True, error_model="numpy", **options)(fn)


@reassociating
def sum_float64(x: np.ndarray) -> float:
    """The float64 sum of a float32 slice."""
    total = 0.0
    for j in range(x.shape[0]):
        total += x[j]
    return total


@compiled
def segment_sums(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Each rollout's float64 sum of its float32 ``values`` (N,): float64 (B,), by
    :func:`sum_float64` (the bits the GTPO loop gives its scalars)."""
    out = np.zeros(offsets.shape[0] - 1, np.float64)
    for i in range(out.shape[0]):
        out[i] = sum_float64(values[offsets[i] : offsets[i + 1]])
    return out


@reassociating
def _sum_nonnegative(x: np.ndarray) -> float:
    total = 0.0
    zero = np.float32(0.0)
    for j in range(x.shape[0]):
        total += max(x[j], zero)
    return total


@compiled
def segment_sums_nonnegative(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Each rollout's float64 sum of its float32 ``values`` with any value below 0 taken as 0
    (an entropy a trainer rounded below 0): float64 (B,), one pass."""
    out = np.zeros(offsets.shape[0] - 1, np.float64)
    for i in range(out.shape[0]):
        out[i] = _sum_nonnegative(values[offsets[i] : offsets[i + 1]])
    return out


@compiled
def broadcast_amplified(
    scalars: np.ndarray, offsets: np.ndarray, mask: np.ndarray, scale: float, out: np.ndarray
) -> None:
    """out_it = a_i + (scale |a_i|) m_it, float32: a per-rollout advantage ``scalars`` (B,
    float32) broadcast over its tokens and amplified where the mask ``m`` (N, float32) is set,
    in one pass (torch: a broadcast, then ``addcmul_(abs, m, value=scale)``; the same float32
    operations in the same order)."""
    k = np.float32(scale)
    for i in range(scalars.shape[0]):
        a = scalars[i]
        c = k * abs(a)
        m = mask[offsets[i] : offsets[i + 1]]
        o = out[offsets[i] : offsets[i + 1]]
        for t in range(m.shape[0]):
            o[t] = a + c * m[t]


@compiled
def amplify(advantages: np.ndarray, mask: np.ndarray, scale: float) -> None:
    """A_it <- A_it + (scale |A_it|) m_it in place, float32, one pass (torch's ``addcmul_`` of
    ``abs``: the same operations in the same order)."""
    k = np.float32(scale)
    for t in range(advantages.shape[0]):
        a = advantages[t]
        advantages[t] = a + k * abs(a) * mask[t]


@compiled
def presence(
    ids: np.ndarray, offsets: np.ndarray, correct: np.ndarray, size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per id below ``size``: the rollouts with ``correct`` set that contain it, and the others
    (int32 (size,) each: a batch has fewer than 2^31 rollouts), a rollout counted once per id
    however often the id occurs in it. One pass over the token ``ids`` (N,), each rollout's
    slice between its ``offsets`` (B + 1,), marking the rollout an id was last seen in: 5 ms
    for the 1.09 M tokens of a training batch, where a sort of its (rollout, id) pairs and the
    counts after it took 41-43 ms, and three int32 tables of ``size``, less memory than those
    pairs took. Raises IndexError for an id outside [0, size) (nothing written there)."""
    seen = np.full(size, -1, np.int32)
    in_correct = np.zeros(size, np.int32)
    in_wrong = np.zeros(size, np.int32)
    for r in range(offsets.shape[0] - 1):
        row = ids[offsets[r] : offsets[r + 1]]
        counts = in_correct if correct[r] else in_wrong
        for j in range(row.shape[0]):
            v = row[j]
            if v < 0 or v >= size:
                raise IndexError("a token id outside the counted range")
            if seen[v] != r:
                seen[v] = r
                counts[v] += 1
    return in_correct, in_wrong


# Tables of up to this many float32 entries are kept between calls, per thread (a worker thread
# computes one batch at a time): a fresh table's pages are faulted in on first write, which on
# the CPU costs as much as the loop that fills it.
SCRATCH_LIMIT = 1 << 22
_scratch = threading.local()


def scratch_tables(n: int, count: int, dtype: Any = np.float32) -> list[np.ndarray]:
    """``count`` (n,) tables of ``dtype`` for one computation on this thread: reused between
    calls (not zeroed: the loops that take them say what they write), fresh past
    :data:`SCRATCH_LIMIT`. Valid until this thread's next call for the same dtype; never
    returned to a caller."""
    if n > SCRATCH_LIMIT:
        return [np.empty(n, dtype) for _ in range(count)]
    kept: dict[Any, np.ndarray] = _scratch.__dict__.setdefault("tables", {})
    key = np.dtype(dtype)
    held = kept.get(key)
    if held is None or held.shape[0] < count or held.shape[1] < n:
        size = max(n, 0 if held is None else held.shape[1])
        held = np.empty((max(count, 0 if held is None else held.shape[0]), size), key)
        kept[key] = held
    return [held[i, :n] for i in range(count)]


def compile_all() -> None:
    """Compile (or load from the cache) every loop here, on tiny inputs: the first request that
    needs one should not wait for the compiler (:func:`.gtpo_kernels.compile_all` GTPO's)."""
    f32 = np.zeros(2, np.float32)
    offsets = np.array([0, 1, 2], np.int64)
    segment_sums(f32, offsets)
    segment_sums_nonnegative(f32, offsets)
    broadcast_amplified(f32, offsets, f32, 0.5, np.zeros(2, np.float32))
    amplify(np.zeros(2, np.float32), f32, 0.5)
    for ids in (np.array([0, 1], np.int32), np.array([0, 1], np.int64)):  # (ids; inverse)
        presence(ids, offsets, np.ones(2, np.bool_), 2)
