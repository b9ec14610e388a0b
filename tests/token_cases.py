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


def _in_rollout(
    name: str,
    estimator: Any,
    code: str,
    group: int,
    rollout: int,
    field: str,
    value: Any,
    t: int | None = None,
) -> ErrorCase:
    """``field`` of one rollout set to ``value`` (deleted for None; with ``t``, only that
    token's value), the error naming that group, rollout and field."""
    change = (
        _set(group, rollout, field, value) if t is None else _token(group, rollout, field, t, value)
    )
    return ErrorCase(name, estimator, change, (code, f"g{group}", rollout, field))


def _without(name: str, estimator: Any, field: str) -> ErrorCase:
    """A request whose rollouts all lack ``field``, which ``estimator`` reads."""
    return ErrorCase(name, estimator, _drop(field), ("missing_input", None, None, field))


def _refused_spec(
    name: str, estimator: Any, code: str, field: str, returns: tuple[str, ...] = ("scalar",)
) -> ErrorCase:
    """The valid request with an estimator or a ``return`` list the service refuses (named by
    the parameter's path, not by a group or rollout)."""
    return ErrorCase(name, estimator, _nothing, (code, None, None, field), returns)


ERROR_CASES = [
    _without("otb-without-sum_pi_squared", "otb", "sum_pi_squared"),
    _without("otb-without-logprobs", "otb", "logprobs"),
    _without("forking-without-entropy", {"outcome": "rloo", "forking": {}}, "entropy"),
    _in_rollout("entropy-on-some-rollouts-only", "forking", "missing_input", 0, 1, "entropy", None),
    _in_rollout(
        "sum_pi_squared-of-the-wrong-length",
        "otb",
        "length_mismatch",
        1,
        0,
        "sum_pi_squared",
        [0.5, 0.5],
    ),
    _in_rollout(
        "is_weights-of-the-wrong-length", "otb", "length_mismatch", 0, 2, "is_weights", [1.0]
    ),
    _in_rollout(
        "entropy-of-the-wrong-length", "forking", "length_mismatch", 0, 0, "entropy", [0.5]
    ),
    _in_rollout("negative-entropy", "forking", "invalid_value", 0, 1, "entropy", -0.5, t=1),
    _in_rollout("nan-entropy", "forking", "invalid_value", 1, 0, "entropy", math.nan, t=2),
    _in_rollout("zero-sum_pi_squared", "otb", "invalid_value", 0, 0, "sum_pi_squared", 0.0, t=3),
    _in_rollout(
        "sum_pi_squared-above-one", "otb", "invalid_value", 1, 0, "sum_pi_squared", 1.5, t=0
    ),
    _in_rollout(
        "infinite-sum_pi_squared", "otb", "invalid_value", 0, 1, "sum_pi_squared", math.inf, t=0
    ),
    _in_rollout("negative-is_weights", "otb", "invalid_value", 0, 1, "is_weights", -1.0, t=1),
    _refused_spec(
        "forking-rho-zero", {"forking": {"rho": 0}}, "out_of_range", "estimator.forking.rho"
    ),
    _refused_spec(
        "forking-rho-above-one", {"forking": {"rho": 1.5}}, "out_of_range", "estimator.forking.rho"
    ),
    _refused_spec(
        "forking-unknown-scope",
        {"forking": {"scope": "batch"}},
        "out_of_range",
        "estimator.forking.scope",
    ),
    _refused_spec(
        "otb-negative-epsilon",
        {"outcome": {"name": "otb", "epsilon": -1e-8}},
        "out_of_range",
        "estimator.outcome.epsilon",
    ),
    _refused_spec(
        "otb-handle_zero_tail-not-a-boolean",
        {"outcome": {"name": "otb", "handle_zero_tail": 1}},
        "invalid_parameter",
        "estimator.outcome.handle_zero_tail",
    ),
    _refused_spec(
        "otb_baseline-without-otb",
        "forking",
        "invalid_parameter",
        "return",
        returns=("scalar", "otb_baseline"),
    ),
    _refused_spec(
        "forking_mask-without-forking",
        "otb",
        "invalid_parameter",
        "return",
        returns=("forking_mask",),
    ),
    _without("gtpo-without-entropy", "gtpo", "entropy"),
    _without("grpo_s-without-entropy", {"outcome": "grpo_s", "hicra": {}}, "entropy"),
    _without("hicra-without-planning_mask", {"outcome": "maxrl", "hicra": {}}, "planning_mask"),
    _in_rollout(
        "planning_mask-on-some-rollouts-only", "hicra", "missing_input", 0, 2, "planning_mask", None
    ),
    _in_rollout(
        "planning_mask-of-the-wrong-length",
        "hicra",
        "length_mismatch",
        1,
        0,
        "planning_mask",
        [1.0],
    ),
    _in_rollout(
        "planning_mask-not-0-or-1", "hicra", "invalid_value", 0, 1, "planning_mask", 0.5, t=1
    ),
    _in_rollout(
        "planning_mask-nan",
        {"outcome": "gtpo", "hicra": {}},
        "invalid_value",
        0,
        0,
        "planning_mask",
        math.nan,
        t=3,
    ),
    _in_rollout("maxrl-negative-reward", "maxrl", "invalid_value", 0, 1, "reward", -1.0),
    _refused_spec(
        "maxrl-negative-epsilon",
        {"outcome": {"name": "maxrl", "epsilon": -1e-6}},
        "out_of_range",
        "estimator.outcome.epsilon",
    ),
    _refused_spec(
        "gtpo-negative-alpha2",
        {"outcome": {"name": "gtpo", "alpha2": -0.1}},
        "out_of_range",
        "estimator.outcome.alpha2",
    ),
    _refused_spec(
        "grpo_s-unknown-parameter",
        {"outcome": {"name": "grpo_s", "beta": 1.0}},
        "unknown_parameter",
        "estimator.outcome.beta",
    ),
    _refused_spec(
        "hicra-negative-alpha", {"hicra": {"alpha": -0.2}}, "out_of_range", "estimator.hicra.alpha"
    ),
    _refused_spec(
        "hicra-phrases-not-a-list",
        {"hicra": {"phrases": "wait"}},
        "invalid_parameter",
        "estimator.hicra.phrases",
    ),
    _refused_spec(
        "hicra-blank-phrase",
        {"hicra": {"phrases": ["wait", "  "]}},
        "out_of_range",
        "estimator.hicra.phrases",
    ),
    _refused_spec(
        "planning_mask-without-hicra",
        "gtpo",
        "invalid_parameter",
        "return",
        returns=("scalar", "planning_mask"),
    ),
    _refused_spec(
        "gtpo_reward-without-gtpo",
        "grpo_s",
        "invalid_parameter",
        "return",
        returns=("gtpo_reward",),
    ),
]
ERROR_IDS = [case.name for case in ERROR_CASES]


