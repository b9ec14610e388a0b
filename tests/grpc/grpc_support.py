"""Helpers for the gRPC tests: a real service process (HTTP and gRPC on one engine), metrics,
and request builders written without the service's own encoders.

The process is ``advantage-service serve``, which runs both transports on one engine.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
from advantage_service import presets, resolve_estimator
from advantage_service.estimators.pipeline import estimator_diagnostics
from grpc_health.v1 import health_pb2, health_pb2_grpc
from process_support import ServiceProcess, launch_service

ALL_PRESETS = sorted(presets())


def health_status(target: str, service: str = "") -> int | None:
    """The gRPC health service's answer for ``service`` (None when unreachable)."""
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            return int(stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status)
        except grpc.RpcError:
            return None


class Service(ServiceProcess):
    """One running service process with an HTTP port and a gRPC port."""

    def __init__(self, proc: subprocess.Popen[bytes], http_port: int, grpc_port: int, log: Path):
        url = f"http://127.0.0.1:{http_port}"
        super().__init__(proc, url, log, httpx.Client(base_url=url, timeout=60.0))
        self.target = f"127.0.0.1:{grpc_port}"

    def also_ready(self) -> bool:
        return health_status(self.target) == health_pb2.HealthCheckResponse.SERVING


def start_service(directory: Path, **settings: Any) -> Service:
    """A service on free ports, with ``ADV_<NAME>`` variables from ``settings``, on the CPU."""
    service = Service(*launch_service(directory, settings))
    service.ready_or_killed()
    return service


# ---- requests ----------------------------------------------------------------------------------


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


def uses_token_inputs(estimator: str | dict[str, Any]) -> bool:
    """Whether the estimator reads entropy, sum_pi_squared or planning_mask (forking, otb,
    gtpo, grpo_s, hicra)."""
    spec = resolve_estimator(estimator)
    return spec.outcome in ("otb", "gtpo", "grpo_s") or bool({"forking", "hicra"} & set(spec.terms))


def random_rollout(
    rng: np.random.Generator, reward: float, max_len: int = 40, with_token_inputs: bool = False
) -> dict[str, Any]:
    """A rollout with logprobs and pos/neg teacher log-probs (so every preset applies), and
    with entropy, sum_pi_squared, is_weights and planning_mask when ``with_token_inputs``."""
    n = int(rng.integers(0, max_len))
    tokens = rng.integers(0, 300, size=n).tolist()
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
    return rollout


def random_groups(
    seed: int, groups: int = 4, prefix: str = "prompt", with_token_inputs: bool = False
) -> list[dict[str, Any]]:
    """Groups of 2-5 rollouts, mixed and zero-signal rewards, some empty rollouts."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        size = int(rng.integers(2, 6))
        rewards = rng.integers(0, 2, size=size).astype(float) if g % 3 else np.ones(size)
        out.append(
            {
                "id": f"{prefix}-{seed}-{g}",
                "rollouts": [
                    random_rollout(rng, r, with_token_inputs=with_token_inputs) for r in rewards
                ],
            }
        )
    return out


def content_key(*parts: Any) -> str:
    """A short key of what makes two requests of one seed differ (their estimator, size)."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=6).hexdigest()


def random_request(seed: int, estimator: str | dict[str, Any] = "grpo") -> dict[str, Any]:
    return {
        # (One id per content: an id sent again with another body is a 409 conflict.)
        "request_id": f"req-{seed}-{content_key(estimator)}",
        "estimator": estimator,
        "ignore_token_ids": [0],
        "return": diagnostics_for(estimator),
        "groups": random_groups(seed, with_token_inputs=uses_token_inputs(estimator)),
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
