"""Slow, obviously-correct reference implementation of the advantage estimators.

This is the test oracle for the fast path in ``advantage_service``. It is written only from
``shared/design/ESTIMATORS.md``, ``shared/design/ARCHITECTURE.md`` (request/response shape) and
``docs/estimator-config.md`` (resolved estimator object, defaults, edge cases), and shares no code
with the service: plain Python and numpy float64, one group at a time, one token id at a time.
Readability wins over speed everywhere.

Public functions:

- ``resolve_estimator(spec)``: a preset name or a partial object -> the full resolved object.
- ``fisher_two_sided_p(a, b, c, d)``: exact two-sided Fisher p-value with integer arithmetic.
- ``reference_compute(request)``: the JSON request dict -> the response (numpy float64 arrays).
- ``random_request(rng, ...)``: a generator of valid random requests for parity tests.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np
from gdpo_oracle import gdpo_reference

# ---------------------------------------------------------------------------------------------
# Estimator configuration (docs/estimator-config.md)
# ---------------------------------------------------------------------------------------------

OUTCOME_NAMES = (
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce",
    "reinforce_pp_baseline",
    "opo",
    "gpg",
    "grpo_passk",
)
TERM_PRESETS = ("ktae", "cscr", "opsd")
PRESETS = OUTCOME_NAMES + TERM_PRESETS
# The methods over token-level inputs (entropy, sum_pi_squared, planning_mask) and MaxRL (rewards
# >= 0): kept apart from PRESETS, whose requests need only tokens, rewards, logprobs and teacher
# log-probs, with any finite reward.
TOKEN_OUTCOME_NAMES = ("otb", "gtpo", "grpo_s")
TOKEN_TERM_PRESETS = ("forking", "hicra")
NONNEGATIVE_OUTCOME_NAMES = ("maxrl",)
TOKEN_PRESETS = TOKEN_OUTCOME_NAMES + TOKEN_TERM_PRESETS
# Outcomes over named reward components (a request without them is refused).
COMPONENT_OUTCOME_NAMES = ("gdpo",)
ALL_PRESETS = PRESETS + NONNEGATIVE_OUTCOME_NAMES + TOKEN_PRESETS + COMPONENT_OUTCOME_NAMES

# Outcome parameters with their defaults; outcomes not listed here take no parameters.
OUTCOME_PARAM_DEFAULTS: dict[str, dict[str, Any]] = {
    "grpo": {
        "norm_by_std": True,
        "epsilon": 1e-6,
        "std_scope": "group",
        "mean_scope": "group",
        "leave_one_out": False,
        "std_unbiased": True,
        "std_center": "mean",
        "zero_signal": "keep",
    },
    "grpo_passk": {"norm_by_std": True, "epsilon": 1e-6},
    "otb": {"epsilon": 1e-8, "handle_zero_tail": True},
    "maxrl": {"epsilon": 0.0},
    "gtpo": {
        "alpha1": 1.0,
        "alpha2": 0.1,
        "correct_threshold": 0.0,
        "epsilon": 1e-6,
        "scope": "group",
    },
    "grpo_s": {"alpha1": 1.0, "alpha2": 0.1, "correct_threshold": 0.0, "epsilon": 1e-6},
    "gdpo": {"weights": {}, "normalization": "verl"},
}

KTAE_DEFAULTS: dict[str, Any] = {
    "correct_threshold": 0.0,
    "fisher_weight": 1.0,
    "ig_weight": 1.0,
    "tf": True,
    "tf_k1": 2.0,
    "tf_b": 0.5,
    "scale": 1.0,
    "history": "none",
    "history_decay": 0.5,
}
CSCR_DEFAULTS: dict[str, Any] = {
    "mapping": "exp_onset",
    "positive": "pos",
    "negative": "neg",
    "onset": 0.05,
    "decay": 10.0,
    "strength": 0.2,
}
OPSD_DEFAULTS: dict[str, Any] = {"teacher": "pos", "coef": 1.0, "clip": None}
FORKING_DEFAULTS: dict[str, Any] = {"rho": 0.2, "scope": "request"}
HICRA_DEFAULTS: dict[str, Any] = {"alpha": 0.2, "phrases": None}
TERM_DEFAULTS = {
    "ktae": KTAE_DEFAULTS,
    "cscr": CSCR_DEFAULTS,
    "opsd": OPSD_DEFAULTS,
    "forking": FORKING_DEFAULTS,
    "hicra": HICRA_DEFAULTS,
}

TOP_LEVEL_KEYS = ("outcome", "ktae", "cscr", "opsd", "forking", "hicra", "whiten", "clip")

# Parameters whose resolved value is a float (so 10 and 10.0 resolve the same).
FLOAT_PARAMS = {
    "epsilon",
    "correct_threshold",
    "fisher_weight",
    "ig_weight",
    "tf_k1",
    "tf_b",
    "scale",
    "history_decay",
    "onset",
    "decay",
    "strength",
    "coef",
    "rho",
    "alpha",
    "alpha1",
    "alpha2",
}

WHITEN_EPS = 1e-8
TF_FLOOR = 1e-5
P_IS_ONE = 1.0 - 1e-6
FISHER_REL_TOL = Fraction(1, 10**7)


def _fill_params(given: dict[str, Any], defaults: dict[str, Any], where: str) -> dict[str, Any]:
    """Defaults overridden by ``given``; an unknown parameter is an error."""
    unknown = set(given) - set(defaults)
    if unknown:
        raise ValueError(f"unknown parameter(s) {sorted(unknown)} in {where}")
    resolved = dict(defaults)
    for key, value in given.items():
        if key in FLOAT_PARAMS or (key == "clip" and value is not None):
            value = float(value)
        resolved[key] = value
    return resolved


def _resolve_outcome(outcome: Any) -> dict[str, Any]:
    if isinstance(outcome, str):
        outcome = {"name": outcome}
    if not isinstance(outcome, dict) or "name" not in outcome:
        raise ValueError(f"outcome must be a name or an object with a name, got {outcome!r}")
    name = outcome["name"]
    known = (
        OUTCOME_NAMES + NONNEGATIVE_OUTCOME_NAMES + TOKEN_OUTCOME_NAMES + COMPONENT_OUTCOME_NAMES
    )
    if name not in known:
        raise ValueError(f"unknown outcome {name!r}")
    params = {k: v for k, v in outcome.items() if k != "name"}
    filled = _fill_params(params, OUTCOME_PARAM_DEFAULTS.get(name, {}), f"outcome {name}")
    return {"name": name, **filled}


def _resolve_term(term_name: str, value: Any) -> dict[str, Any] | None:
    """``null``/``false`` -> off; ``true``/``{}`` -> defaults; a partial object -> filled."""
    if value is None or value is False:
        return None
    if value is True:
        value = {}
    if not isinstance(value, dict):
        raise ValueError(f"{term_name} must be null, true or an object, got {value!r}")
    return _fill_params(value, TERM_DEFAULTS[term_name], term_name)


def resolve_estimator(spec: str | dict[str, Any] | None = None) -> dict[str, Any]:
    """Preset name or partial estimator object -> the full resolved object.

    A missing estimator (``None``) resolves as the ``grpo`` preset; an object without
    ``outcome`` takes the ``grpo`` outcome.
    """
    if spec is None:
        spec = "grpo"
    if isinstance(spec, str):
        if spec not in ALL_PRESETS:
            raise ValueError(f"unknown estimator preset {spec!r}")
        if spec in TERM_PRESETS + TOKEN_TERM_PRESETS:
            spec = {"outcome": {"name": "grpo"}, spec: {}}
        else:
            spec = {"outcome": {"name": spec}}
    if not isinstance(spec, dict):
        raise ValueError(f"estimator must be a preset name or an object, got {spec!r}")
    unknown = set(spec) - set(TOP_LEVEL_KEYS)
    if unknown:
        raise ValueError(f"unknown estimator field(s) {sorted(unknown)}")

    outcome = _resolve_outcome(spec.get("outcome", {"name": "grpo"}))
    whiten_default = outcome["name"] == "reinforce_pp_baseline"
    whiten = spec.get("whiten")
    clip = spec.get("clip")
    return {
        "outcome": outcome,
        "ktae": _resolve_term("ktae", spec.get("ktae")),
        "cscr": _resolve_term("cscr", spec.get("cscr")),
        "opsd": _resolve_term("opsd", spec.get("opsd")),
        "forking": _resolve_term("forking", spec.get("forking")),
        "hicra": _resolve_term("hicra", spec.get("hicra")),
        "whiten": whiten_default if whiten is None else bool(whiten),
        "clip": None if clip is None else float(clip),
    }


# ---------------------------------------------------------------------------------------------
# Small statistics, each named after the paper's term
# ---------------------------------------------------------------------------------------------


def sample_mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def sample_std(values: Sequence[float]) -> float:
    """Standard deviation with N-1 in the denominator (needs at least 2 values)."""
    mean = sample_mean(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def group_mean_and_std(rewards: Sequence[float]) -> tuple[float, float]:
    """verl's convention: a group of one rollout has mean 0 and std 1."""
    if len(rewards) == 1:
        return 0.0, 1.0
    return sample_mean(rewards), sample_std(rewards)


