"""A straightforward KTAE that follows the published algorithm's structure, for comparison only.

Per group: dense vocabulary-sized count arrays per rollout, then a Python loop over the group's
distinct tokens computing each statistic with scalar math. This is how the reference computes
KTAE (and why it took tens of seconds per training batch); the service never runs it.
"""

from __future__ import annotations

import math

import numpy as np


def _log_comb(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def fisher_p(a: int, b: int, c: int, d: int) -> float:
    n1, n2, k = a + c, b + d, a + b
    lo, hi = max(0, k - n2), min(k, n1)
    logp = [
        _log_comb(n1, x) + _log_comb(n2, k - x) - _log_comb(n1 + n2, k) for x in range(lo, hi + 1)
    ]
    observed = logp[a - lo]
    return min(1.0, sum(math.exp(v) for v in logp if v <= observed + math.log1p(1e-7)))


def _entropy(k: float, n: float) -> float:
    if n <= 0:
        return 0.0
    out = 0.0
    for q in (k / n, 1 - k / n):
        if q > 0:
            out -= q * math.log2(q)
    return out


def ktae_scores(
    tokens: np.ndarray,
    offsets: np.ndarray,
    group_index: np.ndarray,
    rewards: np.ndarray,
    vocab: int,
) -> np.ndarray:
    out = np.zeros(tokens.size)
    k1, bb = 2.0, 0.5
    for g in np.unique(group_index):
        members = np.nonzero(group_index == g)[0]
        correct = rewards[members] > 0
        n_c, n_w = int(correct.sum()), int((~correct).sum())
        if n_c == 0 or n_w == 0:
            continue
        counts = np.stack(
            [np.bincount(tokens[offsets[i] : offsets[i + 1]], minlength=vocab) for i in members]
        )  # (n, vocab): the dense per-rollout vocabulary tables
        present = counts > 0
        lengths = counts.sum(1)
        len_c, len_w = float(lengths[correct].sum()), float(lengths[~correct].sum())
        avg = (len_c + len_w) / 2
        score = {}
        for v in np.nonzero(present.any(0))[0]:
            a = int(present[correct, v].sum())
            b = int(present[~correct, v].sum())
            p = fisher_p(a, b, n_c - a, n_w - b)
            f = 0.0 if p >= 1 - 1e-6 else math.exp(-2 * p)
            n = n_c + n_w
            ig = _entropy(n_c, n) - (
                (a + b) / n * _entropy(a, a + b) + (n - a - b) / n * _entropy(n_c - a, n - a - b)
            )
            h = math.asin(math.sqrt(a / n_c)) - math.asin(math.sqrt(b / n_w))
            s = []
            for occ, length in (
                (counts[correct, v].sum(), len_c),
                (counts[~correct, v].sum(), len_w),
            ):
                tf = occ / length if length else 0.0
                kk = k1 * (1 - bb + bb * length / avg)
                s.append(tf * (k1 + 1) / (tf + kk) if tf > 0 else 0.0)
            x = h + s[0] / (s[1] + 1e-5) - s[1] / (s[0] + 1e-5)
            score[v] = math.tanh((f + ig) * x / 2 / 2)
        for i in members:
            seg = slice(offsets[i], offsets[i + 1])
            out[seg] = [score[t] for t in tokens[seg]]
    return out
