"""Loops over the flat batch compiled for the CPU (numba), where torch would take several passes.

Why: on the CPU each torch operation is a pass over N tokens into a fresh N-sized buffer, and a
per-position method (GTPO) or a term that reads and writes the advantage (HICRA) needs several;
a loop over each rollout's contiguous slice does the same arithmetic in one or two passes, in
cache. Each loop here does, in float32 and in the same order, what the torch code beside it in
the estimator's module does (the same bits: tests compare them), so that a request's answer
does not depend on which path computed it. CUDA tensors never come here.

Compiled on first use (about a second each) and cached on disk where a writable location exists
(``NUMBA_CACHE_DIR``, else next to this file); the engine's warm-up compiles them before the
service reports ready (:func:`compile_all`).

Notes for the loops: each one takes slices of its arrays per rollout and indexes them from 0
(an index that numba cannot prove non-negative costs a wrap-around check per access and
defeats vectorisation), and ``error_model="numpy"`` lets a division by 0 give inf as numpy's
does instead of raising (a check per element).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import numba
import numpy as np

F = TypeVar("F", bound=Callable[..., Any])


def _compiled(fn: F) -> F:
    """``fn`` compiled without the GIL, cached on disk where numba finds a writable place."""
    return _compile(fn, {})


def _reassociating(fn: F) -> F:
    """As :func:`_compiled`, letting the compiler reorder ``fn``'s float additions so that a sum
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


@_reassociating
def sum_float64(x: np.ndarray) -> float:
    """The float64 sum of a float32 slice."""
    total = 0.0
    for j in range(x.shape[0]):
        total += x[j]
    return total


