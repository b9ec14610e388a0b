"""A local stand-in for the service's outcome baselines, for a trainer that would rather go on
than stop when the service stays unreachable past the client's retries (opt-in).

Only outcome-only estimators a few lines of numpy reproduce exactly are here: ``grpo`` (with
``norm_by_std`` and ``epsilon``), ``dr_grpo``, ``rloo`` and ``reinforce``, without whitening,
with ``clip``. They follow the service's ``estimators/baselines.py``: sample standard deviation,
a group of one has mean 0 and std 1, and 0 / 0 is 0. Token-level estimators (KTAE, CSCR, ...)
have no local stand-in: their history and vocabulary statistics live in the service.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

OUTCOMES = ("grpo", "dr_grpo", "rloo", "reinforce")
# grpo's scaling parameters and the values the stand-in computes (the service's defaults; a
# group of equal rewards gets 0 either way, so both zero_signal values agree here). Any other
# value (a request-wide mean or std, leave-one-out, ...) needs the service.
GRPO_LOCAL_VALUES: dict[str, tuple[Any, ...]] = {
    "mean_scope": ("group",),
    "std_scope": ("group",),
    "leave_one_out": (False,),
    "std_unbiased": (True,),
    "std_center": ("mean",),
    "zero_signal": ("keep", "zero"),
}


def unsupported(resolved: Mapping[str, Any]) -> str | None:
    """Why the resolved estimator has no local stand-in, or None when it has one."""
    outcome = resolved.get("outcome") or {}
    name = outcome.get("name")
    if name not in OUTCOMES:
        return f"outcome {name!r} has no local stand-in (those that do: {list(OUTCOMES)})"
    if name == "grpo":
        for param, local in GRPO_LOCAL_VALUES.items():
            if param in outcome and outcome[param] not in local:
                return f"grpo's {param}={outcome[param]!r} has no local stand-in (it has {local})"
    terms = [k for k, v in resolved.items() if k not in ("outcome", "whiten", "clip") and v]
    if terms:
        return f"the token-level terms {terms} need the service"
    if resolved.get("whiten"):
        return "whitening has no local stand-in"
    return None


def outcome_scalars(
    resolved: Mapping[str, Any], rewards: np.ndarray, group_index: np.ndarray
) -> np.ndarray:
    """Each rollout's advantage, float64 (B,), from its group's rewards."""
    outcome = resolved["outcome"]
    name = outcome["name"]
    r = np.asarray(rewards, dtype=np.float64)
    g = np.asarray(group_index, dtype=np.int64)
    groups = int(g.max()) + 1 if g.size else 0
    n = np.bincount(g, minlength=groups).astype(np.float64)
    total = np.bincount(g, weights=r, minlength=groups)
    if name == "reinforce":
        a = r.copy()
    elif name == "rloo":
        size = n[g]
        a = np.where(size > 1, (size * r - total[g]) / np.maximum(size - 1, 1), 0.0)
    else:
        single = n == 1
        mean = np.where(single, 0.0, total / np.maximum(n, 1))
        a = r - mean[g]
        if name == "grpo" and outcome.get("norm_by_std", True):
            sq = np.bincount(g, weights=(r - (total / np.maximum(n, 1))[g]) ** 2, minlength=groups)
            std = np.where(single, 1.0, np.sqrt(sq / np.maximum(n - 1, 1)))
            spread = std[g] + float(outcome.get("epsilon", 1e-6))
            a = np.divide(a, spread, out=np.zeros_like(a), where=spread > 0)
    clip = resolved.get("clip")
    if clip is not None:
        a = np.clip(a, -float(clip), float(clip))
    return a