def hypergeometric_numerators(a: int, b: int, c: int, d: int) -> tuple[int, dict[int, int]]:
    """All 2x2 tables with the margins of [[a, b], [c, d]], keyed by their top-left cell.

    The probability of the table with top-left cell x is numerators[x] / denominator:
    comb(col1, x) * comb(col2, row1 - x) / comb(n, row1).
    """
    row1 = a + b
    col1, col2 = a + c, b + d
    n = a + b + c + d
    denominator = math.comb(n, row1)
    lowest, highest = max(0, row1 - col2), min(row1, col1)
    numerators = {
        x: math.comb(col1, x) * math.comb(col2, row1 - x) for x in range(lowest, highest + 1)
    }
    return denominator, numerators


def fisher_two_sided_p(a: int, b: int, c: int, d: int) -> float:
    """Two-sided Fisher exact test p-value of [[a, b], [c, d]], computed exactly.

    Sum of the hypergeometric probabilities (margins fixed) of every table whose probability
    is at most the observed table's times (1 + 1e-7); clamped to at most 1.
    """
    denominator, numerators = hypergeometric_numerators(a, b, c, d)
    observed = Fraction(numerators[a])
    threshold = observed * (1 + FISHER_REL_TOL)
    total = sum(num for num in numerators.values() if num <= threshold)
    return float(min(Fraction(total, denominator), Fraction(1)))


def fisher_significance(p: float) -> float:
    """F = exp(-2 p), except F = 0 when p is 1 (p >= 1 - 1e-6)."""
    if p >= P_IS_ONE:
        return 0.0
    return math.exp(-2.0 * p)


def entropy_bits(counts: Sequence[int]) -> float:
    """Shannon entropy in bits of the distribution given by counts; 0 log 0 = 0."""
    total = sum(counts)
    if total == 0:
        return 0.0
    h = 0.0
    for count in counts:
        if count > 0:
            q = count / total
            h -= q * math.log2(q)
    return h


def information_gain_bits(a: int, b: int, c: int, d: int) -> float:
    """H(Y) - H(Y | X): Y = correct/wrong (columns), X = token present/absent (rows)."""
    n = a + b + c + d
    h_y = entropy_bits([a + c, b + d])
    h_y_given_present = entropy_bits([a, b])
    h_y_given_absent = entropy_bits([c, d])
    h_y_given_x = ((a + b) / n) * h_y_given_present + ((c + d) / n) * h_y_given_absent
    return h_y - h_y_given_x


def cohens_h(rate_correct: float, rate_wrong: float) -> float:
    """Cohen's h between two proportions: asin(sqrt(p1)) - asin(sqrt(p2))."""
    return math.asin(math.sqrt(rate_correct)) - math.asin(math.sqrt(rate_wrong))


def tf_saturation(
    occurrences: int, length: int, average_length: float, k1: float, b: float
) -> float:
    """BM25-style saturated term frequency s = f (k1 + 1) / (f + K).

    f = occurrences / length (0 when length is 0), K = k1 (1 - b + b length / average_length);
    s = 0 when f = 0.
    """
    if length == 0:
        return 0.0
    f = occurrences / length
    if f == 0.0:
        return 0.0
    k = k1 * (1.0 - b + b * length / average_length)
    return f * (k1 + 1.0) / (f + k)


def tf_direction(h: float, s_correct: float, s_wrong: float) -> float:
    """x = h + s_C / (s_W + 1e-5) - s_W / (s_C + 1e-5)."""
    return h + s_correct / (s_wrong + TF_FLOOR) - s_wrong / (s_correct + TF_FLOOR)


def ktae_combined(
    fisher: float, ig: float, direction: float, fisher_weight: float, ig_weight: float
) -> float:
    """z = (w_F F + w_IG IG) x / (w_F + w_IG)."""
    return (fisher_weight * fisher + ig_weight * ig) * direction / (fisher_weight + ig_weight)


def ktae_squash(z: float, scale: float) -> float:
    """kt = scale (2 sigmoid(z) - 1) = scale tanh(z / 2) (never overflows)."""
    return scale * math.tanh(z / 2.0)


def cscr_exp_onset_weights(
    sensitivity: np.ndarray, onset: float, decay: float, strength: float
) -> np.ndarray:
    """CSCR ``exp_onset`` mapping plus within-trajectory normalisation.

    u_t = 1 - gamma (1 - exp(-alpha max(0, s_t - lambda))); w_t = u_t T / sum u
    (w_t = 1 when sum u = 0).
    """
    length = len(sensitivity)
    raw = [
        1.0 - strength * (1.0 - math.exp(-decay * max(0.0, float(s) - onset))) for s in sensitivity
    ]
    total = sum(raw)
    if total == 0.0:
        return np.ones(length, dtype=np.float64)
    return np.array([u * length / total for u in raw], dtype=np.float64)


# ---------------------------------------------------------------------------------------------
# Outcome baselines (scalar a_i), one group at a time
# ---------------------------------------------------------------------------------------------


def request_spread(all_rewards: Sequence[float]) -> float:
    """GRPO's std of scope ``request`` (TRL's ``scale_rewards="batch"``): the sample std of
    every reward of the request, its groups pooled; a request of one rollout has std 1, as a
    group of one."""
    if len(all_rewards) == 1:
        return 1.0
    return sample_std(all_rewards)


