"""Requests the viewer tests compute (KTAE groups with repeated tokens, a long rollout), and
kept requests of a given size for the bounds of what the viewer keeps."""

from __future__ import annotations

from typing import Any

import numpy as np
from advantage_service.estimators.ktae import STATISTICS
from advantage_service.viewer.keep import KeptRequest

KTAE_RETURNS = ["scalar", "ktae_score", *STATISTICS]


def ktae_request(request_id: str, namespace: str = "team-a", seed: int = 0) -> dict[str, Any]:
    """Two groups of KTAE rollouts (tokens 1..12, so tables repeat) with both signs."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(2):
        rollouts = [
            {
                "tokens": rng.integers(1, 12, size=int(rng.integers(3, 9))).tolist(),
                "reward": float(i % 2),
            }
            for i in range(4)
        ]
        groups.append({"id": f"prompt-{g}", "rollouts": rollouts})
    return {
        "request_id": request_id,
        "namespace": namespace,
        "estimator": "ktae",
        "return": KTAE_RETURNS,
        "groups": groups,
    }


def long_request(request_id: str, tokens: int, namespace: str = "team-a") -> dict[str, Any]:
    """One group of two rollouts, the first ``tokens`` long."""
    rng = np.random.default_rng(7)
    return {
        "request_id": request_id,
        "namespace": namespace,
        "estimator": "ktae",
        "return": ["scalar", "ktae_score"],
        "groups": [
            {
                "id": "long",
                "rollouts": [
                    {"tokens": rng.integers(1, 60, size=tokens).tolist(), "reward": 1.0},
                    {"tokens": rng.integers(1, 60, size=64).tolist(), "reward": 0.0},
                ],
            }
        ],
    }


def kept(namespace: str, request_id: str, tokens: int) -> KeptRequest:
    """A kept request of one group of one rollout with ``tokens`` tokens (its size)."""
    return KeptRequest(
        request_id=request_id,
        namespace=namespace,
        kept_at=0.0,
        group_ids=["g"],
        group_sizes=[1],
        tokens=np.zeros(tokens, dtype=np.int32),
        offsets=np.array([0, tokens], dtype=np.int64),
        rewards=np.zeros(1, dtype=np.float32),
        response=b"{}",
        estimator="grpo",
    )
