"""Groups without reward variance: the table of docs/estimator-config.md ("Groups without reward
variance") computed row by row, so that it cannot go stale, and ``grpo``'s ``zero_signal:
"zero"`` (DAPO's and TRL's zero advantage for such groups), which the table's last column
states and the tests below check against what ``"keep"`` gives."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from advantage_service import compute
from advantage_service.errors import RequestError
from advantage_service.estimators import OUTCOMES, TERMS
from advantage_service.stats import MemoryStatsStore
from scaling_oracle import grpo_scaled
from stats.stats_helpers import serve

DOC = Path(__file__).resolve().parents[1] / "docs" / "estimator-config.md"
START = "<!-- zero-signal table: checked by tests/test_zero_signal.py -->"
END = "<!-- end zero-signal table -->"
R = 2.0  # the reward of every rollout of the group without variance
EPSILON = 1e-6  # grpo's default
# Outcomes that read reward_components (several named rewards per rollout).
COMPONENT_OUTCOMES = ("gdpo",)


def table() -> list[tuple[Any, str, str, str]]:
    """(estimator, n >= 2 cell, one-rollout cell, zero_signal cell) of each row of the doc."""
    text = DOC.read_text().split(START, 1)[1].split(END, 1)[0]
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    out = []
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        assert len(cells) == 4, line
        out.append((json.loads(cells[0].strip("`")), cells[1], cells[2], cells[3]))
    return out


def rollout(tokens: list[int], reward: float, seed: int, entropy: float) -> dict[str, Any]:
    """A rollout with every input some estimator reads."""
    rng = np.random.default_rng(seed)
    n = len(tokens)
    return {
        "tokens": tokens,
        "reward": reward,
        "logprobs": (-rng.random(n) - 0.1).tolist(),
        "teacher_logprobs": {
            "pos": (-rng.random(n)).tolist(),
            "neg": (-rng.random(n) - 0.5).tolist(),
        },
        "entropy": (rng.random(n) * 0.1 + entropy).tolist(),
        "sum_pi_squared": (rng.random(n) * 0.5 + 0.3).tolist(),
        "planning_mask": [1] + [0] * (n - 1),
    }


def request(estimator: Any, size: int, rewards: tuple[float, ...] = (R,) * 4) -> dict[str, Any]:
    """Group ``z`` (the first ``size`` of ``rewards``; high entropies, so that the forking term
    keeps some of its tokens) beside group ``m`` of mixed rewards."""
    lengths = ([5, 6, 7], [5, 8], [9, 6, 7, 5], [8, 8])
    z = [rollout(lengths[i], rewards[i], i, 2.0) for i in range(size)]
    m = [rollout([5, 6], 0.0, 10, 0.1), rollout([7, 8, 9], R, 11, 0.1), rollout([6], 0.0, 12, 0.1)]
    if outcome_name(estimator) in COMPONENT_OUTCOMES:
        # (an outcome of several rewards: two components summing to the reward)
        for r in z + m:
            r["reward_components"] = {"format": r["reward"] / 2, "accuracy": r["reward"] / 2}
    return {
        "estimator": estimator,
        "return": ["scalar"],
        "groups": [{"id": "z", "rollouts": z}, {"id": "m", "rollouts": m}],
    }


def history_reads(estimator: Any) -> bool:
    return isinstance(estimator, dict) and any(
        isinstance(v, dict) and v.get("history") == "prompt" for v in estimator.values()
    )


def answer(estimator: Any, size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(group z's token advantages, its scalars, summary's zero_signal_groups)."""
    if history_reads(estimator):
        store = MemoryStatsStore()
        # the prompt's first visit: one wrong rollout among correct ones
        asyncio.run(serve(store, request(estimator, size + 1, (0.0, R, R, R))))
        served = asyncio.run(serve(store, request(estimator, size)))
        assert served.history == "applied"
        end = int(served.req.batch.offsets[size])
        zero = int(served.req.batch.zero_signal.sum())
        return (
            served.result.advantages[:end].numpy(),
            served.result.scalars[:size].numpy(),
            zero,
        )
    response = compute(request(estimator, size), "cpu")
    z = response["groups"][0]["rollouts"]
    return (
        np.concatenate([r["advantages"] for r in z]),
        np.array([r["scalar"] for r in z]),
        response["summary"]["zero_signal_groups"],
    )