def outcome_grpo(
    rewards: list[float], norm_by_std: bool, epsilon: float, spread: float | None = None
) -> list[float]:
    """(r - mean_g) / (std + epsilon): the group's std, or ``spread`` (the request's) given;
    0 / 0 = 0 (epsilon 0 and no spread: every deviation is 0 too)."""
    mean, std = group_mean_and_std(rewards)
    if spread is not None:
        std = spread
    if norm_by_std:
        return [(r - mean) / (std + epsilon) if std + epsilon > 0 else 0.0 for r in rewards]
    return [r - mean for r in rewards]


def outcome_dr_grpo(rewards: list[float]) -> list[float]:
    mean, _ = group_mean_and_std(rewards)
    return [r - mean for r in rewards]


def outcome_rloo(rewards: list[float]) -> list[float]:
    n = len(rewards)
    if n == 1:
        return [0.0]
    total = sum(rewards)
    return [(n * r - total) / (n - 1) for r in rewards]


def outcome_reinforce(rewards: list[float]) -> list[float]:
    return list(rewards)


def outcome_reinforce_pp_baseline(rewards: list[float]) -> list[float]:
    mean, _ = group_mean_and_std(rewards)
    return [r - mean for r in rewards]


def outcome_opo(rewards: list[float], lengths: list[int]) -> list[float]:
    """b = length-weighted mean; 0 for a group of one; the plain mean when every rollout is empty.

    A group of one takes b = 0 even when its rollout is empty (verl checks the group size first).
    """
    if len(rewards) == 1:
        baseline = 0.0
    elif sum(lengths) == 0:
        baseline = sample_mean(rewards)
    else:
        baseline = sum(t * r for t, r in zip(lengths, rewards, strict=True)) / sum(lengths)
    return [r - baseline for r in rewards]


def outcome_gpg(rewards: list[float], alpha: float) -> list[float]:
    mean, _ = group_mean_and_std(rewards)
    return [alpha * (r - mean) for r in rewards]


def outcome_grpo_passk(rewards: list[float], norm_by_std: bool, epsilon: float) -> list[float]:
    if len(rewards) < 2:
        raise ValueError("grpo_passk needs at least 2 rollouts per group")
    best = max(range(len(rewards)), key=lambda i: (rewards[i], -i))  # ties: lowest index
    r_max = rewards[best]
    r_second = max(r for i, r in enumerate(rewards) if i != best)
    gap = r_max - r_second
    if norm_by_std:
        gap = gap / (sample_std(rewards) + epsilon)
    scalars = [0.0] * len(rewards)
    scalars[best] = gap
    return scalars


def outcome_maxrl(rewards: list[float], epsilon: float) -> list[float]:
    """MaxRL: (r_i - p) / (p + epsilon), p the group's mean reward (its success rate K / N for
    0/1 rewards); every rollout 0 where p + epsilon is 0. Rewards must be >= 0."""
    if any(r < 0 for r in rewards):
        raise ValueError("maxrl needs rewards >= 0")
    p = sample_mean(rewards)
    if p + epsilon <= 0:
        return [0.0] * len(rewards)
    return [(r - p) / (p + epsilon) for r in rewards]


def gpg_alpha(all_rewards: list[float]) -> float:
    """alpha = B / max(1, number of rollouts in the request with r != 0)."""
    nonzero = sum(1 for r in all_rewards if r != 0)
    return len(all_rewards) / max(1, nonzero)


def outcome_scalars(
    outcome: dict[str, Any],
    rewards: list[float],
    lengths: list[int],
    alpha: float,
    all_rewards: list[float] | None = None,
) -> list[float]:
    """One group's a_i; ``all_rewards``: the whole request's (GRPO's std of scope request)."""
    name = outcome["name"]
    if name == "grpo":
        spread = None
        if outcome["std_scope"] == "request":
            spread = request_spread(rewards if all_rewards is None else all_rewards)
        return outcome_grpo(rewards, outcome["norm_by_std"], outcome["epsilon"], spread)
    if name == "dr_grpo":
        return outcome_dr_grpo(rewards)
    if name == "rloo":
        return outcome_rloo(rewards)
    if name == "reinforce":
        return outcome_reinforce(rewards)
    if name == "reinforce_pp_baseline":
        return outcome_reinforce_pp_baseline(rewards)
    if name == "opo":
        return outcome_opo(rewards, lengths)
    if name == "gpg":
        return outcome_gpg(rewards, alpha)
    if name == "grpo_passk":
        return outcome_grpo_passk(rewards, outcome["norm_by_std"], outcome["epsilon"])
    if name == "maxrl":
        return outcome_maxrl(rewards, outcome["epsilon"])
    raise ValueError(f"unknown outcome {name!r}")


# ---------------------------------------------------------------------------------------------
# KTAE: per group, per token id
# ---------------------------------------------------------------------------------------------


def ktae_token_score(
    token: int,
    token_lists: list[list[int]],
    is_correct: list[bool],
    params: dict[str, Any],
) -> float:
    """kt_g(v) for one token id v of one group (C and W both non-empty)."""
    n_correct = sum(is_correct)
    n_wrong = len(is_correct) - n_correct

    # 1. contingency table over rollouts (presence, not counts)
    a = sum(1 for toks, ok in zip(token_lists, is_correct, strict=True) if ok and token in toks)
    b = sum(1 for toks, ok in zip(token_lists, is_correct, strict=True) if not ok and token in toks)
    c = n_correct - a
    d = n_wrong - b

    # 2. significance, 3. strength, 4. direction
    fisher = fisher_significance(fisher_two_sided_p(a, b, c, d))
    ig = information_gain_bits(a, b, c, d)
    direction = cohens_h(a / n_correct, b / n_wrong)

    # 5. term frequency
    if params["tf"]:
        length_c = sum(len(t) for t, ok in zip(token_lists, is_correct, strict=True) if ok)
        length_w = sum(len(t) for t, ok in zip(token_lists, is_correct, strict=True) if not ok)
        occ_c = sum(t.count(token) for t, ok in zip(token_lists, is_correct, strict=True) if ok)
        occ_w = sum(t.count(token) for t, ok in zip(token_lists, is_correct, strict=True) if not ok)
        average = (length_c + length_w) / 2.0
        s_c = tf_saturation(occ_c, length_c, average, params["tf_k1"], params["tf_b"])
        s_w = tf_saturation(occ_w, length_w, average, params["tf_k1"], params["tf_b"])
        direction = tf_direction(direction, s_c, s_w)

    # 6. combine, 7. squash
    z = ktae_combined(fisher, ig, direction, params["fisher_weight"], params["ig_weight"])
    return ktae_squash(z, params["scale"])


