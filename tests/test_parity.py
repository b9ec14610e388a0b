"""Randomized parity of the fast path (``advantage_service.compute``) against tests/oracle.py.

Every case is one seeded random request; a failure names the configuration, the seed, the group
and the rollout, and ``make_request(name, seed)`` rebuilds the request that shows it.
Tolerance: rtol = atol = 2e-5 (the fast path works in float32, the oracle in exact/float64).
"""

from __future__ import annotations

import json
import zlib
from typing import Any

import numpy as np
import oracle
import pytest

try:
    from advantage_service import compute, presets
except ImportError as exc:  # the fast path is missing: fail collection loudly, never skip
    raise ImportError(
        "tests/test_parity.py needs `from advantage_service import compute, presets` (the fast "
        "path and the registry); "
        f"it does not import: {exc}"
    ) from exc

RTOL = 2e-5
ATOL = 2e-5
SEEDS_PER_CONFIG = 20
PER_TOKEN_FIELDS = (
    "ktae_score",
    "cscr_weight",
    "sensitivity",
    "opsd_reward",
    "forking_mask",
    "otb_baseline",
    "gtpo_reward",
    "grpo_s_reward",
    "planning_mask",
    "hicra_bonus",
)

# name -> (estimator spec, extra knobs for oracle.random_request). Every preset of the registry,
# not of the oracle: a method registered without an oracle then fails here instead of shipping
# untested (and test_every_preset_has_an_oracle says which).
CONFIGS: dict[str, tuple[str | dict[str, Any], dict[str, Any]]] = {
    **{preset: (preset, {}) for preset in presets()},
    "rloo+cscr+ktae": ({"outcome": {"name": "rloo"}, "cscr": {}, "ktae": {}}, {}),
    "dr_grpo+opsd+whiten+clip": (
        {
            "outcome": {"name": "dr_grpo"},
            "opsd": {"coef": 0.5, "clip": 1.5},
            "whiten": True,
            "clip": 1.8,
        },
        {},
    ),
    "grpo+cscr+ktae(custom)": (
        {
            "outcome": {"name": "grpo", "epsilon": 1e-3},
            "cscr": {"onset": 0.1, "decay": 4.0, "strength": 0.6},
            "ktae": {
                "tf": False,
                "fisher_weight": 0.5,
                "ig_weight": 2.0,
                "scale": 0.7,
                "correct_threshold": 0.25,
            },
        },
        {},
    ),
    "grpo(raw)+cscr+ktae(tf_k1,tf_b)": (
        {
            "outcome": {"name": "grpo", "norm_by_std": False},
            "cscr": {"strength": 1.0, "decay": 25.0, "onset": 0.0},
            "ktae": {"tf_k1": 1.2, "tf_b": 1.0, "fisher_weight": 0.0, "scale": 2.0},
        },
        {},
    ),
    "opo+ktae+ignore": (
        {"outcome": {"name": "opo"}, "ktae": {}},
        {"ignore_token_ids": [0, 3]},
    ),
    "grpo_passk(raw)+ktae": (
        {"outcome": {"name": "grpo_passk", "norm_by_std": False}, "ktae": {"tf": False}},
        {},
    ),
    "gpg+whiten+clip": ({"outcome": {"name": "gpg"}, "whiten": True, "clip": 1.0}, {}),
    "reinforce_pp_baseline(no whiten)+opsd": (
        {"outcome": {"name": "reinforce_pp_baseline"}, "whiten": False, "opsd": {"coef": -0.3}},
        {},
    ),
    "reinforce+cscr(names)+opsd(teacher)": (
        {
            "outcome": {"name": "reinforce"},
            "cscr": {"positive": "confirm", "negative": "oppose"},
            "opsd": {"teacher": "oppose", "clip": 0.5},
        },
        {},
    ),
    "ktae(large groups)": ("ktae", {"group_size": (6, 16), "length": (0, 6), "vocab": 8}),
    # Token-level methods: OTB in place of a_i, the forking mask after everything else.
    "otb(is_weights)": ("otb", {"is_weights": True}),
    "otb+ktae": ({"outcome": "otb", "ktae": {}}, {}),
    "rloo+cscr+forking": ({"outcome": "rloo", "cscr": {}, "forking": {}}, {}),
    "grpo+forking(rho=1)": ({"forking": {"rho": 1}}, {}),
    "grpo+ktae+forking(rho=0.05, continuous entropy)": (
        {"ktae": {}, "forking": {"rho": 0.05}},
        {"entropy_ties": False},
    ),
    "otb(no zero tail, eps)+cscr+opsd+forking(group)+whiten+clip": (
        {
            "outcome": {"name": "otb", "handle_zero_tail": False, "epsilon": 1e-3},
            "cscr": {},
            "opsd": {"coef": 0.5},
            "forking": {"scope": "group", "rho": 0.5},
            "whiten": True,
            "clip": 1.5,
        },
        {"is_weights": True},
    ),
    "otb+forking(large groups, ties)": (
        {"outcome": "otb", "forking": {"scope": "group"}},
        {"group_size": (6, 16), "length": (0, 6)},
    ),
    # The methods since: MaxRL, GTPO, GRPO-S (outcomes) and HICRA (a term), alone and composed.
    "maxrl(eps)+ktae": ({"outcome": {"name": "maxrl", "epsilon": 1e-6}, "ktae": {}}, {}),
    "maxrl(binary)+cscr+hicra+forking(group)": (
        {"outcome": "maxrl", "cscr": {}, "hicra": {}, "forking": {"scope": "group", "rho": 0.5}},
        {"reward_kind": "binary"},
    ),
    "gtpo(custom)+ktae": (
        {
            "outcome": {
                "name": "gtpo",
                "alpha1": 0.5,
                "alpha2": 0.75,
                "correct_threshold": 0.25,
                "epsilon": 0.0,
            },
            "ktae": {},
        },
        {},
    ),
    "gtpo+hicra(alpha=0.5)+whiten+clip": (
        {"outcome": "gtpo", "hicra": {"alpha": 0.5}, "whiten": True, "clip": 1.2},
        {},
    ),
    "gtpo(large groups, continuous entropy)+opsd+forking": (
        {"outcome": "gtpo", "opsd": {"coef": 0.5}, "forking": {}},
        {"group_size": (6, 16), "length": (0, 6), "entropy_ties": False},
    ),
    "grpo_s(custom)+cscr": (
        {
            "outcome": {"name": "grpo_s", "alpha1": 2.0, "alpha2": 1.0, "epsilon": 1e-3},
            "cscr": {},
        },
        {},
    ),
    "grpo_s+hicra+ktae+forking": (
        {"outcome": "grpo_s", "hicra": {}, "ktae": {}, "forking": {"rho": 0.5}},
        {},
    ),
    "otb+hicra(alpha=1)": ({"outcome": "otb", "hicra": {"alpha": 1.0}}, {}),
    # GRPO's std over the whole request (TRL's scale_rewards="batch").
    "grpo(std_scope=request)": ({"outcome": {"name": "grpo", "std_scope": "request"}}, {}),
    "grpo(std_scope=request, eps=1e-4, large groups)+ktae+whiten": (
        {
            "outcome": {"name": "grpo", "std_scope": "request", "epsilon": 1e-4},
            "ktae": {},
            "whiten": True,
        },
        {"group_size": (6, 16), "n_groups": (1, 6)},
    ),
    "rloo+ktae+hicra(alpha=0)": ({"outcome": "rloo", "ktae": {}, "hicra": {"alpha": 0}}, {}),
}