def with_zero_signal(estimator: Any) -> Any:
    spec = {"outcome": estimator} if isinstance(estimator, str) else dict(estimator)
    outcome = spec["outcome"]
    outcome = {"name": outcome} if isinstance(outcome, str) else dict(outcome)
    spec["outcome"] = {**outcome, "zero_signal": "zero"}
    return spec


def outcome_name(estimator: Any) -> str:
    outcome = estimator if isinstance(estimator, str) else estimator["outcome"]
    return outcome if isinstance(outcome, str) else outcome["name"]


def check_cell(cell: str, estimator: Any, size: int) -> None:
    kind = cell.split(":", 1)[0].strip()
    if kind == "refused":
        with pytest.raises(RequestError):
            answer(estimator, size)
        return
    got, _, zero_groups = answer(estimator, size)
    assert zero_groups == 1
    assert got.size > 0
    if kind == "0":
        assert np.all(got == 0), got
    elif kind == "r":
        np.testing.assert_allclose(got, R, rtol=1e-7)
    elif kind == "r / (1 + epsilon)":
        np.testing.assert_allclose(got, R / (1 + EPSILON), rtol=1e-7)
    elif kind == "credit":
        assert np.any(got != 0), got
        # (a cell that is one of the exact kinds says so instead)
        assert not np.allclose(got, R) and not np.allclose(got, R / (1 + EPSILON)), got
    else:
        raise AssertionError(f"unknown cell {cell!r}")


ROWS = table()


def row_id(row: tuple[Any, str, str, str]) -> str:
    return json.dumps(row[0], separators=(",", ":"))


@pytest.mark.parametrize("row", ROWS, ids=row_id)
def test_the_table_says_what_each_estimator_gives_a_group_without_variance(
    row: tuple[Any, str, str, str],
) -> None:
    estimator, many, one, zeroed = row
    check_cell(many, estimator, 3)
    check_cell(one, estimator, 1)
    if zeroed == "-":
        assert "zero_signal" not in {p.name for p in OUTCOMES[outcome_name(estimator)].params}
        return
    assert zeroed == "0"
    for size in (3, 1):
        got, scalars, zero_groups = answer(with_zero_signal(estimator), size)
        assert np.all(got == 0) and np.all(scalars == 0) and zero_groups == 1


def test_every_registered_outcome_and_term_has_a_row() -> None:
    named = {outcome_name(e) for e, *_ in ROWS}
    terms = {k for e, *_ in ROWS if isinstance(e, dict) for k in e if k in TERMS}
    assert set(OUTCOMES) - named == set()
    assert set(TERMS) - terms == set()


# The estimators that give a group without variance credit under "keep" (the table's rows).
CREDITED = [
    {"outcome": {"name": "grpo", "mean_scope": "request"}},
    {"outcome": "grpo", "whiten": True},
    {"outcome": "grpo", "opsd": {}},
    {"outcome": "grpo", "ktae": {"history": "prompt"}},
    {"outcome": "grpo", "opsd": {}, "hicra": {}, "clip": 0.5},
]