def ktae_token_statistics(
    token: int,
    token_lists: list[list[int]],
    is_correct: list[bool],
    params: dict[str, Any],
) -> dict[str, float]:
    """The statistics behind kt_g(v), named as the ``ktae_*`` diagnostics (C and W both
    non-empty): a, b, |C|, |W|, p, F, IG, h, the tf contrast (0 with tf off) and the score."""
    n_correct = sum(is_correct)
    n_wrong = len(is_correct) - n_correct
    pairs = list(zip(token_lists, is_correct, strict=True))
    a = sum(1 for toks, ok in pairs if ok and token in toks)
    b = sum(1 for toks, ok in pairs if not ok and token in toks)
    c, d = n_correct - a, n_wrong - b
    p = fisher_two_sided_p(a, b, c, d)
    h = cohens_h(a / n_correct, b / n_wrong)
    tf = 0.0
    if params["tf"]:
        length_c = sum(len(t) for t, ok in pairs if ok)
        length_w = sum(len(t) for t, ok in pairs if not ok)
        occ_c = sum(t.count(token) for t, ok in pairs if ok)
        occ_w = sum(t.count(token) for t, ok in pairs if not ok)
        average = (length_c + length_w) / 2.0
        s_c = tf_saturation(occ_c, length_c, average, params["tf_k1"], params["tf_b"])
        s_w = tf_saturation(occ_w, length_w, average, params["tf_k1"], params["tf_b"])
        tf = tf_direction(0.0, s_c, s_w)
    return {
        "ktae_a": float(a),
        "ktae_b": float(b),
        "ktae_n_correct": float(n_correct),
        "ktae_n_wrong": float(n_wrong),
        "ktae_p": p,
        "ktae_fisher": fisher_significance(p),
        "ktae_ig": information_gain_bits(a, b, c, d),
        "ktae_h": h,
        "ktae_tf": tf,
        "ktae_score": ktae_token_score(token, token_lists, is_correct, params),
    }


def ktae_group_statistics(
    token_lists: list[list[int]],
    rewards: list[float],
    params: dict[str, Any],
    ignore_token_ids: set[int],
) -> list[dict[str, np.ndarray]]:
    """Per rollout, name -> per-token values of :func:`ktae_token_statistics`. A token without
    a table (an ignored id, a group without both correct and wrong rollouts) has a = b = 0,
    p = 1 and 0 for the rest but its group's |C| and |W|."""
    is_correct = [r > params["correct_threshold"] for r in rewards]
    n_correct = float(sum(is_correct))
    untabulated = {
        "ktae_a": 0.0,
        "ktae_b": 0.0,
        "ktae_n_correct": n_correct,
        "ktae_n_wrong": float(len(rewards)) - n_correct,
        "ktae_p": 1.0,
        "ktae_fisher": 0.0,
        "ktae_ig": 0.0,
        "ktae_h": 0.0,
        "ktae_tf": 0.0,
        "ktae_score": 0.0,
    }
    contrast = any(is_correct) and not all(is_correct)
    stats: dict[int, dict[str, float]] = {}
    for token in sorted({tok for toks in token_lists for tok in toks}):
        stats[token] = (
            ktae_token_statistics(token, token_lists, is_correct, params)
            if contrast and token not in ignore_token_ids
            else untabulated
        )
    return [
        {name: np.array([stats[t][name] for t in toks], dtype=np.float64) for name in untabulated}
        for toks in token_lists
    ]


def ktae_group_scores(
    token_lists: list[list[int]],
    rewards: list[float],
    params: dict[str, Any],
    ignore_token_ids: set[int],
) -> list[np.ndarray]:
    """Per rollout, the KTAE bonus of every token (the token's group score)."""
    if params["history"] != "none":
        raise NotImplementedError("the oracle does not model KTAE history")
    is_correct = [r > params["correct_threshold"] for r in rewards]
    if all(is_correct) or not any(is_correct):
        return [np.zeros(len(t), dtype=np.float64) for t in token_lists]

    scores: dict[int, float] = {}
    for token in sorted({tok for toks in token_lists for tok in toks}):
        if token in ignore_token_ids:
            scores[token] = 0.0
        else:
            scores[token] = ktae_token_score(token, token_lists, is_correct, params)
    return [np.array([scores[tok] for tok in toks], dtype=np.float64) for toks in token_lists]


# ---------------------------------------------------------------------------------------------
# The one formula
# ---------------------------------------------------------------------------------------------


def whiten(values: np.ndarray) -> np.ndarray:
    """(A - mean) / sqrt(var + 1e-8), var with N-1 (taken as 0 below 2 values)."""
    n = len(values)
    if n == 0:
        return values.copy()
    mean = float(np.sum(values)) / n
    var = float(np.sum((values - mean) ** 2)) / (n - 1) if n >= 2 else 0.0
    return (values - mean) / math.sqrt(var + WHITEN_EPS)


