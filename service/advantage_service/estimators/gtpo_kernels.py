"""GTPO's loops compiled for the CPU (numba; :mod:`.kernels` says why and how they are compiled).

Two ways through a batch, the same bits:

- **one group at a time** (:func:`gtpo_grouped`, Eq. 6 over the group, the default): a group's
  rollouts add into per-position tables of their own class (at most the longest rollout long,
  so they stay in the core's cache), the factors, the two classes' statistics and the answer
  follow while the group's entropies are still in cache. Each entropy is read from memory once.
- **over the whole batch** (the tables of every (class, group, position) key): for scope
  ``request``, whose statistics pool the groups, and the pieces the keyed path shares
  (:func:`class_square_sums`, :func:`class_statistics`).

The per-rollout and per-range pieces below are the one place each piece of arithmetic lives;
both ways call them, in batch order within a class, so their sums take the same order.
"""

from __future__ import annotations

import numpy as np

from .kernels import compiled, reassociating, sum_float64

# Status codes of the loops that hand a batch back to the keyed path.
FLAT = 1  # an O+ key that a rollout reaches has S = 0 (every entropy there 0)
CERTAIN = 2  # an O- key has S infinite (an entropy of 0)
WIDE = 3  # a class whose float32 answer would show its rounding (gtpo_statistics.WIDE_BELOW)


@compiled
def _add_rollout(
    h: np.ndarray, total: np.ndarray, squares: np.ndarray, alive: np.ndarray, wrong: bool
) -> bool:
    """Adds one rollout's v (H, or 1/H for a wrong one; an entropy below 0 taken as 0) and v^2
    into its keys' S and Q (float64) and counts it in ``alive``; returns whether an entropy
    below 0 was read."""
    one = np.float32(1.0)
    zero = np.float32(0.0)
    low = False
    if wrong:
        for t in range(h.shape[0]):
            x = h[t]
            low |= x < zero
            v = np.float64(one / (zero if x < zero else x))
            total[t] += v
            squares[t] += v * v
            alive[t] += one
    else:
        for t in range(h.shape[0]):
            x = h[t]
            low |= x < zero
            v = np.float64(zero if x < zero else x)
            total[t] += v
            squares[t] += v * v
            alive[t] += one
    return low


@compiled
def _factor_range(
    total: np.ndarray, alive: np.ndarray, alpha2: float, wrong: bool, factor: np.ndarray
) -> bool:
    """F_k = alpha2 d_k / S_k over one class's keys (negated for O-) in float64, as
    ``key_factor``'s operations (keys no rollout reaches get 0). Returns whether a key the
    keyed path must compute was met (O+: S = 0; O-: S infinite); F is then not to be read. The
    check rides in the loop that writes F (one pass over the tables)."""
    zero = 0.0
    k2 = np.float64(alpha2)
    flagged = False
    if wrong:
        for k in range(total.shape[0]):
            a = alive[k]
            s = total[k]
            flagged |= (a > zero) & ~(np.abs(s) < np.inf)
            f = -(a * k2 / s)
            factor[k] = f if a > zero else zero
    else:
        for k in range(total.shape[0]):
            a = alive[k]
            s = total[k]
            flagged |= (a > zero) & ~(s > zero)
            f = a * k2 / s
            factor[k] = f if a > zero else zero
    return flagged


@reassociating
def _square_sum(factor: np.ndarray, squares: np.ndarray) -> float:
    total = 0.0
    for k in range(factor.shape[0]):
        f = factor[k]
        total += f * f * squares[k]
    return total


@compiled
def _per_key_range(factor: np.ndarray, scale: float, out: np.ndarray) -> None:
    """P_k = F_k scale of one class's keys, the float64 product rounded once to float32; 0 where
    the scale is 0 (F may be infinite there)."""
    if scale == 0.0:
        out[:] = np.float32(0.0)
    else:
        for k in range(factor.shape[0]):
            out[k] = np.float32(factor[k] * scale)


