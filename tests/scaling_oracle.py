"""Slow, independent oracle of ``grpo``'s scaling parameters, written from the formulas with
Python floats and one loop per rollout (no torch, no segment sums): the service's
``estimators/baselines.py`` computes the same with index sums over the flat batch.

For rollout i in group g of request q, with the scope S_m(i) of the mean (its group, its request,
or nothing) and S_s(i) of the standard deviation:

    b_i = mean of r_j over j in S_m(i)              (j != i with leave_one_out)
    a_i = r_i - b_i
    s_i = sqrt(sum_{j in S_s(i)} d_j^2 / (n - 1))   (n with std_unbiased false), n = |S_s(i)|
    d_j = r_j - mean of S_s(i)                      (std_center "mean")
        = r_j - b_j                                 (std_center "baseline")
    a_i <- a_i / (s_i + epsilon), 0 / 0 = 0         (unless std_scope is "none")

A scope of one rollout has mean 0 (b_i = 0) and standard deviation 1.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from oracle import OUTCOME_PARAM_DEFAULTS

# grpo's parameters and defaults, as the main oracle resolves them (one table for both)
DEFAULTS: dict[str, Any] = OUTCOME_PARAM_DEFAULTS["grpo"]


def members(i: int, scope: str, groups: Sequence[int], requests: Sequence[int]) -> list[int]:
    """The rollouts of rollout i's scope (itself alone for ``none``: never used as a set)."""
    if scope == "group":
        return [j for j in range(len(groups)) if groups[j] == groups[i]]
    if scope == "request":
        return [j for j in range(len(groups)) if requests[j] == requests[i]]
    return [i]


def baseline(
    i: int,
    rewards: Sequence[float],
    scope: str,
    loo: bool,
    groups: Sequence[int],
    req: Sequence[int],
) -> float:
    """b_i: the mean reward of rollout i's scope (of its other rollouts with ``loo``)."""
    if scope == "none":
        return 0.0
    js = members(i, scope, groups, req)
    if len(js) == 1:
        return 0.0
    if loo:
        return math.fsum(rewards[j] for j in js if j != i) / (len(js) - 1)
    return math.fsum(rewards[j] for j in js) / len(js)


def grpo_scaled(
    rewards: Sequence[float],
    groups: Sequence[int],
    requests: Sequence[int] | None = None,
    params: Mapping[str, Any] | None = None,
) -> list[float]:
    """a_i of every rollout; ``groups`` and ``requests``: each rollout's group and request
    (None: one request)."""
    p = {**DEFAULTS, **(params or {})}
    req = [0] * len(rewards) if requests is None else list(requests)
    b = [
        baseline(i, rewards, p["mean_scope"], p["leave_one_out"], groups, req)
        for i in range(len(rewards))
    ]
    out = []
    for i, r in enumerate(rewards):
        a = r - b[i]
        if p["norm_by_std"] and p["std_scope"] != "none":
            js = members(i, p["std_scope"], groups, req)
            if len(js) == 1:
                s = 1.0
            else:
                if p["std_center"] == "baseline":
                    d = [rewards[j] - b[j] for j in js]
                else:
                    m = math.fsum(rewards[j] for j in js) / len(js)
                    d = [rewards[j] - m for j in js]
                dof = len(js) - 1 if p["std_unbiased"] else len(js)
                s = math.sqrt(math.fsum(x * x for x in d) / dof)
            spread = s + p["epsilon"]
            a = a / spread if spread > 0 else 0.0
        if (
            p["zero_signal"] == "zero"
            and len({rewards[j] for j in members(i, "group", groups, req)}) == 1
        ):
            a = 0.0
        out.append(a)
    return out