def check_listing(listing: dict[str, Any]) -> None:
    """The estimators listing (in-process or GET /v1/estimators) names each token-level
    method's inputs, optional and derived inputs, parameters and diagnostics."""
    outcomes = {o["name"]: o for o in listing["outcomes"]}
    terms = {t["name"]: t for t in listing["terms"]}
    assert outcomes["otb"]["inputs"] == ["logprobs", "sum_pi_squared"]
    assert outcomes["otb"]["optional_inputs"] == ["is_weights", "returns"]
    assert outcomes["otb"]["per_token"] is True
    assert outcomes["otb"]["diagnostics"] == ["otb_baseline"]
    assert [p["name"] for p in outcomes["otb"]["parameters"]] == ["epsilon", "handle_zero_tail"]
    assert outcomes["grpo"]["inputs"] == [] and outcomes["grpo"]["per_token"] is False
    assert outcomes["maxrl"]["inputs"] == [] and outcomes["maxrl"]["per_token"] is False
    assert outcomes["gtpo"]["inputs"] == ["entropy"] and outcomes["gtpo"]["per_token"] is True
    assert outcomes["grpo_s"]["inputs"] == ["entropy"]
    assert outcomes["grpo_s"]["per_token"] is False
    assert terms["forking"]["inputs"] == ["entropy"]
    assert terms["forking"]["diagnostics"] == ["forking_mask"]
    assert terms["forking"]["derived_inputs"] == {}
    rho = next(p for p in terms["forking"]["parameters"] if p["name"] == "rho")
    assert (rho["default"], rho["exclusive_minimum"], rho["maximum"]) == (0.2, 0.0, 1.0)
    assert terms["cscr"]["inputs"] == ["teacher_logprobs.pos", "teacher_logprobs.neg"]
    assert terms["opsd"]["inputs"] == ["logprobs", "teacher_logprobs.pos"]
    assert terms["hicra"]["inputs"] == ["planning_mask"]
    assert "tokenizer" in terms["hicra"]["derived_inputs"]["planning_mask"]
    phrases = next(p for p in terms["hicra"]["parameters"] if p["name"] == "phrases")
    assert (phrases["type"], phrases["default"], phrases["nullable"]) == ("array", None, True)
    assert {"forking", "otb", "maxrl", "gtpo", "grpo_s", "hicra"} <= set(listing["presets"])
    assert listing["presets"]["forking"]["outcome"]["name"] == "grpo"
    assert listing["presets"]["forking"]["forking"] == {"rho": 0.2, "scope": "request"}
    assert listing["presets"]["hicra"]["outcome"]["name"] == "grpo"
    assert listing["presets"]["hicra"]["hicra"] == {"alpha": 0.2, "phrases": None}
    diagnostics = {"forking_mask", "otb_baseline", "gtpo_reward", "grpo_s_reward", "planning_mask"}
    assert diagnostics <= set(listing["diagnostics"])
