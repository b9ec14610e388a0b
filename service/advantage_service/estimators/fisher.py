"""Two-sided Fisher exact test for many 2x2 tables at once.

KTAE asks for one p-value per (group, token id): hundreds of thousands of tables, but all with
the group's margins, and every cell at most the group size. So the p-values are computed once per
distinct margin pair (|C|, |W|) for every possible (a + b, a) and the tables are looked up, never
summed one by one.
"""

from __future__ import annotations

import math

import torch

# scipy's rule: a table counts as "at most as likely" as the observed one within this relative
# tolerance, so that probabilities equal up to rounding are treated as ties.
RELATIVE_TIE_TOLERANCE = 1e-7
# Cap on the (margins, k, a, x) grid built at once, in elements.
_GRID_BUDGET = 1 << 22


def _log_comb(n: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return torch.lgamma(n + 1) - torch.lgamma(k + 1) - torch.lgamma(n - k + 1)


def pvalue_grid(n1: torch.Tensor, n2: torch.Tensor) -> torch.Tensor:
    """Two-sided p-values for every table with row margins (n1[m], n2[m]).

    n1, n2: int64 (P,). Returns float64 (P, K, X) with K = max(n1 + n2) + 1, X = max(n1) + 1:
    entry [m, k, a] is the p-value of the table [[a, k - a], [n1 - a, n2 - k + a]], i.e. a correct
    and k - a wrong rollouts containing the token. Impossible (k, a) entries hold 1.
    """
    device = n1.device
    k_count = int((n1 + n2).max()) + 1
    x_count = int(n1.max()) + 1
    ks = torch.arange(k_count, dtype=torch.float64, device=device)
    xs = torch.arange(x_count, dtype=torch.float64, device=device)
    chunk = max(1, _GRID_BUDGET // (k_count * x_count * x_count))
    out = []
    log_tol = math.log1p(RELATIVE_TIE_TOLERANCE)
    for start in range(0, n1.numel(), chunk):  # chunks of margin pairs, not of tables
        c1 = n1[start : start + chunk].double()[:, None, None]
        c2 = n2[start : start + chunk].double()[:, None, None]
        k = ks[None, :, None]
        x = xs[None, None, :]
        valid = (x <= c1) & (k - x >= 0) & (k - x <= c2) & (k <= c1 + c2)
        safe_x = torch.where(valid, x, torch.zeros_like(x))
        safe_kx = torch.where(valid, k - x, torch.zeros_like(x))
        safe_k = torch.where(k <= c1 + c2, k, torch.zeros_like(k))
        logpmf = (
            _log_comb(c1, safe_x) + _log_comb(c2, safe_kx) - _log_comb(c1 + c2, safe_k)
        ).masked_fill(~valid, -torch.inf)
        pmf = torch.exp(logpmf)
        # p[m, k, a] = sum_x pmf[m, k, x] over x with logpmf[x] <= logpmf[a] + tol.
        as_likely = logpmf[:, :, None, :] <= logpmf[:, :, :, None] + log_tol
        p = (pmf[:, :, None, :] * as_likely).sum(-1)
        out.append(torch.where(valid, p.clamp(max=1.0), torch.ones_like(p)))
    return torch.cat(out)


def fisher_two_sided(
    n1: torch.Tensor, n2: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> torch.Tensor:
    """Two-sided Fisher exact p-values of the tables [[a, b], [n1 - a, n2 - b]].

    All int64 of one shape (M,), with 0 <= a <= n1 and 0 <= b <= n2. Returns float64 (M,).
    """
    if a.numel() == 0:
        return torch.zeros(0, dtype=torch.float64, device=a.device)
    stride = int(n2.max()) + 1
    margins, which = torch.unique(n1 * stride + n2, return_inverse=True)
    grid = pvalue_grid(margins // stride, margins % stride)
    return grid[which, a + b, a]


def margin_grid(
    n1: torch.Tensor, n2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`pvalue_grid` for the distinct margin pairs among (n1[g], n2[g]), int64 (G,).

    Returns (grid (P, K, X), margin index of each g (G,), the P distinct n1, the P distinct n2).
    """
    stride = int(n2.max()) + 1
    margins, margin_of = torch.unique(n1 * stride + n2, return_inverse=True)
    m1, m2 = margins // stride, margins % stride
    return pvalue_grid(m1, m2), margin_of, m1, m2


def fisher_two_sided_grouped(
    n1: torch.Tensor, n2: torch.Tensor, group: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> torch.Tensor:
    """p-values of the tables [[a, b], [n1[group] - a, n2[group] - b]].

    n1, n2: int64 (G,) per-group margins; group, a, b: int64 (M,). Only the G margins are made
    distinct (not the M tables): cheaper than :func:`fisher_two_sided` when tables share groups.
    """
    if a.numel() == 0:
        return torch.zeros(0, dtype=torch.float64, device=a.device)
    grid, margin_of, _, _ = margin_grid(n1, n2)
    _, k_count, x_count = grid.shape
    # One flat gather (index_select): several times advanced indexing with three index tensors.
    at = (margin_of.index_select(0, group) * k_count + (a + b)) * x_count + a
    return grid.reshape(-1).index_select(0, at)
