"""Slow reference of the ``gdpo`` outcome, written from shared/design/ESTIMATORS.md ("Several
rewards per rollout") and docs/estimator-config.md (gdpo), sharing no code with the service:
plain Python floats, one group and one component at a time.

``gdpo_reference(groups, weights, normalization)``: ``groups`` is a list of groups, each a list of
rollouts ``(components, tokens)`` with ``components`` a dict name -> float or None (no value);
returns each rollout's a_i, groups flattened in order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

Rollout = tuple[Mapping[str, float | None], int]

GROUP_EPS = {"verl": 1e-6, "trl": 1e-4}


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _sample_std(values: Sequence[float]) -> float:
    m = _mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def normalised_component(values: Sequence[float | None], normalization: str) -> list[float]:
    """A_ik for one group's values of component k (None: no value; it gets 0)."""
    scored = [v for v in values if v is not None]
    eps = GROUP_EPS[normalization]
    if len(scored) == 1:
        if normalization == "trl":  # no std of one value: the component adds nothing
            return [0.0] * len(values)
        mean, std = 0.0, 1.0  # verl's group of one
    elif len(scored) >= 2:
        mean, std = _mean(scored), _sample_std(scored)
    else:
        return [0.0] * len(values)
    return [0.0 if v is None else (v - mean) / (std + eps) for v in values]


def weighted_sums(
    groups: Sequence[Sequence[Rollout]], weights: Mapping[str, float], normalization: str
) -> tuple[list[float], list[bool]]:
    """(S_i, whether rollout i has a value of any component), groups flattened."""
    names = sorted({name for group in groups for comps, _ in group for name in comps})
    sums: list[float] = []
    scored: list[bool] = []
    for group in groups:
        per_name = {
            name: normalised_component([comps.get(name) for comps, _ in group], normalization)
            for name in names
        }
        for i, (comps, _) in enumerate(group):
            sums.append(sum(weights.get(name, 1.0) * per_name[name][i] for name in names))
            scored.append(any(comps.get(name) is not None for name in names))
    return sums, scored


def gdpo_reference(
    groups: Sequence[Sequence[Rollout]],
    weights: Mapping[str, float] | None = None,
    normalization: str = "verl",
) -> list[float]:
    sums, scored = weighted_sums(groups, weights or {}, normalization)
    lengths = [tokens for group in groups for _, tokens in group]
    if normalization == "verl":
        # Every token of rollout i carries S_i: statistics over the tokens, written out.
        tokens = [s for s, t, ok in zip(sums, lengths, scored, strict=True) if ok for _ in range(t)]
        n = len(tokens)
        if n < 2:
            return [0.0] * len(sums)
        mean = sum(tokens) / (n + 1e-8)
        var = sum((v - mean) ** 2 for v in tokens) / (n + 1e-8) * n / (n - 1)
        return [
            (s - mean) / math.sqrt(var + 1e-8) if ok else 0.0
            for s, ok in zip(sums, scored, strict=True)
        ]
    values = [s for s, ok in zip(sums, scored, strict=True) if ok]
    if len(values) < 2:
        return [0.0] * len(sums)
    mean, std = _mean(values), _sample_std(values)
    return [(s - mean) / (std + 1e-4) if ok else 0.0 for s, ok in zip(sums, scored, strict=True)]
