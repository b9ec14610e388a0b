"""Random JSON requests for the tests that talk to a real service (HTTP and gRPC), written
without the service's own encoders, so that a symmetric codec bug cannot hide."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

import numpy as np
from advantage_service import resolve_estimator
from advantage_service.estimators.pipeline import estimator_diagnostics


def diagnostics_for(estimator: str | dict[str, Any]) -> list[str]:
    """``scalar`` plus every per-token diagnostic the estimator's terms and outcome produce."""
    return list(estimator_diagnostics(resolve_estimator(estimator)))


def token_inputs(rng: np.random.Generator, logprobs: np.ndarray) -> dict[str, list[float]]:
    """Entropies, sums of squared probabilities, importance weights and a planning mask for
    tokens sampled with ``logprobs``: S = pi^2 + u (1 - pi)^2 (the rest of the mass spread out
    or on one token)."""
    n = logprobs.size
    pi = np.exp(logprobs)
    return {
        "entropy": rng.exponential(1.0, size=n).tolist(),
        "sum_pi_squared": (pi**2 + rng.uniform(0.05, 1.0, size=n) * (1 - pi) ** 2).tolist(),
        "is_weights": rng.uniform(0.5, 1.5, size=n).tolist(),
        "planning_mask": (rng.random(n) < 0.3).astype(float).tolist(),
    }


def uses_components(estimator: str | dict[str, Any]) -> bool:
    """Whether the estimator reads named reward components (gdpo)."""
    return resolve_estimator(estimator).outcome == "gdpo"


def uses_token_inputs(estimator: str | dict[str, Any]) -> bool:
    """Whether the estimator reads entropy, sum_pi_squared or planning_mask (forking, otb,
    gtpo, grpo_s, hicra)."""
    spec = resolve_estimator(estimator)
    return spec.outcome in ("otb", "gtpo", "grpo_s") or bool({"forking", "hicra"} & set(spec.terms))


def random_rollout(
    rng: np.random.Generator,
    reward: float,
    max_len: int = 40,
    with_token_inputs: bool = False,
    vocab: int = 300,
    with_components: bool = False,
) -> dict[str, Any]:
    """A rollout with logprobs and pos/neg teacher log-probs (so every preset applies), with
    entropy, sum_pi_squared, is_weights and planning_mask when ``with_token_inputs``, and two
    named rewards (one of them now and then None) when ``with_components``."""
    n = int(rng.integers(0, max_len))
    tokens = rng.integers(0, vocab, size=n).tolist()
    logprobs = -rng.exponential(1.0, size=n)
    rollout = {
        "tokens": tokens,
        "reward": float(reward),
        "logprobs": logprobs.tolist(),
        "teacher_logprobs": {
            "pos": (-rng.exponential(1.0, size=n)).tolist(),
            "neg": (-rng.exponential(1.0, size=n)).tolist(),
        },
    }
    if with_token_inputs:
        rollout.update(token_inputs(rng, logprobs))
    if with_components:  # (drawn last: requests without them are as before)
        rollout["reward_components"] = {
            "accuracy": float(reward),
            "format": None if rng.random() < 0.15 else float(rng.integers(0, 2)),
        }
    return rollout


def random_groups(
    seed: int,
    groups: int = 4,
    prefix: str = "prompt",
    with_token_inputs: bool = False,
    vocab: int = 300,
    with_components: bool = False,
) -> list[dict[str, Any]]:
    """Groups of 2-5 rollouts, mixed and zero-signal rewards, some empty rollouts."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        size = int(rng.integers(2, 6))
        rewards = rng.integers(0, 2, size=size).astype(float) if g % 3 else np.ones(size)
        rollouts = [
            random_rollout(
                rng,
                r,
                with_token_inputs=with_token_inputs,
                vocab=vocab,
                with_components=with_components,
            )
            for r in rewards
        ]
        out.append({"id": f"{prefix}-{seed}-{g}", "rollouts": rollouts})
    return out


def alternating_groups(
    rng: np.random.Generator, group_ids: Iterable[str], rollouts: int, tokens: int, vocab: int
) -> list[dict[str, Any]]:
    """A group per id of ``rollouts`` rollouts of ``tokens`` token ids below ``vocab``, with
    rewards 0, 1, 0, 1, ... (every group has signal)."""
    return [
        {
            "id": group_id,
            "rollouts": [
                {"tokens": rng.integers(0, vocab, tokens).tolist(), "reward": float(r % 2)}
                for r in range(rollouts)
            ],
        }
        for group_id in group_ids
    ]


def content_key(*parts: Any) -> str:
    """A short key of what makes two requests of one seed differ (their estimator, size)."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=6).hexdigest()
