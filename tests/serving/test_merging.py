"""Dynamic batching's guarantee, as a property: a request's answer is identical whether it was
computed alone or merged with any others (on the CPU bit for bit, see ``merging``), over random
mixes of presets and compositions with request-scoped math (whitening, GPG's B,
``reinforce_pp_baseline``, the forking quantile of scope ``request``, HICRA after whitening),
the new outcomes (MaxRL, GTPO, GRPO-S) and colliding group ids."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
from advantage_service.estimators import TERMS
from advantage_service.serving.compute import compute_request
from advantage_service.serving.merging import merge, merge_key, split
from advantage_service.serving.term_state import StateSession
from advantage_service.wire.request import parse_request
from oracle import ALL_PRESETS, random_request

COMPOSITIONS: list[Any] = [
    *ALL_PRESETS,
    {"outcome": "gpg", "ktae": {}, "whiten": True},
    {"outcome": "rloo", "cscr": {}, "ktae": {}},
    {"outcome": {"name": "grpo", "norm_by_std": False}, "ktae": {"tf": False}, "clip": 0.5},
    {"outcome": "reinforce_pp_baseline", "cscr": {}},
    {"outcome": "otb", "ktae": {}},
    {"outcome": "rloo", "cscr": {}, "forking": {}},
    {"outcome": "otb", "forking": {"scope": "group", "rho": 0.5}, "whiten": True, "clip": 1.0},
    {"outcome": "gpg", "opsd": {}, "forking": {"rho": 1.0}},
    {"outcome": {"name": "maxrl", "epsilon": 1e-6}, "ktae": {}, "whiten": True},
    {"outcome": "gtpo", "hicra": {"alpha": 0.5}, "forking": {}, "whiten": True, "clip": 1.0},
    {"outcome": {"name": "grpo_s", "alpha2": 0.5}, "cscr": {}, "hicra": {}},
    # Eq. 6 over the request: over each request of a merged batch, never over the batch.
    {"outcome": {"name": "gtpo", "scope": "request"}, "ktae": {}},
    {"outcome": {"name": "gtpo", "scope": "request", "alpha2": 0.5}, "hicra": {}, "whiten": True},
    {"outcome": "gpg", "hicra": {}, "whiten": True},
    # GRPO's std over the request (TRL's scale_rewards="batch"): each request's own std.
    {"outcome": {"name": "grpo", "std_scope": "request"}, "ktae": {}},
]


def requests_of(rng: np.random.Generator, estimator: Any, count: int) -> list[dict[str, Any]]:
    """``count`` random requests of one estimator whose group ids collide across requests."""
    out = []
    for _ in range(count):
        body = random_request(rng, estimator=estimator, reward_kind="mixed")
        for i, group in enumerate(body["groups"]):
            group["id"] = f"g{i}"  # the same ids in every request
        out.append(body)
    return out


def assert_same_result(merged: Any, alone: Any) -> None:
    assert torch.equal(merged.advantages, alone.advantages)
    assert torch.equal(merged.scalars, alone.scalars)
    assert merged.diagnostics.keys() == alone.diagnostics.keys()
    for name in alone.diagnostics:
        assert torch.equal(merged.diagnostics[name], alone.diagnostics[name]), name


@pytest.mark.parametrize("seed", range(len(COMPOSITIONS)))
def test_a_merged_request_gets_the_answer_it_gets_alone(seed: int) -> None:
    rng = np.random.default_rng(seed)
    estimator = COMPOSITIONS[seed % len(COMPOSITIONS)]
    bodies = requests_of(rng, estimator, int(rng.integers(2, 6)))
    reqs = [parse_request(b) for b in bodies]
    keys = {merge_key(r) for r in reqs}
    assert len(keys) == 1 and None not in keys
    batch = merge(reqs)
    merged = compute_request(
        replace(reqs[0], batch=batch),
        "cpu",
    )
    parts = split(merged, batch)
    assert len(parts) == len(reqs)
    for req, part in zip(reqs, parts, strict=True):
        alone = compute_request(req, "cpu")
        assert_same_result(part, alone)


def test_whitening_and_gpg_stay_per_request() -> None:
    """Two requests whose whole-request statistics differ: merged, each keeps its own (a merged
    whitening or a merged GPG alpha would change both)."""
    small = {
        "groups": [
            {
                "id": "g",
                "rollouts": [{"tokens": [1], "reward": 1.0}, {"tokens": [2, 3], "reward": 0.0}],
            }
        ]
    }
    large = {
        "groups": [
            {
                "id": "g",
                "rollouts": [
                    {"tokens": [1] * 5, "reward": 9.0},
                    {"tokens": [2], "reward": 0.0},
                    {"tokens": [3], "reward": 0.0},
                ],
            }
        ]
    }
    for estimator in (
        {"outcome": "gpg"},
        {"outcome": "grpo", "whiten": True},
        "reinforce_pp_baseline",
        {"outcome": {"name": "grpo", "std_scope": "request"}},
    ):
        reqs = [parse_request({**b, "estimator": estimator}) for b in (small, large)]
        batch = merge(reqs)
        whole = compute_request(replace(reqs[0], batch=batch), "cpu")
        for req, part in zip(reqs, split(whole, batch), strict=True):
            assert_same_result(part, compute_request(req, "cpu"))


def test_requests_with_and_without_an_optional_input_merge_into_their_own_answers() -> None:
    """OTB's importance weights are optional: a request without them merges with one that has
    them (its tokens take weight 1, which leaves its numbers as they are); an input the
    estimator does not read, given by some requests only, is left out of the merged batch."""
    rng = np.random.default_rng(8)
    with_weights = random_request(rng, estimator="otb", is_weights=True)
    without = random_request(rng, estimator="otb")
    extra = random_request(rng, estimator="otb", entropy=True)
    reqs = [parse_request(b) for b in (with_weights, without, extra)]
    assert len({merge_key(r) for r in reqs}) == 1
    batch = merge(reqs)
    assert batch.is_weights is not None and batch.entropy is None
    whole = compute_request(replace(reqs[0], batch=batch), "cpu")
    for req, part in zip(reqs, split(whole, batch), strict=True):
        assert_same_result(part, compute_request(req, "cpu"))


def test_a_planning_mask_some_requests_give_and_their_estimator_does_not_read_is_dropped() -> None:
    rng = np.random.default_rng(9)
    given = random_request(rng, estimator="gtpo", planning_mask=True)
    without = random_request(rng, estimator="gtpo")
    reqs = [parse_request(b) for b in (given, without)]
    assert len({merge_key(r) for r in reqs}) == 1
    batch = merge(reqs)
    assert batch.planning_mask is None and batch.entropy is not None
    whole = compute_request(replace(reqs[0], batch=batch), "cpu")
    for req, part in zip(reqs, split(whole, batch), strict=True):
        assert_same_result(part, compute_request(req, "cpu"))


def test_the_term_state_of_a_merged_request_writes_what_it_writes_alone() -> None:
    """The statistics a merged request writes (from its share of the merged term state) are the
    ones it writes when computed alone."""
    rng = np.random.default_rng(5)
    bodies = requests_of(rng, {"outcome": "grpo", "ktae": {}, "cscr": {}}, 3)
    reqs = [parse_request(b) for b in bodies]
    batch = merge(reqs)
    whole = compute_request(replace(reqs[0], batch=batch), "cpu")
    assert set(whole.state) == {"ktae", "cscr"} and all(TERMS[n].state for n in whole.state)

    async def updates() -> list[tuple[Any, Any]]:
        out = []
        for req, part in zip(reqs, split(whole, batch), strict=True):
            session = StateSession(None, req, torch.device("cpu"))  # type: ignore[arg-type]
            alone = compute_request(req, "cpu")
            out.append((session.update(part), session.update(alone)))
        return out

    for merged_update, alone_update in asyncio.run(updates()):
        a, b = merged_update.tokens, alone_update.tokens
        for column in (
            "tokens",
            "correct",
            "wrong",
            "occurrences",
            "key_sum",
            "key_count",
            "sens_sum",
            "sens_count",
        ):
            assert np.array_equal(getattr(a, column), getattr(b, column)), column
        assert a.key_count.sum() > 0


def test_requests_that_read_state_never_merge() -> None:
    body = random_request(np.random.default_rng(1), estimator="ktae")
    body["estimator"] = {"outcome": "grpo", "ktae": {"history": "prompt"}}
    assert merge_key(parse_request(body)) is None
    plain = parse_request(random_request(np.random.default_rng(1), estimator="ktae"))
    assert merge_key(plain) is not None