@pytest.mark.parametrize("estimator", CREDITED, ids=[json.dumps(e) for e in CREDITED])
def test_zero_signal_zero_silences_only_the_groups_without_variance(estimator: Any) -> None:
    kept = request(estimator, 3)
    zeroed = request(with_zero_signal(estimator), 3)
    if history_reads(estimator):
        store_keep, store_zero = MemoryStatsStore(), MemoryStatsStore()
        first = request(estimator, 4, (0.0, R, R, R))
        asyncio.run(serve(store_keep, first))
        asyncio.run(serve(store_zero, {**first, "estimator": zeroed["estimator"]}))
        keep = asyncio.run(serve(store_keep, kept)).result
        zero = asyncio.run(serve(store_zero, zeroed)).result
        keep_adv, zero_adv = keep.advantages.numpy(), zero.advantages.numpy()
        keep_scalar, zero_scalar = keep.scalars.numpy(), zero.scalars.numpy()
    else:
        keep_r, zero_r = compute(kept, "cpu"), compute(zeroed, "cpu")
        keep_adv, zero_adv = (
            np.concatenate([r["advantages"] for g in x["groups"] for r in g["rollouts"]])
            for x in (keep_r, zero_r)
        )
        keep_scalar, zero_scalar = (
            np.array([r["scalar"] for g in x["groups"] for r in g["rollouts"]])
            for x in (keep_r, zero_r)
        )
        assert (
            keep_r["summary"]["zero_signal_groups"] == zero_r["summary"]["zero_signal_groups"] == 1
        )
    z_tokens = sum(len(r["tokens"]) for r in kept["groups"][0]["rollouts"])
    assert np.any(keep_adv[:z_tokens] != 0)  # credit under "keep" ...
    assert np.all(zero_adv[:z_tokens] == 0) and np.all(zero_scalar[:3] == 0)  # ... none here
    # the group with mixed rewards keeps its answer, bit for bit
    assert np.array_equal(zero_adv[z_tokens:], keep_adv[z_tokens:])
    assert np.array_equal(zero_scalar[3:], keep_scalar[3:])


def test_zero_signal_zero_is_the_oracles_on_the_outcome_alone() -> None:
    """With grpo alone (no term, no whitening) the answer is the scaling oracle's, which zeroes
    a group of equal rewards itself."""
    estimator = {"outcome": {"name": "grpo", "mean_scope": "request", "zero_signal": "zero"}}
    body = request(estimator, 3)
    got = compute(body, "cpu")
    rewards = [r["reward"] for g in body["groups"] for r in g["rollouts"]]
    groups = [k for k, g in enumerate(body["groups"]) for _ in g["rollouts"]]
    want = grpo_scaled(rewards, groups, None, estimator["outcome"])
    scalars = [r["scalar"] for g in got["groups"] for r in g["rollouts"]]
    np.testing.assert_allclose(scalars, want, rtol=1e-6, atol=1e-7)
    assert want[:3] == [0.0, 0.0, 0.0] and any(w != 0 for w in want[3:])


@pytest.mark.parametrize("estimator", CREDITED[:2], ids=[json.dumps(e) for e in CREDITED[:2]])
def test_the_padded_api_silences_the_same_groups_as_the_flat_path(estimator: Any) -> None:
    """compute_padded's outcome-only path (whitening included) zeroes what the flat one does."""
    from advantage_service.wire.padded import compute_padded

    body = request(with_zero_signal(estimator), 3)
    rollouts = [(k, r) for k, g in enumerate(body["groups"]) for r in g["rollouts"]]
    width = max(1, max(len(r["tokens"]) for _, r in rollouts))
    tokens = np.zeros((len(rollouts), width), np.int32)
    mask = np.zeros((len(rollouts), width), bool)
    for i, (_, r) in enumerate(rollouts):
        tokens[i, : len(r["tokens"])] = r["tokens"]
        mask[i, : len(r["tokens"])] = True
    got = compute_padded(
        tokens,
        mask,
        np.array([r["reward"] for _, r in rollouts], np.float32),
        np.array([k for k, _ in rollouts]),
        estimator=body["estimator"],
    )
    flat = compute(body, "cpu")
    want = [r["advantages"] for g in flat["groups"] for r in g["rollouts"]]
    advantages = np.asarray(got.advantages)
    for i, row in enumerate(want):
        np.testing.assert_allclose(advantages[i, : len(row)], row, rtol=1e-6, atol=1e-7)
    z = len(body["groups"][0]["rollouts"])
    assert np.all(advantages[:z] == 0) and np.any(advantages[z:] != 0)