def reference_compute(request: dict[str, Any]) -> dict[str, Any]:
    """The JSON request -> the response with float64 numpy arrays.

    Every rollout gets ``advantages`` and ``scalar``, plus every diagnostic of an enabled term
    (``ktae_score``; ``cscr_weight`` and ``sensitivity``; ``opsd_reward``, which is the clipped
    d without ``coef``; ``forking_mask``, 1.0 or 0.0; ``planning_mask`` and ``hicra_bonus``,
    alpha |A| m before the forking mask) or outcome
    (``otb_baseline``, ``gtpo_reward``, ``grpo_s_reward``), whether or not ``return`` asks for
    it.

    OTB's and GTPO's a_it take the place of a_i in the formula, and their scalar is the
    rollout's mean a_it (0 for an empty rollout). HICRA amplifies the advantage after whitening
    and clipping; the forking mask multiplies last.
    """
    estimator = resolve_estimator(request.get("estimator"))
    outcome, ktae, cscr, opsd, forking, hicra = (
        estimator[k] for k in ("outcome", "ktae", "cscr", "opsd", "forking", "hicra")
    )
    ignore_token_ids = {int(t) for t in request.get("ignore_token_ids") or []}
    groups = request["groups"]

    all_rewards = [float(r["reward"]) for g in groups for r in g["rollouts"]]
    alpha = gpg_alpha(all_rewards)

    shaping = {k: outcome.get(k) for k in ("alpha1", "alpha2", "correct_threshold", "epsilon")}
    pooled = None
    if outcome["name"] == "gtpo" and outcome.get("scope") == "request":
        pooled = gtpo_request([group["rollouts"] for group in groups], **shaping)

    gdpo_scalars: list[float] = []
    if outcome["name"] == "gdpo":
        gdpo_scalars = gdpo_reference(
            [
                [(r.get("reward_components") or {}, len(r["tokens"])) for r in g["rollouts"]]
                for g in groups
            ],
            outcome["weights"],
            outcome["normalization"],
        )

    out_groups = []
    for index, group in enumerate(groups):
        rollouts = group["rollouts"]
        token_lists = [[int(t) for t in r["tokens"]] for r in rollouts]
        rewards = [float(r["reward"]) for r in rollouts]
        lengths = [len(t) for t in token_lists]

        if outcome["name"] == "otb":
            per_token = otb_group(rollouts, outcome["epsilon"], outcome["handle_zero_tail"])
            token_outcome = [a for _, a in per_token]
            scalars = [float(np.mean(a)) if a.size else 0.0 for a in token_outcome]
        elif outcome["name"] == "gtpo":
            per_token = gtpo_group(rollouts, **shaping) if pooled is None else pooled[index]
            token_outcome = [a for _, a in per_token]
            scalars = [float(np.mean(a)) if a.size else 0.0 for a in token_outcome]
        elif outcome["name"] == "gdpo":
            scalars, gdpo_scalars = gdpo_scalars[: len(rollouts)], gdpo_scalars[len(rollouts) :]
            token_outcome = [np.full(t, float(s)) for s, t in zip(scalars, lengths, strict=True)]
        elif outcome["name"] == "grpo_s":
            per_rollout = grpo_s_group(rollouts, **shaping)
            scalars = [a for _, a in per_rollout]
            token_outcome = [np.full(t, float(s)) for s, t in zip(scalars, lengths, strict=True)]
        else:
            scalars = outcome_scalars(outcome, rewards, lengths, alpha, all_rewards)
            token_outcome = [np.full(t, float(s)) for s, t in zip(scalars, lengths, strict=True)]
        if ktae is not None:
            bonus = ktae_group_scores(token_lists, rewards, ktae, ignore_token_ids)

        out_rollouts = []
        for i, rollout in enumerate(rollouts):
            length = lengths[i]
            entry: dict[str, Any] = {"scalar": float(scalars[i])}
            weight = np.ones(length, dtype=np.float64)
            advantage = np.zeros(length, dtype=np.float64)

            if cscr is not None:
                teachers = rollout["teacher_logprobs"]
                pos = np.asarray(teachers[cscr["positive"]], dtype=np.float64)
                neg = np.asarray(teachers[cscr["negative"]], dtype=np.float64)
                sensitivity = np.abs(pos - neg)
                weight = cscr_exp_onset_weights(
                    sensitivity, cscr["onset"], cscr["decay"], cscr["strength"]
                )
                entry["sensitivity"] = sensitivity
                entry["cscr_weight"] = weight

            advantage = advantage + token_outcome[i] * weight
            if outcome["name"] == "otb":
                entry["otb_baseline"] = per_token[i][0]
            if outcome["name"] == "gtpo":
                entry["gtpo_reward"] = per_token[i][0]
            if outcome["name"] == "grpo_s":
                entry["grpo_s_reward"] = np.full(length, per_rollout[i][0])

            if ktae is not None:
                entry["ktae_score"] = bonus[i]
                advantage = advantage + bonus[i]

            if opsd is not None:
                teacher = np.asarray(rollout["teacher_logprobs"][opsd["teacher"]], dtype=np.float64)
                student = np.asarray(rollout["logprobs"], dtype=np.float64)
                shift = (teacher - student).reshape(length)
                if opsd["clip"] is not None:
                    shift = np.clip(shift, -opsd["clip"], opsd["clip"])
                entry["opsd_reward"] = shift
                advantage = advantage + opsd["coef"] * shift

            entry["advantages"] = advantage
            out_rollouts.append(entry)
        out_groups.append({"id": group["id"], "rollouts": out_rollouts})

    # Whitening over every token of the request, then clipping.
    flat = [r["advantages"] for g in out_groups for r in g["rollouts"]]
    sizes = [len(a) for a in flat]
    everything = np.concatenate(flat) if flat else np.zeros(0, dtype=np.float64)
    if estimator["whiten"]:
        everything = whiten(everything)
    if estimator["clip"] is not None:
        everything = np.clip(everything, -estimator["clip"], estimator["clip"])
    start = 0
    for entry, size in zip((r for g in out_groups for r in g["rollouts"]), sizes, strict=True):
        entry["advantages"] = everything[start : start + size].copy()
        start += size

    # HICRA on the combined advantage, after whitening and clipping, before the forking mask.
    if hicra is not None:
        for group, out_group in zip(groups, out_groups, strict=True):
            for rollout, entry in zip(group["rollouts"], out_group["rollouts"], strict=True):
                entry["planning_mask"] = np.asarray(rollout["planning_mask"], dtype=np.float64)
                amplified = hicra_amplify(
                    entry["advantages"], rollout["planning_mask"], hicra["alpha"]
                )
                entry["hicra_bonus"] = amplified - entry["advantages"]
                entry["advantages"] = amplified

    # Forking tokens last: only the high-entropy tokens keep their advantage.
    if forking is not None:
        masks = forking_masks([g["rollouts"] for g in groups], forking["rho"], forking["scope"])
        for out_group, group_masks in zip(out_groups, masks, strict=True):
            for entry, mask in zip(out_group["rollouts"], group_masks, strict=True):
                entry["forking_mask"] = mask.astype(np.float64)
                entry["advantages"] = entry["advantages"] * mask

    return {"estimator": estimator, "groups": out_groups}


# ---------------------------------------------------------------------------------------------
# Random valid requests
# ---------------------------------------------------------------------------------------------


def _random_rewards(rng: np.random.Generator, n: int, kind: str, tie_prob: float) -> list[float]:
    """Dyadic rewards (exact in float32, so float32 sums and ties are exact too)."""
    if kind == "mixed":
        kind = str(rng.choice(["binary", "continuous"]))
    if kind == "binary":
        return [float(v) for v in rng.integers(0, 2, size=n)]
    rewards = [float(np.round(rng.uniform(-1.5, 2.0) * 256) / 256) for _ in range(n)]
    for i in range(1, n):
        if rng.random() < tie_prob:
            rewards[i] = rewards[int(rng.integers(0, i))]
    return rewards


def _random_logprobs(rng: np.random.Generator, length: int) -> list[float]:
    """Log-probs <= 0 on a 2^-10 grid (exact in float32)."""
    values = -np.round(rng.exponential(1.0, size=length) * 1024) / 1024
    return [float(v) for v in values]


def _random_token_inputs(
    rng: np.random.Generator,
    logprobs: list[float] | None,
    length: int,
    *,
    entropy: bool,
    sum_pi_squared: bool,
    is_weights: bool,
    entropy_ties: bool,
    planning_mask: bool = False,
) -> dict[str, list[float]]:
    """A rollout's entropy, sum_pi_squared, is_weights and planning_mask, as asked, exact in
    float32."""
    out: dict[str, list[float]] = {}
    if entropy:
        h = rng.exponential(1.0, size=length)
        h = np.round(h * 8) / 8 if entropy_ties else h
        out["entropy"] = [float(v) for v in h.astype(np.float32)]
    if sum_pi_squared:
        if logprobs is None:
            raise ValueError("sum_pi_squared is drawn to match the logprobs: ask for logprobs")
        pi = np.exp(np.asarray(logprobs, dtype=np.float64))
        s = pi**2 + rng.uniform(0.0, 1.0, size=length) * (1.0 - pi) ** 2
        out["sum_pi_squared"] = [float(v) for v in np.clip(s, 1e-6, 1.0).astype(np.float32)]
    if is_weights:
        rho = np.clip(rng.lognormal(0.0, 0.5, size=length), 0.0, 2.0)
        out["is_weights"] = [float(v) for v in rho.astype(np.float32)]
    if planning_mask:
        out["planning_mask"] = [float(v) for v in (rng.random(length) < 0.3)]
    return out


def rollout(
    tokens: list[int], reward: float, logprobs: list[float] | None = None, **teachers: list[float]
) -> dict[str, Any]:
    """A request's rollout; ``teachers`` maps a condition name to its teacher log-probs."""
    out: dict[str, Any] = {"tokens": tokens, "reward": reward}
    if logprobs is not None:
        out["logprobs"] = logprobs
    if teachers:
        out["teacher_logprobs"] = teachers
    return out