@compiled
def _write_rollout(
    h: np.ndarray,
    per_key: np.ndarray,
    wrong: bool,
    negative: bool,
    scale_is_zero: bool,
    shift: np.float32,
    out: np.ndarray,
) -> float:
    """One rollout's A_t = P_t v_t + shift in float32 (shift alone where its class's scale is
    0) into ``out``; returns its float64 sum (:func:`.kernels.sum_float64`, while in cache)."""
    one = np.float32(1.0)
    zero = np.float32(0.0)
    n = h.shape[0]
    if scale_is_zero:
        out[:] = zero + shift
    elif wrong:
        if negative:
            for t in range(n):
                x = h[t]
                out[t] = per_key[t] * (one / (zero if x < zero else x)) + shift
        else:
            for t in range(n):
                out[t] = per_key[t] * (one / h[t]) + shift
    elif negative:
        for t in range(n):
            x = h[t]
            out[t] = per_key[t] * (zero if x < zero else x) + shift
    else:
        for t in range(n):
            out[t] = per_key[t] * h[t] + shift
    return sum_float64(out)


@compiled
def class_statistics(
    lengths: np.ndarray,
    rollouts: np.ndarray,
    class_of: np.ndarray,
    contrast: np.ndarray,
    y2: np.ndarray,
    b: np.ndarray,
    alpha2: float,
    epsilon: float,
    wide_below: float,
    rollout_y: np.ndarray,
    scale: np.ndarray,
    wide: np.ndarray,
    shift: np.ndarray,
) -> None:
    """Eq. 6's statistics (``gtpo_statistics.normalise`` says what and why) of C classes (the
    first half O+, the second O-) over the ``rollouts`` listed (batch indices, int64 (R,), in
    batch order), rollout ``rollouts[j]`` of class ``class_of[j]``: into ``scale`` float64 (C,),
    ``wide`` bool (C,) and ``shift`` float64 (R,). ``contrast`` bool (C,); ``y2`` float64 (C,),
    each class's sum of y^2; ``b`` float64 (B,), the outcome terms; ``rollout_y`` float64 (B,),
    each rollout's sum of y where the b of a class may differ, else empty. Sums over a class's
    rollouts run in the order listed."""
    num = y2.shape[0]
    half = num // 2
    n = np.zeros(num)
    members = np.zeros(num)
    b_ref = np.full(num, -np.inf)
    for j in range(rollouts.shape[0]):
        i = rollouts[j]
        c = class_of[j]
        n[c] += np.float64(lengths[i])
        members[c] += 1.0 if lengths[i] > 0 else 0.0
        b_ref[c] = max(b_ref[c], b[i])
    spread = np.zeros(num)
    with_outcome = np.zeros(num)
    for j in range(rollouts.shape[0]):
        i = rollouts[j]
        c = class_of[j]
        rel = b[i] - b_ref[c]
        spread[c] += abs(rel)
        with_outcome[c] += rel * np.float64(lengths[i])
    mean = np.empty(num)
    sum_y = np.empty(num)
    for c in range(num):
        # Centred on b_ref, one b of the class: with 0/1 rewards every b - b_ref is 0 exactly,
        # and so is the mean's outcome part.
        sum_y[c] = (alpha2 if c < half else -alpha2) * n[c]
        mean[c] = (with_outcome[c] + sum_y[c]) / max(n[c], 1.0)
    centred = np.zeros(num)
    cross = np.zeros(num)
    known = rollout_y.shape[0] > 0
    for j in range(rollouts.shape[0]):
        i = rollouts[j]
        c = class_of[j]
        d = (b[i] - b_ref[c]) - mean[c]
        shift[j] = d
        t = np.float64(lengths[i])
        centred[c] += t * d * d
        if known:
            cross[c] += d * rollout_y[i]
    for c in range(num):
        # sum_i d_i sum_t y_it: with one b per class, d_i = -mean for all its rollouts.
        if not known:
            cross[c] = -mean[c] * sum_y[c]
        x = centred[c] + 2.0 * cross[c] + y2[c]
        x = x if (x >= 0.0 or x != x) else 0.0  # (numpy's maximum: a NaN stays NaN)
        std = np.sqrt(x / max(n[c] - 1.0, 1.0))
        denominator = std + epsilon
        usable = contrast[c] and members[c] > 1.0 and denominator > 0.0
        scale[c] = 1.0 / denominator if usable else 0.0
        rms = np.sqrt(y2[c] / max(n[c], 1.0))
        flat = std <= wide_below * rms and rms > 0.0
        wide[c] = usable and (flat or not np.isfinite(y2[c]) or (spread[c] > 0.0 and not known))
    for j in range(rollouts.shape[0]):
        shift[j] = shift[j] * scale[class_of[j]]


