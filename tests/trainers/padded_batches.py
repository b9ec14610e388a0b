"""Random (B, T) padded batches built from the oracle's random requests, with the oracle's
answer laid out the same way.

A request's rollouts become rows in a shuffled order (a group's rows are not adjacent), each row
right-padded, left-padded or with holes in its mask; the group ids are strings, integers or an
object array of uuids. The oracle (tests/oracle.py) computes the nested request; its per-token
answers are placed at each row's mask positions by plain loops, so no code is shared with the
vectorised layout under test.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from oracle import random_request, reference_compute

LAYOUTS = ("right", "left", "holes", "mixed")
ID_KINDS = ("str", "int", "uuid")


@dataclass
class PaddedCase:
    tokens: np.ndarray  # int64 (B, T)
    mask: np.ndarray  # bool (B, T)
    rewards: np.ndarray  # float64 (B,)
    group_ids: np.ndarray  # (B,) str, int64 or object (uuid)
    logprobs: np.ndarray | None
    teacher_logprobs: dict[str, np.ndarray]
    request: dict[str, Any]
    # The oracle's answer in the padded layout, float64: advantages (B, T) with 0 off the mask,
    # scalars (B,), and every diagnostic of an enabled term (B, T).
    advantages: np.ndarray
    scalars: np.ndarray
    diagnostics: dict[str, np.ndarray] = field(default_factory=dict)
    # The other per-token inputs the request gives (entropy, sum_pi_squared, is_weights,
    # planning_mask): (B, T) float64, an invalid value (5.0) off the mask.
    per_token: dict[str, np.ndarray] = field(default_factory=dict)


def _positions(rng: np.random.Generator, layout: str, length: int, width: int) -> list[int]:
    if layout == "mixed":
        layout = str(rng.choice(["right", "left", "holes"]))
    if layout == "right":
        return list(range(length))
    if layout == "left":
        return list(range(width - length, width))
    return sorted(int(p) for p in rng.choice(width, size=length, replace=False))


def padded_case(
    seed: int,
    estimator: Any = "grpo",
    *,
    layout: str = "mixed",
    ids: str = "str",
    ignore_token_ids: list[int] | None = None,
    extra_width: int = 5,
    **request_options: Any,
) -> PaddedCase:
    rng = np.random.default_rng(seed)
    request = random_request(
        rng, estimator=estimator, ignore_token_ids=ignore_token_ids, **request_options
    )
    reference = reference_compute(request)
    rows = [
        (g, group["id"], rollout, answer)
        for g, (group, ref_group) in enumerate(
            zip(request["groups"], reference["groups"], strict=True)
        )
        for rollout, answer in zip(group["rollouts"], ref_group["rollouts"], strict=True)
    ]
    order = rng.permutation(len(rows))
    rows = [rows[int(i)] for i in order]
    width = max([len(r["tokens"]) for _, _, r, _ in rows] + [0]) + extra_width
    b = len(rows)
    tokens = np.full((b, width), 7777, dtype=np.int64)  # padding ids the service never sees
    mask = np.zeros((b, width), dtype=bool)
    rewards = np.zeros(b)
    teachers = sorted({name for _, _, r, _ in rows for name in r.get("teacher_logprobs", {})})
    has_logprobs = any("logprobs" in r for _, _, r, _ in rows)
    logprobs = np.full((b, width), 5.0) if has_logprobs else None  # invalid off the mask
    teacher = {name: np.full((b, width), 5.0) for name in teachers}
    inputs = {
        name: np.full((b, width), 5.0)
        for name in ("entropy", "sum_pi_squared", "is_weights", "planning_mask")
        if rows and all(name in r for _, _, r, _ in rows)
    }
    advantages = np.zeros((b, width))
    scalars = np.zeros(b)
    diag_names = sorted(
        k for _, _, _, a in rows for k, v in a.items() if k != "advantages" and np.ndim(v) == 1
    )
    diagnostics = {name: np.zeros((b, width)) for name in dict.fromkeys(diag_names)}
    int_ids = rng.choice(10**6, size=len(request["groups"]), replace=False)
    uuids = [uuid.UUID(int=int(rng.integers(0, 2**63))) for _ in request["groups"]]
    group_ids: list[Any] = []
    for i, (g, gid, rollout, answer) in enumerate(rows):
        positions = _positions(rng, layout, len(rollout["tokens"]), width)
        for k, p in enumerate(positions):
            mask[i, p] = True
            tokens[i, p] = rollout["tokens"][k]
            advantages[i, p] = answer["advantages"][k]
            if logprobs is not None:
                logprobs[i, p] = rollout["logprobs"][k]
            for name in teachers:
                teacher[name][i, p] = rollout["teacher_logprobs"][name][k]
            for name, values in inputs.items():
                values[i, p] = rollout[name][k]
            for name in diagnostics:
                diagnostics[name][i, p] = answer[name][k]
        rewards[i] = rollout["reward"]
        scalars[i] = answer["scalar"]
        group_ids.append({"str": gid, "int": int(int_ids[g]), "uuid": uuids[g]}[ids])
    id_array = np.array(group_ids, dtype=object) if ids == "uuid" else np.asarray(group_ids)
    return PaddedCase(
        tokens=tokens,
        mask=mask,
        rewards=rewards,
        group_ids=id_array,
        logprobs=logprobs,
        teacher_logprobs=teacher,
        request=request,
        per_token=inputs,
        advantages=advantages,
        scalars=scalars,
        diagnostics=diagnostics,
    )


def call_kwargs(case: PaddedCase) -> dict[str, Any]:
    """The keyword arguments of compute_padded for ``case``'s request."""
    kwargs: dict[str, Any] = {
        "estimator": case.request.get("estimator", "grpo"),
        "diagnostics": [d for d in case.request.get("return", []) if d != "scalar"],
    }
    if case.logprobs is not None:
        kwargs["logprobs"] = case.logprobs
    if case.teacher_logprobs:
        kwargs["teacher_logprobs"] = case.teacher_logprobs
    kwargs.update(case.per_token)
    if case.request.get("ignore_token_ids"):
        kwargs["ignore_token_ids"] = case.request["ignore_token_ids"]
    return kwargs


RTOL = ATOL = 2e-5


def assert_matches(case: PaddedCase, result: Any, label: str) -> None:
    """``result`` (numpy or torch) equals the oracle's answer, with exact zeros off the mask."""
    adv = np.asarray(
        result.advantages.cpu() if hasattr(result.advantages, "cpu") else result.advantages
    )
    assert adv.dtype == np.float32 and adv.shape == case.mask.shape, label
    assert np.all(adv[~case.mask] == 0.0), f"{label}: nonzero off the mask"
    np.testing.assert_allclose(adv, case.advantages, rtol=RTOL, atol=ATOL, err_msg=label)
    scalars = np.asarray(result.scalars.cpu() if hasattr(result.scalars, "cpu") else result.scalars)
    np.testing.assert_allclose(scalars, case.scalars, rtol=RTOL, atol=ATOL, err_msg=label)
    for name, expected in case.diagnostics.items():
        values = result.diagnostics[name]
        got = np.asarray(values.cpu() if hasattr(values, "cpu") else values)
        assert np.all(got[~case.mask] == 0.0), f"{label}: {name} nonzero off the mask"
        np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL, err_msg=f"{label}: {name}")