def diagnostic_fields(resolved: dict[str, Any]) -> list[str]:
    """``scalar`` plus every diagnostic of the resolved estimator's enabled terms and outcome."""
    name = resolved["outcome"]["name"]
    fields = ["scalar"]
    if resolved["ktae"] is not None:
        fields.append("ktae_score")
    if resolved["cscr"] is not None:
        fields += ["cscr_weight", "sensitivity"]
    if resolved["opsd"] is not None:
        fields.append("opsd_reward")
    if resolved["forking"] is not None:
        fields.append("forking_mask")
    if resolved["hicra"] is not None:
        fields += ["planning_mask", "hicra_bonus"]
    if name == "otb":
        fields.append("otb_baseline")
    if name in ("gtpo", "grpo_s"):
        fields.append(f"{name}_reward")
    return fields


def _random_components(rng: np.random.Generator, reward: float) -> dict[str, float | None]:
    """Two named rewards for GDPO: the request's reward and a binary one, each missing (None)
    now and then, as TRL's reward functions may answer None."""
    return {
        "accuracy": None if rng.random() < 0.1 else float(reward),
        "format": None if rng.random() < 0.1 else float(rng.integers(0, 2)),
    }


def random_request(
    rng: np.random.Generator,
    *,
    estimator: str | dict[str, Any] | None = "grpo",
    n_groups: tuple[int, int] = (1, 4),
    group_size: tuple[int, int] = (1, 6),
    length: tuple[int, int] = (0, 12),
    empty_prob: float = 0.1,
    vocab: int = 10,
    reward_kind: str = "mixed",
    tie_prob: float = 0.3,
    logprobs: bool | None = None,
    teachers: Sequence[str] | None = None,
    ignore_token_ids: Sequence[int] | None = None,
    return_fields: Sequence[str] | None = None,
    sensitive_prob: float = 0.5,
    entropy: bool | None = None,
    sum_pi_squared: bool | None = None,
    is_weights: bool = False,
    entropy_ties: bool = True,
    planning_mask: bool | None = None,
) -> dict[str, Any]:
    """A valid random request.

    ``n_groups``, ``group_size`` and ``length`` are inclusive (low, high) ranges; a rollout is
    empty with probability ``empty_prob`` on top of that. Tokens come from ``range(vocab)`` so
    they repeat. ``reward_kind`` is "binary" (0/1), "continuous" (dyadic values with ties at
    ``tie_prob``) or "mixed" (per group). ``logprobs`` and ``teachers`` default to whatever the
    estimator needs (``teachers`` is a list of condition names). ``sensitive_prob`` is the chance
    that a teacher pair differs by more than the CSCR onset at a token. ``return_fields``
    defaults to ``scalar`` plus every diagnostic of an enabled term.

    ``entropy``, ``sum_pi_squared`` and ``planning_mask`` default to whether the estimator needs
    them (forking, gtpo, grpo_s; otb; hicra), ``is_weights`` adds importance weights; they are
    drawn after a rollout's other values, so requests without them are those of earlier versions
    of this function. For ``maxrl`` the rewards are made >= 0 (their absolute values).
    Entropies sit on a 1/8 grid with ``entropy_ties`` (many exact ties); sum_pi_squared is
    consistent with the logprobs (pi^2 + u (1 - pi)^2), all values exact in float32.
    """
    resolved = resolve_estimator(estimator)
    outcome_name = resolved["outcome"]["name"]
    otb = outcome_name == "otb"
    if logprobs is None:
        logprobs = resolved["opsd"] is not None or otb
    if entropy is None:
        entropy = resolved["forking"] is not None or outcome_name in ("gtpo", "grpo_s")
    if sum_pi_squared is None:
        sum_pi_squared = otb
    if planning_mask is None:
        planning_mask = resolved["hicra"] is not None
    if teachers is None:
        names: list[str] = []
        if resolved["cscr"] is not None:
            names += [resolved["cscr"]["positive"], resolved["cscr"]["negative"]]
        if resolved["opsd"] is not None:
            names.append(resolved["opsd"]["teacher"])
        teachers = list(dict.fromkeys(names))
    if return_fields is None:
        return_fields = diagnostic_fields(resolved)
    min_group = (
        max(group_size[0], 2) if resolved["outcome"]["name"] == "grpo_passk" else group_size[0]
    )

    groups = []
    for g in range(int(rng.integers(n_groups[0], n_groups[1] + 1))):
        size = int(rng.integers(min_group, max(min_group, group_size[1]) + 1))
        rewards = _random_rewards(rng, size, reward_kind, tie_prob)
        if outcome_name in NONNEGATIVE_OUTCOME_NAMES:
            rewards = [abs(r) for r in rewards]
        rollouts = []
        for i in range(size):
            t = 0 if rng.random() < empty_prob else int(rng.integers(length[0], length[1] + 1))
            rollout: dict[str, Any] = {
                "tokens": [int(v) for v in rng.integers(0, vocab, size=t)],
                "reward": rewards[i],
            }
            if outcome_name in COMPONENT_OUTCOME_NAMES:
                rollout["reward_components"] = _random_components(rng, rewards[i])
            if logprobs:
                rollout["logprobs"] = _random_logprobs(rng, t)
            if teachers:
                base = _random_logprobs(rng, t)
                conditions: dict[str, list[float]] = {}
                for k, name in enumerate(teachers):
                    if k == 0:
                        conditions[name] = base
                        continue
                    shifted = []
                    for v in base:
                        if rng.random() < sensitive_prob:
                            v = -abs(v + float(np.round(rng.normal(0, 1.0) * 1024) / 1024))
                        elif rng.random() < 0.5:
                            v = min(
                                0.0, v + float(np.round(rng.uniform(-0.04, 0.04) * 1024) / 1024)
                            )
                        shifted.append(float(v))
                    conditions[name] = shifted
                rollout["teacher_logprobs"] = conditions
            rollout.update(
                _random_token_inputs(
                    rng,
                    rollout.get("logprobs"),
                    t,
                    entropy=entropy,
                    sum_pi_squared=sum_pi_squared,
                    is_weights=is_weights,
                    entropy_ties=entropy_ties,
                    planning_mask=planning_mask,
                )
            )
            rollouts.append(rollout)
        groups.append({"id": f"g{g}", "rollouts": rollouts})

    request: dict[str, Any] = {
        "request_id": f"oracle-{int(rng.integers(0, 2**31))}",
        "return": list(return_fields),
        "groups": groups,
    }
    if estimator is not None:
        request["estimator"] = copy.deepcopy(estimator)
    if ignore_token_ids:
        request["ignore_token_ids"] = [int(t) for t in ignore_token_ids]
    return request


# ---------------------------------------------------------------------------------------------
# Per-token methods over token-level inputs: forking tokens and OTB
#
# A group here is a list of rollouts, each a dict with the JSON request's field names: "reward",
# and the per-token lists "entropy", "logprobs", "sum_pi_squared", optionally "is_weights".
# ---------------------------------------------------------------------------------------------

FLOAT32_RANK_LIMIT = 2**24


def round_to_float32(value: Fraction) -> np.float32:
    """The float32 nearest to the exact ``value`` (ties to even): one rounding, as a fused
    multiply-add rounds."""
    guess = np.float32(float(value))
    candidates = [
        np.nextafter(guess, np.float32(-np.inf)),
        guess,
        np.nextafter(guess, np.float32(np.inf)),
    ]

    def distance_then_odd(c: np.float32) -> tuple[Fraction, int]:
        return abs(Fraction(float(c)) - value), int(np.array(c).view(np.int32)) & 1

    return min(candidates, key=distance_then_odd)


