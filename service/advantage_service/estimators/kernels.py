"""Loops over the flat batch compiled for the CPU (numba), where torch would take several passes.

Why: on the CPU each torch operation is a pass over N tokens into a fresh N-sized buffer, and a
per-position method (GTPO) or a term that reads and writes the advantage (HICRA) needs several;
a loop over each rollout's contiguous slice does the same arithmetic in one or two passes, in
cache. Each loop here does, in float32 and in the same order, what the torch code beside it in
the estimator's module does (the same bits: tests compare them), so that a request's answer
does not depend on which path computed it. CUDA tensors never come here.

Imported (with numba) only where a loop first runs; compiled on first use (about 4 s for all
of them) and cached on disk where a writable location exists (``NUMBA_CACHE_DIR``, else next to
this file: 0.5 s to load them all); the engine's warm-up compiles them before the service
reports ready (:func:`compile_all`).

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
    total: np.ndarray,
    squares: np.ndarray,
    alive: np.ndarray,
) -> bool:
    """GTPO's per-key sums over the rollouts marked ``busy``, in batch order, into (K,) tables
    (zeroed here): ``total`` S of v (H for a correct rollout, 1/H for a wrong one) and
    ``squares`` Q of v^2, float64 (v is float32, its square exact in float64), and ``alive``
    the rollouts that reach the key (d_t or h_t), float32. Returns
    whether an entropy below 0 was read (taken as 0: a trainer's rounding; where none is, -0.0
    stays -0.0 as in torch, whose clamp runs only then). Rollout i's token t has key start_i +
    t."""
    total[:] = 0.0
    squares[:] = 0.0
    alive[:] = 0.0
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
        d = alive[s : s + n]
        low = False
        if wrong[i]:
            for t in range(n):
                x = h[t]
                low |= x < zero
                v = np.float64(one / (zero if x < zero else x))
                ts[t] += v
                qs[t] += v * v
                d[t] += one
        else:
            for t in range(n):
                x = h[t]
                low |= x < zero
                v = np.float64(zero if x < zero else x)
                ts[t] += v
                qs[t] += v * v
                d[t] += one
        negative |= low
    return negative


@_compiled
def gtpo_factor(
    total: np.ndarray, alive: np.ndarray, first_wrong: int, alpha2: float, factor: np.ndarray
) -> int:
    """Into ``factor`` (K,), F_k = +-alpha2 d_k / S_k (O- negative) in float64, as
    ``key_factor``'s operations (keys no rollout reaches get 0). Returns 1 where an O+
    key that a rollout reaches has S = 0 (every entropy there 0), 2 where an O- key has S
    infinite (an entropy of 0), 0 if neither (those are the keyed path's to compute)."""
    zero = 0.0
    # (each loop from 0 over slices: see the module's notes)
    plus_total, minus_total = total[:first_wrong], total[first_wrong:]
    plus_alive, minus_alive = alive[:first_wrong], alive[first_wrong:]
    plus_factor, minus_factor = factor[:first_wrong], factor[first_wrong:]
    flat = False
    for k in range(plus_total.shape[0]):
        flat |= (plus_alive[k] > zero) & ~(plus_total[k] > zero)
    if flat:
        return 1
    certain = False
    for k in range(minus_total.shape[0]):
        certain |= (minus_alive[k] > zero) & ~(np.abs(minus_total[k]) < np.inf)
    if certain:
        return 2
    k2 = np.float64(alpha2)
    for k in range(plus_total.shape[0]):
        f = plus_alive[k] * k2 / plus_total[k]
        plus_factor[k] = f if plus_alive[k] > zero else zero
    for k in range(minus_total.shape[0]):
        f = -(minus_alive[k] * k2 / minus_total[k])
        minus_factor[k] = f if minus_alive[k] > zero else zero
    return 0


@_reassociating
def _square_sum(factor: np.ndarray, squares: np.ndarray) -> float:
    total = 0.0
    for k in range(factor.shape[0]):
        f = factor[k]
        total += f * f * squares[k]
    return total


@_compiled
def class_square_sums(factor: np.ndarray, squares: np.ndarray, longest: np.ndarray) -> np.ndarray:
    """Per class group (``longest[c]`` consecutive keys each, in order), sum_k F_k^2 Q_k in
    float64: float64 (2G,)."""
    out = np.zeros(longest.shape[0], np.float64)
    k = 0
    for c in range(longest.shape[0]):
        end = k + longest[c]
        out[c] = _square_sum(factor[k:end], squares[k:end])
        k = end
    return out


@_compiled
def gtpo_per_key(
    factor: np.ndarray, scale: np.ndarray, longest: np.ndarray, out: np.ndarray
) -> None:
    """Into ``out`` float32 (K,), F_k scale_c of each key's class group c (``longest[c]``
    consecutive keys each, in order): the float64 product rounded once, 0 where scale_c is 0
    (F_k may be infinite there), as the keyed path's ``per_key``."""
    k = 0
    for c in range(longest.shape[0]):
        end = k + longest[c]
        sc = scale[c]
        f = factor[k:end]
        p = out[k:end]
        if sc == 0.0:
            p[:] = np.float32(0.0)
        else:
            for j in range(f.shape[0]):
                p[j] = np.float32(f[j] * sc)
        k = end


@_compiled
def gtpo_write(
    entropy: np.ndarray,
    offsets: np.ndarray,
    start: np.ndarray,
    busy: np.ndarray,
    wrong: np.ndarray,
    negative: bool,
    per_key: np.ndarray,
    scale: np.ndarray,
    shift: np.ndarray,
    out: np.ndarray,
) -> np.ndarray:
    """GTPO's answer, A_it = P_k v_it + shift_i in float32 (0 on rollouts not ``busy``; P_k =
    F_k scale_i: :func:`gtpo_per_key`; shift_i alone where scale_i is 0), written into ``out``
    (N,); returns each
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
        sh = shift[i]
        if scale[i] == 0.0:
            a[:] = zero + sh
            sums[i] = sum_float64(a)
            continue
        s = start[i]
        h = entropy[o : o + n]
        f = per_key[s : s + n]
        if wrong[i]:
            if negative:
                for t in range(n):
                    x = h[t]
                    a[t] = f[t] * (one / (zero if x < zero else x)) + sh
            else:
                for t in range(n):
                    a[t] = f[t] * (one / h[t]) + sh
        elif negative:
            for t in range(n):
                x = h[t]
                a[t] = f[t] * (zero if x < zero else x) + sh
        else:
            for t in range(n):
                a[t] = f[t] * h[t] + sh
        sums[i] = sum_float64(a)
    return sums


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
    total, squares, factor = scratch_tables(1, 3, np.float64)
    alive, per_key = scratch_tables(1, 2)
    gtpo_position_sums(ones, offsets, start, flags, flags, total, squares, alive)
    gtpo_factor(total, alive, 1, 0.1, factor)
    longest = np.array([1, 0], np.int64)
    class_square_sums(factor, squares, longest)
    gtpo_per_key(factor, np.ones(2), longest, per_key)
    out = np.zeros(2, np.float32)
    gtpo_write(ones, offsets, start, flags, flags, False, per_key, np.ones(2), ones, out)