def test_every_preset_has_an_oracle() -> None:
    registry, oracles = set(presets()), set(oracle.ALL_PRESETS)
    assert registry == oracles, (
        f"presets without an oracle in tests/oracle.py: {sorted(registry - oracles)}; "
        f"oracle presets the registry no longer has: {sorted(oracles - registry)}"
    )


def _seed(name: str, seed: int) -> list[int]:
    return [zlib.crc32(name.encode()), seed]


def make_request(name: str, seed: int) -> dict[str, Any]:
    """The request of parity case (name, seed): knobs vary with the seed."""
    spec, extra = CONFIGS[name]
    rng = np.random.default_rng(_seed(name, seed))
    knobs: dict[str, Any] = {
        "n_groups": (1, int(rng.integers(1, 5))),
        "group_size": (1, int(rng.integers(1, 9))),
        "length": (0, int(rng.integers(1, 16))),
        "empty_prob": float(rng.choice([0.0, 0.1, 0.4])),
        "vocab": int(rng.integers(2, 16)),
        "reward_kind": ("binary", "continuous", "mixed")[seed % 3],
        "tie_prob": float(rng.choice([0.0, 0.3, 0.8])),
        "sensitive_prob": float(rng.choice([0.0, 0.3, 0.9])),
    }
    knobs.update(extra)
    return oracle.random_request(rng, estimator=spec, **knobs)