def torch_linear_quantile(values: Sequence[float], q: float) -> np.float32:
    """torch.quantile(values as float32, q): linear interpolation, with torch's float32 steps.

    q becomes float32; rank = float32(q) * (n - 1), rounded to float32; lo, hi = the sorted
    values at floor(rank) and ceil(rank); w = rank - floor(rank) (exact). torch.lerp then gives
    lo + w (hi - lo) for w < 0.5 and hi - (hi - lo)(1 - w) otherwise, with hi - lo and 1 - w
    rounded to float32 and the rest a fused multiply-add (rounded once). Only for n <= 2^24,
    the most torch.quantile accepts.
    """
    ordered = sorted(np.float32(v) for v in values)
    n = len(ordered)
    if not 0 < n <= FLOAT32_RANK_LIMIT:
        raise ValueError(f"torch.quantile takes 1 to 2^24 values, got {n}")
    rank = np.float32(q) * np.float32(n - 1)
    lo, hi = ordered[math.floor(rank)], ordered[math.ceil(rank)]
    weight = rank - np.float32(math.floor(rank))
    diff = Fraction(float(np.float32(hi - lo)))
    if weight < 0.5:
        return round_to_float32(Fraction(float(lo)) + Fraction(float(weight)) * diff)
    one_minus = Fraction(float(np.float32(1.0) - weight))
    return round_to_float32(Fraction(float(hi)) - diff * one_minus)


def forking_masks(
    groups: list[list[dict[str, Any]]], rho: float, scope: str
) -> list[list[np.ndarray]]:
    """Per group, per rollout, the forking-token mask m_t = H_t >= tau (bool arrays).

    tau = the (1 - rho) quantile (torch.quantile semantics) of the entropies of every token of
    the request (scope "request") or of the group's tokens (scope "group").
    """

    def entropies(rollouts: list[dict[str, Any]]) -> list[float]:
        return [float(np.float32(h)) for r in rollouts for h in r["entropy"]]

    everything = [h for rollouts in groups for h in entropies(rollouts)]
    masks = []
    for rollouts in groups:
        pool = everything if scope == "request" else entropies(rollouts)
        tau = torch_linear_quantile(pool, 1.0 - rho) if pool else np.float32(np.inf)
        masks.append(
            [np.array([np.float32(h) >= tau for h in r["entropy"]], dtype=bool) for r in rollouts]
        )
    return masks


def otb_group(
    rollouts: list[dict[str, Any]], epsilon: float = 1e-8, handle_zero_tail: bool = True
) -> list[tuple[np.ndarray, np.ndarray]]:
    """OTB for one group: per rollout, (baseline B_t, advantage a_t = r - B_t), float64.

    w_t = 1 - 2 exp(logprob_t) + sum_pi_squared_t (times is_weight_t^2 when given);
    W_t = w_0 + ... + w_t; B_t = sum_i r_i W_it / (sum_i W_it + epsilon) over the rollouts with
    more than t tokens; B = 0 for a group of one; with handle_zero_tail, a unique longest
    rollout has B_t = 0 for t >= the second longest length.
    """
    lengths = [len(r["logprobs"]) for r in rollouts]
    cumulative_w = []
    for r in rollouts:
        running, path = 0.0, []
        for t in range(len(r["logprobs"])):
            w = 1.0 - 2.0 * math.exp(float(r["logprobs"][t])) + float(r["sum_pi_squared"][t])
            if r.get("is_weights") is not None:
                w *= float(r["is_weights"][t]) ** 2
            running += w
            path.append(running)
        cumulative_w.append(path)

    baselines = [np.zeros(t, dtype=np.float64) for t in lengths]
    if len(rollouts) > 1:
        for t in range(max(lengths)):
            alive = [i for i in range(len(rollouts)) if lengths[i] > t]
            numerator = sum(float(rollouts[i]["reward"]) * cumulative_w[i][t] for i in alive)
            denominator = sum(cumulative_w[i][t] for i in alive)
            for i in alive:
                baselines[i][t] = numerator / (denominator + epsilon)
        longest = max(lengths)
        at_longest = [i for i in range(len(rollouts)) if lengths[i] == longest]
        if handle_zero_tail and len(at_longest) == 1:
            second = sorted(lengths)[-2]
            baselines[at_longest[0]][second:] = 0.0
    return [(b, float(r["reward"]) - b) for b, r in zip(baselines, rollouts, strict=True)]


def random_token_groups(
    rng: np.random.Generator,
    *,
    n_groups: tuple[int, int] = (1, 5),
    group_size: tuple[int, int] = (1, 6),
    length: tuple[int, int] = (0, 20),
    empty_prob: float = 0.15,
    entropy_ties: bool = True,
    is_weights: bool = False,
    equal_rewards_prob: float = 0.2,
) -> list[list[dict[str, Any]]]:
    """Random groups for the per-token methods; ranges are inclusive (low, high).

    Entropies sit on a 1/8 grid when ``entropy_ties`` (many exact ties), else continuous.
    Probabilities are consistent: pi = exp(logprob) and sum_pi_squared in
    [pi^2, pi^2 + (1 - pi)^2] (the rest of the mass spread out or on one token), so w >= 0;
    pi is at most 0.9 (w >= 0.01, so float32 rounding of w stays small next to it) or exactly 1
    (w = 0).
    Some groups have one reward for every rollout (``equal_rewards_prob``).
    """
    groups = []
    for _ in range(int(rng.integers(n_groups[0], n_groups[1] + 1))):
        size = int(rng.integers(group_size[0], group_size[1] + 1))
        same = rng.random() < equal_rewards_prob
        shared = float(rng.integers(0, 2))
        rollouts = []
        for _ in range(size):
            t = 0 if rng.random() < empty_prob else int(rng.integers(length[0], length[1] + 1))
            pi = rng.uniform(0.0, 0.9, size=t).astype(np.float32)
            pi[rng.random(t) < 0.1] = 1.0  # then sum_pi_squared = 1 and w = 0 exactly
            logprobs = np.log(np.maximum(pi, np.float32(1e-6))).astype(np.float32)
            pi = np.exp(logprobs.astype(np.float64))
            rest = (1.0 - pi) ** 2 * rng.uniform(0.0, 1.0, size=t)
            sum_pi_squared = np.clip(pi**2 + rest, 1e-6, 1.0).astype(np.float32)
            if entropy_ties:
                entropy = np.round(rng.exponential(1.0, size=t) * 8) / 8
            else:
                entropy = rng.exponential(1.0, size=t)
            rollout: dict[str, Any] = {
                "reward": shared if same else float(np.round(rng.uniform(-1, 2) * 64) / 64),
                "entropy": [float(v) for v in entropy.astype(np.float32)],
                "logprobs": [float(v) for v in logprobs],
                "sum_pi_squared": [float(v) for v in sum_pi_squared],
            }
            if is_weights:
                rho = np.clip(rng.lognormal(0.0, 0.5, size=t), 0.0, 2.0).astype(np.float32)
                rollout["is_weights"] = [float(v) for v in rho]
            rollouts.append(rollout)
        groups.append(rollouts)
    return groups