@compiled
def gtpo_grouped(
    entropy: np.ndarray,
    offsets: np.ndarray,
    group_index: np.ndarray,
    num_groups: int,
    wrong: np.ndarray,
    b: np.ndarray,
    alpha2: float,
    epsilon: float,
    wide_below: float,
    out: np.ndarray,
) -> tuple[int, np.ndarray]:
    """GTPO with Eq. 6 over each group, one group at a time (the module's notes): A_it into
    ``out`` float32 (N,) and each rollout's float64 sum of it; or a status (:data:`FLAT`,
    :data:`CERTAIN`, :data:`WIDE`) where the keyed path or the float64 pass must decide (``out``
    is then not to be read). A group without both classes gets 0."""
    b_count = offsets.shape[0] - 1
    lengths = offsets[1:] - offsets[:-1]
    sums = np.zeros(b_count)
    # The rollouts of each group in batch order (a counting sort, stable).
    start = np.zeros(num_groups + 1, np.int64)
    for i in range(b_count):
        start[group_index[i] + 1] += 1
    for j in range(num_groups):
        start[j + 1] += start[j]
    order = np.empty(b_count, np.int64)
    fill = start[:-1].copy()
    for i in range(b_count):
        order[fill[group_index[i]]] = i
        fill[group_index[i]] += 1
    longest = 0
    for i in range(b_count):
        longest = max(longest, lengths[i])
    # Per class of the group at hand (0: O+, 1: O-): S, Q, F in float64, d and P in float32.
    total = np.empty((2, longest))
    squares = np.empty((2, longest))
    factor = np.empty((2, longest))
    alive = np.empty((2, longest), np.float32)
    per_key = np.empty((2, longest), np.float32)
    contrast = np.ones(2, np.bool_)
    y2 = np.empty(2)
    scale = np.empty(2)
    wide = np.empty(2, np.bool_)
    no_rollout_y = np.empty(0)
    zero = np.float32(0.0)
    for g in range(num_groups):
        rollouts = order[start[g] : start[g + 1]]
        class_of = np.empty(rollouts.shape[0], np.int64)
        reach = np.zeros(2, np.int64)
        for j in range(rollouts.shape[0]):
            i = rollouts[j]
            c = 1 if wrong[i] else 0
            class_of[j] = c
            reach[c] = max(reach[c], lengths[i] + 1)  # (+1: a class of empty rollouts exists)
        if reach[0] == 0 or reach[1] == 0:  # no contrast: 0 on every token
            for i in rollouts:
                out[offsets[i] : offsets[i + 1]] = zero
            continue
        for c in range(2):
            m = reach[c] - 1
            total[c, :m] = 0.0
            squares[c, :m] = 0.0
            alive[c, :m] = zero
        negative = False
        for j in range(rollouts.shape[0]):
            i = rollouts[j]
            c = class_of[j]
            n = lengths[i]
            negative |= _add_rollout(
                entropy[offsets[i] : offsets[i + 1]],
                total[c, :n],
                squares[c, :n],
                alive[c, :n],
                wrong[i],
            )
        for c in range(2):
            m = reach[c] - 1
            if _factor_range(total[c, :m], alive[c, :m], alpha2, c == 1, factor[c, :m]):
                return (CERTAIN if c == 1 else FLAT), sums
            y2[c] = _square_sum(factor[c, :m], squares[c, :m])
        shift = np.empty(rollouts.shape[0])
        class_statistics(
            lengths, rollouts, class_of, contrast, y2, b, alpha2, epsilon, wide_below,
            no_rollout_y, scale, wide, shift,
        )  # fmt: skip
        if wide[0] or wide[1]:
            return WIDE, sums
        for c in range(2):
            m = reach[c] - 1
            _per_key_range(factor[c, :m], scale[c], per_key[c, :m])
        for j in range(rollouts.shape[0]):
            i = rollouts[j]
            c = class_of[j]
            n = lengths[i]
            sums[i] = _write_rollout(
                entropy[offsets[i] : offsets[i + 1]],
                per_key[c, :n],
                wrong[i],
                negative,
                scale[c] == 0.0,
                np.float32(shift[j]),
                out[offsets[i] : offsets[i + 1]],
            )
    return 0, sums


