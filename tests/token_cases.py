"""Requests for the token-level methods (forking tokens, OTB, GTPO, GRPO-S, HICRA; MaxRL beside
them) shared by the in-process, CLI, HTTP and gRPC tests: a small hand-made request with every
per-token input, and the table of request errors the new inputs and parameters add, each with
the error it must give (code, group id, rollout index, field) on every transport."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Exact in float32 (so every wire gives the numbers JSON gives). sum_pi_squared lies in
# [pi^2, pi^2 + (1 - pi)^2] for pi = exp(logprob), except where it is exactly 1 with pi = 1.
ROLLOUTS: dict[str, list[dict[str, Any]]] = {
    "g0": [
        {
            "tokens": [1, 2, 3, 4],
            "reward": 1.0,
            "logprobs": [-0.25, -1.5, 0.0, -0.5],
            "entropy": [0.5, 2.0, 0.0, 1.25],
            "sum_pi_squared": [0.625, 0.25, 1.0, 0.5],
            "is_weights": [1.0, 0.5, 1.25, 2.0],
            "planning_mask": [1.0, 0.0, 0.0, 1.0],
        },
        {
            "tokens": [1, 5],
            "reward": 0.0,
            "logprobs": [-0.25, -2.0],
            "entropy": [0.5, 2.0],
            "sum_pi_squared": [0.625, 0.375],
            "is_weights": [0.75, 1.0],
            "planning_mask": [0.0, 1.0],
        },
        {
            "tokens": [],
            "reward": 0.5,
            "logprobs": [],
            "entropy": [],
            "sum_pi_squared": [],
            "is_weights": [],
            "planning_mask": [],
        },
    ],
    "g1": [
        {
            "tokens": [6, 7, 8],
            "reward": 1.0,
            "logprobs": [-0.125, -1.0, -0.5],
            "entropy": [0.25, 2.0, 1.0],
            "sum_pi_squared": [0.78125, 0.25, 0.5],
            "is_weights": [1.0, 1.0, 0.0],
            "planning_mask": [1.0, 1.0, 0.0],
        },
    ],
}


def token_request(estimator: Any = "otb", returns: list[str] | None = None) -> dict[str, Any]:
    """Two groups (one of a single rollout, one with an empty rollout and tied entropies) with
    logprobs, entropy, sum_pi_squared, is_weights and planning_mask on every rollout."""
    return {
        "request_id": "token-methods",
        "estimator": copy.deepcopy(estimator),
        "return": list(returns or ["scalar"]),
        "groups": [
            {"id": gid, "rollouts": copy.deepcopy(rollouts)} for gid, rollouts in ROLLOUTS.items()
        ],
    }


def _drop(name: str) -> Callable[[dict[str, Any]], None]:
    def change(request: dict[str, Any]) -> None:
        for group in request["groups"]:
            for rollout in group["rollouts"]:
                rollout.pop(name, None)

    return change


def _set(group: int, rollout: int, name: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(request: dict[str, Any]) -> None:
        target = request["groups"][group]["rollouts"][rollout]
        if value is None:
            del target[name]
        else:
            target[name] = value

    return change


def _token(group: int, rollout: int, name: str, t: int, value: float) -> Any:
    values = list(ROLLOUTS[f"g{group}"][rollout][name])
    values[t] = value
    return _set(group, rollout, name, values)


def _nothing(request: dict[str, Any]) -> None:
    pass


@dataclass(frozen=True)
class ErrorCase:
    """A request the service refuses: ``change`` applied to :func:`token_request` of
    ``estimator`` asking for ``returns``; ``expected``: (code, group id, rollout index, field)."""

    name: str
    estimator: Any
    change: Callable[[dict[str, Any]], None]
    expected: tuple[str, str | None, int | None, str]
    returns: tuple[str, ...] = ("scalar",)

    def request(self) -> dict[str, Any]:
        request = token_request(self.estimator, list(self.returns))
        self.change(request)
        return request


ERROR_CASES = [
    ErrorCase(
        "otb-without-sum_pi_squared",
        "otb",
        _drop("sum_pi_squared"),
        ("missing_input", None, None, "sum_pi_squared"),
    ),
    ErrorCase(
        "otb-without-logprobs", "otb", _drop("logprobs"), ("missing_input", None, None, "logprobs")
    ),
    ErrorCase(
        "forking-without-entropy",
        {"outcome": "rloo", "forking": {}},
        _drop("entropy"),
        ("missing_input", None, None, "entropy"),
    ),
    ErrorCase(
        "entropy-on-some-rollouts-only",
        "forking",
        _set(0, 1, "entropy", None),
        ("missing_input", "g0", 1, "entropy"),
    ),
    ErrorCase(
        "sum_pi_squared-of-the-wrong-length",
        "otb",
        _set(1, 0, "sum_pi_squared", [0.5, 0.5]),
        ("length_mismatch", "g1", 0, "sum_pi_squared"),
    ),
    ErrorCase(
        "is_weights-of-the-wrong-length",
        "otb",
        _set(0, 2, "is_weights", [1.0]),
        ("length_mismatch", "g0", 2, "is_weights"),
    ),
    ErrorCase(
        "entropy-of-the-wrong-length",
        "forking",
        _set(0, 0, "entropy", [0.5]),
        ("length_mismatch", "g0", 0, "entropy"),
    ),
    ErrorCase(
        "negative-entropy",
        "forking",
        _token(0, 1, "entropy", 1, -0.5),
        ("invalid_value", "g0", 1, "entropy"),
    ),
    ErrorCase(
        "nan-entropy",
        "forking",
        _token(1, 0, "entropy", 2, math.nan),
        ("invalid_value", "g1", 0, "entropy"),
    ),
    ErrorCase(
        "zero-sum_pi_squared",
        "otb",
        _token(0, 0, "sum_pi_squared", 3, 0.0),
        ("invalid_value", "g0", 0, "sum_pi_squared"),
    ),
    ErrorCase(
        "sum_pi_squared-above-one",
        "otb",
        _token(1, 0, "sum_pi_squared", 0, 1.5),
        ("invalid_value", "g1", 0, "sum_pi_squared"),
    ),
    ErrorCase(
        "infinite-sum_pi_squared",
        "otb",
        _token(0, 1, "sum_pi_squared", 0, math.inf),
        ("invalid_value", "g0", 1, "sum_pi_squared"),
    ),
    ErrorCase(
        "negative-is_weights",
        "otb",
        _token(0, 1, "is_weights", 1, -1.0),
        ("invalid_value", "g0", 1, "is_weights"),
    ),
    ErrorCase(
        "forking-rho-zero",
        {"forking": {"rho": 0}},
        _nothing,
        ("out_of_range", None, None, "estimator.forking.rho"),
    ),
    ErrorCase(
        "forking-rho-above-one",
        {"forking": {"rho": 1.5}},
        _nothing,
        ("out_of_range", None, None, "estimator.forking.rho"),
    ),
    ErrorCase(
        "forking-unknown-scope",
        {"forking": {"scope": "batch"}},
        _nothing,
        ("out_of_range", None, None, "estimator.forking.scope"),
    ),
    ErrorCase(
        "otb-negative-epsilon",
        {"outcome": {"name": "otb", "epsilon": -1e-8}},
        _nothing,
        ("out_of_range", None, None, "estimator.outcome.epsilon"),
    ),
    ErrorCase(
        "otb-handle_zero_tail-not-a-boolean",
        {"outcome": {"name": "otb", "handle_zero_tail": 1}},
        _nothing,
        ("invalid_parameter", None, None, "estimator.outcome.handle_zero_tail"),
    ),
    ErrorCase(
        "otb_baseline-without-otb",
        "forking",
        _nothing,
        ("invalid_parameter", None, None, "return"),
        returns=("scalar", "otb_baseline"),
    ),
    ErrorCase(
        "forking_mask-without-forking",
        "otb",
        _nothing,
        ("invalid_parameter", None, None, "return"),
        returns=("forking_mask",),
    ),
    ErrorCase(
        "gtpo-without-entropy", "gtpo", _drop("entropy"), ("missing_input", None, None, "entropy")
    ),
    ErrorCase(
        "grpo_s-without-entropy",
        {"outcome": "grpo_s", "hicra": {}},
        _drop("entropy"),
        ("missing_input", None, None, "entropy"),
    ),
    ErrorCase(
        "hicra-without-planning_mask",
        {"outcome": "maxrl", "hicra": {}},
        _drop("planning_mask"),
        ("missing_input", None, None, "planning_mask"),
    ),
    ErrorCase(
        "planning_mask-on-some-rollouts-only",
        "hicra",
        _set(0, 2, "planning_mask", None),
        ("missing_input", "g0", 2, "planning_mask"),
    ),
    ErrorCase(
        "planning_mask-of-the-wrong-length",
        "hicra",
        _set(1, 0, "planning_mask", [1.0]),
        ("length_mismatch", "g1", 0, "planning_mask"),
    ),
    ErrorCase(
        "planning_mask-not-0-or-1",
        "hicra",
        _token(0, 1, "planning_mask", 1, 0.5),
        ("invalid_value", "g0", 1, "planning_mask"),
    ),
    ErrorCase(
        "planning_mask-nan",
        {"outcome": "gtpo", "hicra": {}},
        _token(0, 0, "planning_mask", 3, math.nan),
        ("invalid_value", "g0", 0, "planning_mask"),
    ),
    ErrorCase(
        "maxrl-negative-reward",
        "maxrl",
        _set(0, 1, "reward", -1.0),
        ("invalid_value", "g0", 1, "reward"),
    ),
    ErrorCase(
        "maxrl-negative-epsilon",
        {"outcome": {"name": "maxrl", "epsilon": -1e-6}},
        _nothing,
        ("out_of_range", None, None, "estimator.outcome.epsilon"),
    ),
    ErrorCase(
        "gtpo-negative-alpha2",
        {"outcome": {"name": "gtpo", "alpha2": -0.1}},
        _nothing,
        ("out_of_range", None, None, "estimator.outcome.alpha2"),
    ),
    ErrorCase(
        "grpo_s-unknown-parameter",
        {"outcome": {"name": "grpo_s", "beta": 1.0}},
        _nothing,
        ("unknown_parameter", None, None, "estimator.outcome.beta"),
    ),
    ErrorCase(
        "hicra-negative-alpha",
        {"hicra": {"alpha": -0.2}},
        _nothing,
        ("out_of_range", None, None, "estimator.hicra.alpha"),
    ),
    ErrorCase(
        "hicra-phrases-not-a-list",
        {"hicra": {"phrases": "wait"}},
        _nothing,
        ("invalid_parameter", None, None, "estimator.hicra.phrases"),
    ),
    ErrorCase(
        "hicra-blank-phrase",
        {"hicra": {"phrases": ["wait", "  "]}},
        _nothing,
        ("out_of_range", None, None, "estimator.hicra.phrases"),
    ),
    ErrorCase(
        "planning_mask-without-hicra",
        "gtpo",
        _nothing,
        ("invalid_parameter", None, None, "return"),
        returns=("scalar", "planning_mask"),
    ),
    ErrorCase(
        "gtpo_reward-without-gtpo",
        "grpo_s",
        _nothing,
        ("invalid_parameter", None, None, "return"),
        returns=("gtpo_reward",),
    ),
]
ERROR_IDS = [case.name for case in ERROR_CASES]