# ---------------------------------------------------------------------------------------------
# Dynamic entropy weighting (GTPO and GRPO-S) and HICRA
#
# GTPO, per group: at every position t, over the correct rollouts (reward above the threshold)
# that reach t, a rollout's share is H_it / sum H_kt (equal shares where every H is 0); over
# the wrong ones, (1/H_it) / sum 1/H_kt (where some H is 0, those share equally, the others get
# 0). Entropies below 0 count as 0. Shaped token rewards:
#     correct: alpha1 r_i + alpha2 d_t share,    wrong: -alpha1 - alpha2 h_t share
# (d_t, h_t: the class's rollouts that reach t). Each class is normalised over all the group's
# tokens, the other class's tokens counting 0: (x - mean) / (sample std + eps), 0 / 0 = 0. A
# group without both classes gets advantage 0 everywhere.
# GRPO-S: the same per rollout, with the mean token entropy of each rollout that has tokens in
# place of H_it (an empty rollout takes no share and is not counted in d or h), normalised over
# the group's rollouts.
# ---------------------------------------------------------------------------------------------


def entropy_shares(values: list[float], inverse: bool) -> list[float]:
    """The shares of one class at one position (or of one class's rollouts): H / sum H (equal
    shares when every H is 0), or with ``inverse`` (1/H) / sum (1/H) (the H = 0 ones share
    equally when there are any)."""
    n = len(values)
    if not inverse:
        total = sum(values)
        if total == 0:
            return [1.0 / n] * n
        return [v / total for v in values]
    zeros = [v == 0 for v in values]
    if any(zeros):
        count = sum(zeros)
        return [1.0 / count if z else 0.0 for z in zeros]
    inv_total = sum(1.0 / v for v in values)
    return [(1.0 / v) / inv_total for v in values]


def standardise(own: list[float], epsilon: float) -> list[float]:
    """(x - mean) / (std + epsilon) for each x of ``own``, mean and sample std taken over
    ``own``; 0 / 0 = 0."""
    pool = list(own)
    n = len(pool)
    mean = sum(pool) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in pool) / (n - 1)) if n >= 2 else 0.0
    out = []
    for x in own:
        numerator = x - mean
        denominator = std + epsilon
        out.append(0.0 if denominator == 0 else numerator / denominator)
    return out


@dataclass(frozen=True)
class Shaping:
    """The parameters GTPO and GRPO-S share, with their defaults (docs/estimator-config.md)."""

    alpha1: float = 1.0
    alpha2: float = 0.1
    correct_threshold: float = 0.0
    epsilon: float = 1e-6


def gtpo_group(
    rollouts: list[dict[str, Any]], **params: float
) -> list[tuple[np.ndarray, np.ndarray]]:
    """GTPO for one group: per rollout, (shaped token rewards, token advantages), float64.
    ``params``: those of :class:`Shaping`."""
    shaping = Shaping(**params)
    alpha1, alpha2, epsilon = shaping.alpha1, shaping.alpha2, shaping.epsilon
    correct = [float(r["reward"]) > shaping.correct_threshold for r in rollouts]
    entropy = [[max(0.0, float(h)) for h in r["entropy"]] for r in rollouts]
    lengths = [len(h) for h in entropy]
    shaped = [np.zeros(t, dtype=np.float64) for t in lengths]
    for t in range(max(lengths, default=0)):
        for cls in (True, False):
            alive = [i for i in range(len(rollouts)) if correct[i] == cls and lengths[i] > t]
            if not alive:
                continue
            shares = entropy_shares([entropy[i][t] for i in alive], inverse=not cls)
            for i, share in zip(alive, shares, strict=True):
                if cls:
                    shaped[i][t] = (
                        alpha1 * float(rollouts[i]["reward"]) + alpha2 * len(alive) * share
                    )
                else:
                    shaped[i][t] = -alpha1 - alpha2 * len(alive) * share
    advantages = [np.zeros(t, dtype=np.float64) for t in lengths]
    if any(correct) and not all(correct):
        for cls in (True, False):
            # Eq. 6: each class over its own tokens in the group.
            members = [i for i in range(len(rollouts)) if correct[i] == cls]
            own = [float(x) for i in members for x in shaped[i]]
            normalised = standardise(own, epsilon) if own else []
            start = 0
            for i in members:
                advantages[i] = np.array(normalised[start : start + lengths[i]], dtype=np.float64)
                start += lengths[i]
    return list(zip(shaped, advantages, strict=True))


def gtpo_request(
    groups: list[list[dict[str, Any]]], **params: float
) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """GTPO with Eq. 6 over the request (scope ``request``): per group and rollout, (shaped token
    rewards, token advantages): the shaped rewards :func:`gtpo_group`'s, each class standardised
    over its tokens in every group with contrast; a group without contrast gets 0."""
    shaping = Shaping(**params)
    per_group = [gtpo_group(rollouts, **params) for rollouts in groups]
    correct = [[float(r["reward"]) > shaping.correct_threshold for r in g] for g in groups]
    contrast = [any(c) and not all(c) for c in correct]
    out = [[(shaped, np.zeros(shaped.size)) for shaped, _ in pairs] for pairs in per_group]
    for cls in (True, False):
        members = [
            (g, i)
            for g, flags in enumerate(correct)
            if contrast[g]
            for i, flag in enumerate(flags)
            if flag == cls
        ]
        own = [float(x) for g, i in members for x in per_group[g][i][0]]
        normalised = standardise(own, shaping.epsilon) if own else []
        start = 0
        for g, i in members:
            shaped = per_group[g][i][0]
            out[g][i] = (shaped, np.array(normalised[start : start + shaped.size]))
            start += shaped.size
    return out


def grpo_s_group(rollouts: list[dict[str, Any]], **params: float) -> list[tuple[float, float]]:
    """GRPO-S for one group: per rollout, (shaped reward, advantage). ``params``: those of
    :class:`Shaping`."""
    shaping = Shaping(**params)
    alpha1, alpha2, epsilon = shaping.alpha1, shaping.alpha2, shaping.epsilon
    correct = [float(r["reward"]) > shaping.correct_threshold for r in rollouts]
    mean_entropy = [
        sum(max(0.0, float(h)) for h in r["entropy"]) / len(r["entropy"]) if r["entropy"] else None
        for r in rollouts
    ]
    shaped = [
        alpha1 * float(r["reward"]) if ok else -alpha1
        for r, ok in zip(rollouts, correct, strict=True)
    ]
    for cls in (True, False):
        members = [
            i for i in range(len(rollouts)) if correct[i] == cls and mean_entropy[i] is not None
        ]
        if not members:
            continue
        shares = entropy_shares([mean_entropy[i] for i in members], inverse=not cls)  # type: ignore[misc]
        for i, share in zip(members, shares, strict=True):
            shaped[i] += (1.0 if cls else -1.0) * alpha2 * len(members) * share
    advantages = [0.0] * len(rollouts)
    if any(correct) and not all(correct):
        # As GRPO: over the group's rollouts, both classes together.
        advantages = standardise(shaped, epsilon)
    return list(zip(shaped, advantages, strict=True))


def hicra_amplify(advantages: np.ndarray, planning_mask: Any, alpha: float) -> np.ndarray:
    """A + alpha |A| m on each token."""
    mask = np.asarray(planning_mask, dtype=np.float64).reshape(len(advantages))
    return advantages + alpha * np.abs(advantages) * mask