@compiled
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
    """The whole batch's per-key sums over the rollouts marked ``busy``, in batch order, into
    (K,) tables (zeroed here): ``total`` S, ``squares`` Q (float64), ``alive`` d (float32), as
    :func:`_add_rollout`. Rollout i's token t has key start_i + t. Returns whether an entropy
    below 0 was read."""
    total[:] = 0.0
    squares[:] = 0.0
    alive[:] = 0.0
    negative = False
    for i in range(start.shape[0]):
        if busy[i]:
            o, s = offsets[i], start[i]
            n = offsets[i + 1] - o
            h = entropy[o : o + n]
            negative |= _add_rollout(
                h, total[s : s + n], squares[s : s + n], alive[s : s + n], wrong[i]
            )
    return negative


@compiled
def gtpo_factor(
    total: np.ndarray, alive: np.ndarray, first_wrong: int, alpha2: float, factor: np.ndarray
) -> int:
    """Into ``factor`` (K,), F of every key (O+ keys before ``first_wrong``, then O-), as
    :func:`_factor_range`; returns :data:`FLAT`, :data:`CERTAIN` or 0."""
    # (each call on slices from 0: see :mod:`.kernels`' notes)
    flat = _factor_range(
        total[:first_wrong], alive[:first_wrong], alpha2, False, factor[:first_wrong]
    )
    certain = _factor_range(
        total[first_wrong:], alive[first_wrong:], alpha2, True, factor[first_wrong:]
    )
    return FLAT if flat else (CERTAIN if certain else 0)


@compiled
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


@compiled
def gtpo_per_key(
    factor: np.ndarray, scale: np.ndarray, longest: np.ndarray, out: np.ndarray
) -> None:
    """Into ``out`` float32 (K,), P_k = F_k scale_c of each key's class group c (``longest[c]``
    consecutive keys each, in order), as :func:`_per_key_range`."""
    k = 0
    for c in range(longest.shape[0]):
        end = k + longest[c]
        _per_key_range(factor[k:end], scale[c], out[k:end])
        k = end


@compiled
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
    """The whole batch's answer into ``out`` (N,), as :func:`_write_rollout` (0 on rollouts not
    ``busy``; ``scale`` and ``shift`` per rollout); returns each rollout's float64 sum of it."""
    sums = np.zeros(start.shape[0], np.float64)
    for i in range(start.shape[0]):
        o, s = offsets[i], start[i]
        n = offsets[i + 1] - o
        if busy[i]:
            sums[i] = _write_rollout(
                entropy[o : o + n],
                per_key[s : s + n],
                wrong[i],
                negative,
                scale[i] == 0.0,
                shift[i],
                out[o : o + n],
            )
        else:
            out[o : o + n] = np.float32(0.0)
    return sums


def compile_all() -> None:
    """Compile (or load from the cache) every loop here, on tiny inputs (any values of the
    types the callers pass)."""
    wide_below = 0.02
    offsets = np.array([0, 1, 2], np.int64)
    flags = np.array([True, False])
    ones = np.ones(2, np.float32)
    b = np.array([1.0, -1.0])
    gtpo_grouped(ones, offsets, np.zeros(2, np.int64), 1, ~flags, b, 0.1, 1e-6, wide_below, ones)
    start = np.array([0, 0], np.int64)
    total, squares, factor = np.zeros(1), np.zeros(1), np.zeros(1)
    alive, per_key = np.zeros(1, np.float32), np.zeros(1, np.float32)
    gtpo_position_sums(ones, offsets, start, flags, flags, total, squares, alive)
    gtpo_factor(total, alive, 1, 0.1, factor)
    longest = np.array([1, 0], np.int64)
    class_square_sums(factor, squares, longest)
    gtpo_per_key(factor, np.ones(2), longest, per_key)
    gtpo_write(ones, offsets, start, flags, flags, False, per_key, np.ones(2), ones, ones.copy())
    scale, wide, shift = np.zeros(2), np.zeros(2, np.bool_), np.zeros(2)
    rollouts = np.arange(2)
    contrast = np.ones(2, np.bool_)
    for rollout_y in (np.zeros(0), np.zeros(2)):
        class_statistics(
            offsets[1:], rollouts, rollouts, contrast, np.ones(2), b, 0.1, 1e-6, wide_below,
            rollout_y, scale, wide, shift,
        )  # fmt: skip