def _describe(request: dict[str, Any], group: int, rollout: int) -> str:
    r = request["groups"][group]["rollouts"][rollout]
    return f"tokens={r['tokens']} reward={r['reward']}"


def assert_response_matches(label: str, request: dict[str, Any]) -> None:
    """Compare compute(request) with the oracle on every requested field."""
    ref = oracle.reference_compute(request)
    fast = compute(json.loads(json.dumps(request)))  # the fast path sees only plain JSON
    requested = set(request.get("return", []))

    assert len(fast["groups"]) == len(ref["groups"]), f"{label}: number of groups"
    for g, (fast_group, ref_group) in enumerate(zip(fast["groups"], ref["groups"], strict=True)):
        assert fast_group["id"] == ref_group["id"], f"{label}: group {g} id"
        assert len(fast_group["rollouts"]) == len(ref_group["rollouts"]), (
            f"{label}: group {ref_group['id']} number of rollouts"
        )
        for i, (fr, rr) in enumerate(
            zip(fast_group["rollouts"], ref_group["rollouts"], strict=True)
        ):
            where = f"{label} group={ref_group['id']} rollout={i} ({_describe(request, g, i)})"
            fast_adv = np.asarray(fr["advantages"])
            assert fast_adv.shape == rr["advantages"].shape, f"{where}: advantages shape"
            np.testing.assert_allclose(
                fast_adv, rr["advantages"], rtol=RTOL, atol=ATOL, err_msg=f"{where}: advantages"
            )
            if "scalar" in requested:
                np.testing.assert_allclose(
                    np.asarray(fr["scalar"], dtype=np.float64),
                    rr["scalar"],
                    rtol=RTOL,
                    atol=ATOL,
                    err_msg=f"{where}: scalar",
                )
            for field in PER_TOKEN_FIELDS:
                if field not in requested:
                    continue
                assert field in fr, f"{where}: requested {field} missing from the response"
                fast_value = np.asarray(fr[field])
                assert fast_value.shape == rr[field].shape, f"{where}: {field} shape"
                np.testing.assert_allclose(
                    fast_value, rr[field], rtol=RTOL, atol=ATOL, err_msg=f"{where}: {field}"
                )


# ---------------------------------------------------------------------------------------------
# Randomized parity
# ---------------------------------------------------------------------------------------------

CASES = [(name, seed) for name in CONFIGS for seed in range(SEEDS_PER_CONFIG)]


@pytest.mark.parametrize(("name", "seed"), CASES, ids=[f"{n}-s{s}" for n, s in CASES])
def test_fast_path_matches_oracle_on_random_requests(name: str, seed: int):
    assert_response_matches(f"[{name} seed={seed}]", make_request(name, seed))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_response_echoes_the_resolved_estimator(name: str):
    request = make_request(name, 0)
    response = compute(json.loads(json.dumps(request)))
    assert response["estimator"] == oracle.resolve_estimator(CONFIGS[name][0])


@pytest.mark.parametrize(
    "spec",
    [
        {"outcome": {"name": "grpo"}},
        {"outcome": {"name": "rloo"}, "ktae": True},
        {"outcome": {"name": "reinforce_pp_baseline"}},
        {"outcome": {"name": "reinforce_pp_baseline"}, "whiten": False, "clip": 3},
        {"outcome": {"name": "grpo_passk", "epsilon": 0.01}, "cscr": {"decay": 3}},
        {"outcome": {"name": "opo"}, "opsd": {"clip": 2}, "ktae": None},
    ],
    ids=lambda s: json.dumps(s, sort_keys=True),
)
def test_response_echoes_partial_estimator_objects_resolved(spec):
    request = {
        "estimator": spec,
        "groups": [
            {
                "id": "a",
                "rollouts": [
                    oracle.rollout(
                        [1, 2], 1.0, [-0.5, -0.25], pos=[-0.25, -1.0], neg=[-0.75, -0.5]
                    ),
                    oracle.rollout([2], 0.0, [-2.0], pos=[-1.0], neg=[-3.0]),
                ],
            }
        ],
    }
    response = compute(request)
    assert response["estimator"] == oracle.resolve_estimator(spec)
    assert_response_matches(f"[partial {spec}]", request)


def test_fast_path_returns_float32_arrays():
    request = make_request("rloo+cscr+ktae", 1)
    response = compute(request)
    for group in response["groups"]:
        for r in group["rollouts"]:
            for field in ("advantages", *PER_TOKEN_FIELDS):
                if field in r:
                    assert isinstance(r[field], np.ndarray), field
                    assert r[field].dtype == np.float32, field


