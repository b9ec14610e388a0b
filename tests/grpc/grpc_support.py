"""Helpers for the gRPC tests: request builders written without the service's own encoders
(the service process they talk to is service_support's)."""

from __future__ import annotations

from typing import Any

from advantage_service import presets
from request_support import (
    content_key,
    diagnostics_for,
    random_groups,
    uses_components,
    uses_token_inputs,
)

ALL_PRESETS = sorted(presets())


# ---- requests ----------------------------------------------------------------------------------


def random_request(seed: int, estimator: str | dict[str, Any] = "grpo") -> dict[str, Any]:
    return {
        # (One id per content: an id sent again with another body is a 409 conflict.)
        "request_id": f"req-{seed}-{content_key(estimator)}",
        "estimator": estimator,
        "ignore_token_ids": [0],
        "return": diagnostics_for(estimator),
        "groups": random_groups(
            seed,
            with_token_inputs=uses_token_inputs(estimator),
            with_components=uses_components(estimator),
        ),
    }


def stream_rollouts(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The groups' rollouts as stream rollout dicts, with ``rollout_id`` ``<group>/<index>``."""
    return [
        {
            "group_id": group["id"],
            "group_size": len(group["rollouts"]),
            "rollout_id": f"{group['id']}/{i}",
            **rollout,
        }
        for group in groups
        for i, rollout in enumerate(group["rollouts"])
    ]