@_compiled
def segment_sums(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Each rollout's float64 sum of its float32 ``values`` (N,): float64 (B,), by
    :func:`sum_float64` (the bits the GTPO loop gives its scalars)."""
    out = np.zeros(offsets.shape[0] - 1, np.float64)
    for i in range(out.shape[0]):
        out[i] = sum_float64(values[offsets[i] : offsets[i + 1]])
    return out


@_reassociating
def _sum_nonnegative(x: np.ndarray) -> float:
    total = 0.0
    zero = np.float32(0.0)
    for j in range(x.shape[0]):
        total += max(x[j], zero)
    return total


@_compiled
def segment_sums_nonnegative(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Each rollout's float64 sum of its float32 ``values`` with any value below 0 taken as 0
    (an entropy a trainer rounded below 0): float64 (B,), one pass."""
    out = np.zeros(offsets.shape[0] - 1, np.float64)
    for i in range(out.shape[0]):
        out[i] = _sum_nonnegative(values[offsets[i] : offsets[i + 1]])
    return out


@_compiled
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


@_compiled
def amplify(advantages: np.ndarray, mask: np.ndarray, scale: float) -> None:
    """A_it <- A_it + (scale |A_it|) m_it in place, float32, one pass (torch's ``addcmul_`` of
    ``abs``: the same operations in the same order)."""
    k = np.float32(scale)
    for t in range(advantages.shape[0]):
        a = advantages[t]
        advantages[t] = a + k * abs(a) * mask[t]


@_compiled
def gtpo_position_sums(
    entropy: np.ndarray,
    offsets: np.ndarray,
    start: np.ndarray,
    busy: np.ndarray,
    wrong: np.ndarray,
    num_keys: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """GTPO's per-key sums over the rollouts marked ``busy``, in batch order: S of v (H for a
    correct rollout, 1/H for a wrong one) and Q of v^2, float32 (K,) each; the rollouts'
    starts (+1) and ends (-1) per key, int32 (K + 1,), whose running sum is d_t (or h_t); and
    whether an entropy below 0 was read (taken as 0: a trainer's rounding; where none is, -0.0
    stays -0.0 as in torch, whose clamp runs only then). Rollout i's token t has key start_i +
    t."""
    total = np.zeros(num_keys, np.float32)
    squares = np.zeros(num_keys, np.float32)
    edges = np.zeros(num_keys + 1, np.int32)
    one = np.float32(1.0)
    zero = np.float32(0.0)
    negative = False
    for i in range(start.shape[0]):
        if not busy[i]:
            continue
        o = offsets[i]
        n = offsets[i + 1] - o
        s = start[i]
        h = entropy[o : o + n]
        ts = total[s : s + n]
        qs = squares[s : s + n]
        edges[s] += 1
        edges[s + n] -= 1
        low = False
        if wrong[i]:
            for t in range(n):
                x = h[t]
                low |= x < zero
                v = one / (zero if x < zero else x)
                ts[t] += v
                qs[t] += v * v
        else:
            for t in range(n):
                x = h[t]
                low |= x < zero
                v = zero if x < zero else x
                ts[t] += v
                qs[t] += v * v
        negative |= low
    return total, squares, edges, negative


@_compiled
def gtpo_factor(
    total: np.ndarray, edges: np.ndarray, first_wrong: int, alpha2: float
) -> tuple[np.ndarray, int]:
    """F_k = +-alpha2 d_k / S_k (O- negative; d_k the running sum of ``edges``), float32 (K,),
    as ``key_factor``'s float32 operations; and 1 where an O+ key that a rollout reaches has
    S = 0 (every entropy there 0), 2 where an O- key has S infinite (an entropy of 0), 0 if
    neither (those are the keyed path's). Keys no rollout reaches get 0."""
    k2 = np.float32(alpha2)
    factor = np.zeros(total.shape[0], np.float32)
    alive = 0
    for k in range(first_wrong):
        alive += edges[k]
        if alive > 0:
            if not total[k] > 0:
                return factor, 1
            factor[k] = np.float32(alive) * k2 / total[k]
    for k in range(first_wrong, total.shape[0]):
        alive += edges[k]
        if alive > 0:
            if not np.isfinite(total[k]):
                return factor, 2
            factor[k] = -(np.float32(alive) * k2 / total[k])
    return factor, 0


@_compiled
def class_square_sums(factor: np.ndarray, squares: np.ndarray, longest: np.ndarray) -> np.ndarray:
    """Per class group (``longest[c]`` consecutive keys each, in order), sum_k F_k^2 Q_k in
    float64: float64 (2G,)."""
    out = np.zeros(longest.shape[0], np.float64)
    k = 0
    for c in range(longest.shape[0]):
        a0 = a1 = a2 = a3 = 0.0
        end = k + longest[c]
        f = factor[k:end]
        q = squares[k:end]
        n = end - k
        j = 0
        while j + 4 <= n:
            a0 += np.float64(f[j]) * np.float64(f[j]) * np.float64(q[j])
            a1 += np.float64(f[j + 1]) * np.float64(f[j + 1]) * np.float64(q[j + 1])
            a2 += np.float64(f[j + 2]) * np.float64(f[j + 2]) * np.float64(q[j + 2])
            a3 += np.float64(f[j + 3]) * np.float64(f[j + 3]) * np.float64(q[j + 3])
            j += 4
        while j < n:
            a0 += np.float64(f[j]) * np.float64(f[j]) * np.float64(q[j])
            j += 1
        out[c] = (a0 + a1) + (a2 + a3)
        k = end
    return out


@_compiled
def gtpo_write(
    entropy: np.ndarray,
    offsets: np.ndarray,
    start: np.ndarray,
    busy: np.ndarray,
    wrong: np.ndarray,
    negative: bool,
    factor: np.ndarray,
    scale: np.ndarray,
    shift: np.ndarray,
    out: np.ndarray,
) -> np.ndarray:
    """GTPO's answer, A_it = (F_k scale_i) v_it + shift_i in float32 (0 on rollouts not
    ``busy``; F_k scale_i is 0 where scale_i is 0), written into ``out`` (N,); returns each
    rollout's float64 sum of its A_it (:func:`sum_float64`, while its slice is in cache).
    ``negative``: some entropy is below 0 (each such is taken as 0)."""
    sums = np.zeros(start.shape[0], np.float64)
    one = np.float32(1.0)
    zero = np.float32(0.0)
    for i in range(start.shape[0]):
        o = offsets[i]
        n = offsets[i + 1] - o
        a = out[o : o + n]
        if not busy[i]:
            a[:] = zero
            continue
        sc = scale[i]
        sh = shift[i]
        if sc == zero:
            a[:] = zero + sh
            sums[i] = sum_float64(a)
            continue
        s = start[i]
        h = entropy[o : o + n]
        f = factor[s : s + n]
        if wrong[i]:
            if negative:
                for t in range(n):
                    x = h[t]
                    a[t] = (f[t] * sc) * (one / (zero if x < zero else x)) + sh
            else:
                for t in range(n):
                    a[t] = (f[t] * sc) * (one / h[t]) + sh
        elif negative:
            for t in range(n):
                x = h[t]
                a[t] = (f[t] * sc) * (zero if x < zero else x) + sh
        else:
            for t in range(n):
                a[t] = (f[t] * sc) * h[t] + sh
        sums[i] = sum_float64(a)
    return sums


def compile_all() -> None:
    """Compile (or load from the cache) every loop, on tiny inputs: the first request that
    needs one should not wait for the compiler."""
    f32 = np.zeros(2, np.float32)
    offsets = np.array([0, 1, 2], np.int64)
    flags = np.array([True, False])
    segment_sums(f32, offsets)
    segment_sums_nonnegative(f32, offsets)
    broadcast_amplified(f32, offsets, f32, 0.5, np.zeros(2, np.float32))
    amplify(np.zeros(2, np.float32), f32, 0.5)
    start = np.array([0, 0], np.int64)
    ones = np.ones(2, np.float32)
    total, squares, edges, _ = gtpo_position_sums(ones, offsets, start, flags, flags, 1)
    factor, _ = gtpo_factor(total, edges, 1, 0.1)
    class_square_sums(factor, squares, np.array([1, 0], np.int64))
    out = np.zeros(2, np.float32)
    gtpo_write(ones, offsets, start, flags, flags, False, factor, ones, ones, out)