# ---------------------------------------------------------------------------------------------
# Hand-built edge cases
# ---------------------------------------------------------------------------------------------


def _group(gid: str, rollouts: list[tuple[list[int], float]], teachers: bool = True):
    out = []
    for tokens, reward in rollouts:
        r: dict[str, Any] = {"tokens": tokens, "reward": reward}
        if teachers:
            r["logprobs"] = [-0.5 - 0.125 * k for k in range(len(tokens))]
            # Tied entropies; sum_pi_squared = pi^2 + (1 - pi)^2 / 2 (exact in float32).
            r["entropy"] = [0.25 * (k % 3) for k in range(len(tokens))]
            r["planning_mask"] = [float(k % 2) for k in range(len(tokens))]
            r["sum_pi_squared"] = [
                float(np.float32(p**2 + (1 - p) ** 2 / 2))
                for p in np.exp(np.asarray(r["logprobs"], dtype=np.float64))
            ]
            r["teacher_logprobs"] = {
                "pos": [-0.25 * (k % 3) for k in range(len(tokens))],
                "neg": [-0.5 * (k % 4) for k in range(len(tokens))],
            }
        out.append(r)
    return {"id": gid, "rollouts": out}


EDGE_GROUPS = {
    "all-empty": [_group("e", [([], 1.0), ([], 0.0), ([], 0.5)])],
    "single-token-request": [_group("s", [([4], 1.0)]), _group("t", [([], 0.0)])],
    "group-of-one-empty": [_group("o", [([], 0.75)]), _group("p", [([1, 2], 0.25), ([2], 1.0)])],
    "token-in-every-rollout": [
        _group("x", [([1, 2], 1.0), ([1, 3], 1.0), ([1], 0.0), ([1, 1, 4], 0.0)])
    ],
    "threshold-ties": [_group("y", [([1, 2], 0.0), ([2, 3], 0.0), ([3], 1.0), ([], 1.0)])],
    "all-rewards-zero": [_group("z", [([1, 2], 0.0), ([2], 0.0)]), _group("w", [([5], 0.0)])],
}
EDGE_ESTIMATORS = {
    "grpo+ktae+cscr+opsd": {"outcome": {"name": "grpo"}, "ktae": {}, "cscr": {}, "opsd": {}},
    "opo": "opo",
    "rloo+whiten": {"outcome": {"name": "rloo"}, "whiten": True},
    "gpg+ktae": {"outcome": {"name": "gpg"}, "ktae": {}},
    "reinforce_pp_baseline+cscr": {"outcome": {"name": "reinforce_pp_baseline"}, "cscr": {}},
    "dr_grpo+opsd+whiten+clip": {
        "outcome": {"name": "dr_grpo"},
        "opsd": {"clip": 0.1},
        "whiten": True,
        "clip": 0.5,
    },
    "otb+forking": {"outcome": {"name": "otb"}, "forking": {}},
    "otb+ktae+whiten": {"outcome": {"name": "otb"}, "ktae": {}, "whiten": True},
    "rloo+cscr+forking(group, rho=1)": {
        "outcome": {"name": "rloo"},
        "cscr": {},
        "forking": {"scope": "group", "rho": 1.0},
    },
    "maxrl": "maxrl",
    "gtpo": "gtpo",
    "grpo_s+whiten": {"outcome": {"name": "grpo_s"}, "whiten": True},
    "grpo+hicra": "hicra",
    "gtpo+hicra+forking": {"outcome": "gtpo", "hicra": {}, "forking": {}},
    "grpo(std_scope=request, eps=0)+cscr": {
        "outcome": {"name": "grpo", "std_scope": "request", "epsilon": 0.0},
        "cscr": {},
    },
}
EDGE_CASES = [(g, e) for g in EDGE_GROUPS for e in EDGE_ESTIMATORS]


@pytest.mark.parametrize(
    ("groups", "estimator"), EDGE_CASES, ids=[f"{g}-{e}" for g, e in EDGE_CASES]
)
def test_fast_path_matches_oracle_on_edge_cases(groups: str, estimator: str):
    spec = EDGE_ESTIMATORS[estimator]
    request = {
        "estimator": spec,
        "return": oracle.diagnostic_fields(oracle.resolve_estimator(spec)),
        "ignore_token_ids": [3],
        "groups": EDGE_GROUPS[groups],
    }
    assert_response_matches(f"[edge {groups} / {estimator}]", request)
